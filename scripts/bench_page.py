"""The first screen of BENCHMARKS.md: one table and one picture, made from the benchmarks' JSON.

    python scripts/bench_page.py          # docs/bench/*.json -> BENCHMARKS.md's table + docs/bench/paths.svg
    python scripts/bench_page.py --run    # first run every benchmark of the table, writing docs/bench/*.json

Each path of ``PATHS`` names the script and arguments that measure it, the row of that script's
``--json`` output that is the engine, the rows that are peers (the best one is shown) and the row that
is the machine's limit, all from the same run.  A path with no JSON file yet is listed as not measured.
The GPU row reads ``scripts/gpu_check.py``'s JSON of the last GPU run.  Nothing here measures: it only
reads, so the page cannot show a figure that no command produced.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shlex
import subprocess
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "bench")
PAGE = os.path.join(ROOT, "BENCHMARKS.md")
PICTURE = os.path.join(DATA, "paths.svg")
START, END = "<!-- table: made by scripts/bench_page.py -->", "<!-- end of table -->"


class Path(NamedTuple):
    name: str
    stem: str  # docs/bench/<stem>.json: what this path's engine and peer rows come from
    engine: str  # "case | impl": regular expressions, searched
    peers: tuple[str, ...] = ()
    limit: str | None = None  # "[stem:]case | impl": a limit measured by another script of the same --run
    unit: str = "GB/s"  # or "ms": lower is better, ratios are time ratios
    label: str = ""  # what the peer column's row is, where its impl does not say it
    limit_label: str = ""  # likewise for the limit column


GPU = "gpu_check-warm-2026-11-26"  # what the H100 printed for the last GPU run (shared/gpu-runs)
#: each script once, at the sizes of the table (about 30 minutes on the 2-core VM); GPU: by hand
COMMANDS = {
    "core": "scripts/bench_core.py --only header100k first_open_pt lazy2g pread2g save2g --repeat 5",
    "host": "scripts/bench_host.py --size 1GB --runs 5 --reps 3",
    "tp": "scripts/bench_tp.py --runs 3 --only warm --impls engine reference floor",
    "remote": "scripts/bench_remote.py --size 1GB --runs 3 --peers-python /tmp/peers/bin/python --rows "
              "\"engine http,engine http device,GETs + reference,safetensors-streaming,fault limit (no network)\"",
    "group": "scripts/bench_group.py --ranks 4 --mb 96 --rate-mb 40 --runs 3",
    "checksums": "scripts/bench_checksums.py --size 512MiB --runs 5 --reps 3",
    "kernels": "scripts/bench_kernels.py --size 256MiB --only stats_bf16 quant_row",
    "vllm": "scripts/bench_vllm.py --gb 1 --runs 5 --python ~/.cache/safetensors-engine/vllm-lane-venv/bin/python",
    GPU: "scripts/gpu_check.py --wheels .whl --out OUT",  # on a GPU host: its gpu_check-warm.json
}
PATHS = [
    Path("local file -> CPU, owned (`load_file`, pread)", "core", "owned load|^engine$", ("owned load|reference",),
         r"remote:\[fault limit|"),
    Path("local file -> CPU, mapped, every byte read", "core", "lazy load|^engine$", ("lazy load|reference",)),
    *(Path(f"local file -> existing CPU tensors (`load_into`), page cache in {folios}", "host",
           rf"^load_into \[{folios}\], repeated|^engine$", (rf"^load_into \[{folios}\], repeated|^reference$",),
           r"^warm file -> CPU memory$|^limit: native memcpy$") for folios in ("large folios", "4 KiB pages")),
    Path("per-key loop, 100,000 tensors (`get_slice` shape + dtype)", "core", "open 100,000|^engine$",
         ("open 100,000|reference",), unit="ms"),
    Path("first `safe_open` + 291 shapes, torch imported", "core", "torch imported|^engine$",
         ("torch imported|reference",), unit="ms"),
    Path("`save_file`, 2 GB", "core", "save_file|^engine$", ("save_file|reference",)),
    Path("tensor parallel: 4 ranks' shards of one file", "tp", "ranks|^engine$", ("ranks|reference",),
         "ranks|limit", label="reference: views, bytes not read", limit_label="bare preadv of each shard"),
    Path("URL -> CPU, owned (`load_file(url)`)", "remote", r"\[engine http\]|^engine$",
         (r"\[GETs \+ reference\]|", r"\[safetensors-streaming\]|"), r"\[line rate\]|"),
    Path("URL -> device (emulated CUDA runtime, the ring)", "remote", r"\[engine http device\]|^engine$",
         (), r"\[line rate\]|"),
    Path("4 ranks, one URL, `process_group`", "group", "4 ranks|process_group", ("4 ranks|^engine$",),
         "one rank alone|^engine$", label="4 independent loads", limit_label="one rank alone"),
    Path("checksums verified in an owned load", "checksums", "owned load|engine, verify",
         ("owned load|engine, skip",), "owned load|plain file", label="the same load, unchecked",
         limit_label="a file without checksums"),
    Path("statistics of a BF16 tensor (Numba)", "kernels", "stats_bf16|^engine$", ("stats_bf16|numpy$",)),
    Path("int8 per-row quantization (Numba)", "kernels", "quant_row|^engine$", ("quant_row|torch$",)),
    Path("vLLM weight loading (CPU build)", "vllm", "vLLM|^engine$", ("vLLM|reference|runai",),
         label="vLLM's own safetensors loader"),
    Path("file -> GPU, last GPU run (old design; H100)", GPU, r"^engine load_file\(directory\)$|",
         ("InstantTensor|", "fastsafetensors|", "reference load_file|"), "pinned host-to-device|"),
]


def rows_of(doc: dict) -> list[dict]:
    """One shape for both kinds of JSON: the harness's ``rows`` and gpu_check's ``rows`` with ``row``."""
    out = []
    for r in doc.get("rows", []):
        if "case" not in r and "row" in r:  # gpu_check: "engine load_file(f) per shard", "limit: ..."
            name = r["row"]
            impl = "limit" if name.startswith("limit") else name.split(" ")[0]
            r = dict(r, case=name, impl=impl)
        if r.get("equal") is False or r.get("error"):  # bytes that differ from the file's are no figure
            continue
        if r.get("gbps") is not None or r.get("median_s") is not None:
            out.append(r)
    return out


def pick(rows: list[dict], pattern: str, unit: str) -> dict | None:
    """The best row whose ``case | impl`` matches ``pattern`` (fastest; highest GB/s)."""
    case_p, _, impl_p = pattern.partition("|")
    found = [r for r in rows if (re.search(case_p, r["case"]) or re.search(case_p, f"[{r.get('row', '')}]"))
             and re.search(impl_p, r["impl"])]
    key = (lambda r: r["gbps"] or 0.0) if unit == "GB/s" else (lambda r: -(r["median_s"] or 1e9))
    return max(found, key=key, default=None)


def value(row: dict | None, unit: str) -> float | None:
    if row is None:
        return None
    return row.get("gbps") if unit == "GB/s" else row["median_s"] * 1e3


def ratio(a: float | None, b: float | None, unit: str) -> str:
    """How many times the speed of ``b`` the engine's ``a`` is (above 1: faster)."""
    if not a or not b:
        return ""
    return f"{(a / b if unit == 'GB/s' else b / a):.2f}x"


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def write(path: str, text: str) -> None:
    """Whole or not at all: a reader never sees half a page."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def load(stem: str) -> dict | None:
    path = os.path.join(DATA, stem + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def measured(p: Path) -> dict | None:
    doc = load(p.stem)
    if doc is None:
        return None
    rows = rows_of(doc)
    eng = pick(rows, p.engine, p.unit)
    peers = [r for r in (pick(rows, q, p.unit) for q in p.peers) if r is not None]
    peer = max(peers, key=lambda r: (value(r, p.unit) or 0.0) * (1 if p.unit == "GB/s" else -1), default=None)
    lim = None
    if p.limit:
        stem, sep, pattern = p.limit.partition(":") if re.match(r"^\w+:", p.limit) else ("", "", p.limit)
        other = load(stem) if sep else doc
        lim = pick(rows_of(other), pattern, "GB/s") if other else None
    meta = doc.get("meta") or doc
    machine = meta.get("machine") or {}
    where = meta.get("device_name") or (f"{machine.get('cores')}-core VM" if machine.get("cores") else "")
    date = str(meta.get("date", ""))[:10]
    return dict(engine=eng, peer=peer, limit=lim, where=where, date=date, commit=meta.get("commit", ""))


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f} {unit}" if unit == "GB/s" else f"{v:.1f} ms"


def table(found: dict[str, dict | None]) -> str:
    lines = ["| path | engine | best peer, same run | machine's limit | x peer | x limit | run | command |",
             "|---|---:|---|---:|---:|---:|---|---|"]
    for p in PATHS:
        m = found[p.name]
        cmd = f"`python {COMMANDS[p.stem]}`"
        if m is None or m["engine"] is None:
            lines.append(f"| {p.name} | not measured | | | | | | {cmd} |")
            continue
        e, peer, lim = (value(m[k], p.unit) for k in ("engine", "peer", "limit"))
        peer_txt = f"{fmt(peer, p.unit)} ({p.label or m['peer']['impl']})" if m["peer"] else "-"
        lim_txt = fmt(value(m["limit"], "GB/s"), "GB/s") if m["limit"] else "-"
        if m["limit"] and p.limit_label:
            lim_txt += f" ({p.limit_label})"
        x_lim = ratio(e, value(m["limit"], "GB/s"), "GB/s") if m["limit"] and p.unit == "GB/s" else ""
        run = f"{m['date']}, {m['where']}" + (f", {m['commit']}" if m["commit"] else "")
        lines.append(f"| {p.name} | {fmt(e, p.unit)} | {peer_txt} | {lim_txt} | {ratio(e, peer, p.unit)} "
                     f"| {x_lim} | {run} | {cmd} |")
    return "\n".join(lines)


def picture(found: dict[str, dict | None]) -> str:
    """Small multiples: one group of bars per path, each group on its own scale (paths differ by 100x)."""
    bar_h, gap, label_w, bar_w = 14, 10, 250, 420
    colours = {"engine": "#1f77b4", "peer": "#ff7f0e", "limit": "#7f7f7f"}
    groups = [(p, found[p.name]) for p in PATHS if p.unit == "GB/s" and found[p.name] and found[p.name]["engine"]]
    height = 40 + sum(3 * bar_h + gap + 16 for _ in groups)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 190}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           '<text x="4" y="16" font-size="13">GB/s per path: engine, best peer in the same run, '
           "the machine's limit (each path on its own scale)</text>"]
    y = 32
    for p, m in groups:
        bars = [(k, m[k]) for k in ("engine", "peer", "limit") if m[k] is not None]
        top = max(value(r, "GB/s") or 0.0 for _, r in bars) or 1.0
        title = p.name.replace("`", "") + f" ({m['date']}, {m['where']})"
        out.append(f'<text x="4" y="{y + 11}" font-weight="bold">{html.escape(title)}</text>')
        y += 16
        for k, r in bars:
            v = value(r, "GB/s") or 0.0
            w = max(1, round(bar_w * v / top))
            who = {"engine": "engine", "peer": p.label, "limit": p.limit_label}[k] or r["impl"]
            out.append(f'<text x="{label_w - 6}" y="{y + 11}" text-anchor="end">{html.escape(who)}</text>')
            out.append(f'<rect x="{label_w}" y="{y}" width="{w}" height="{bar_h - 2}" fill="{colours[k]}"/>')
            out.append(f'<text x="{label_w + w + 4}" y="{y + 11}">{v:.2f}</text>')
            y += bar_h
        y += gap
    out.append("</svg>")
    return "\n".join(out) + "\n"


def run_all() -> int:
    """Each script of ``COMMANDS`` once, in this process's Python, writing its JSON into ``DATA``."""
    os.makedirs(DATA, exist_ok=True)
    failed = 0
    for stem, command in COMMANDS.items():
        if stem == GPU:
            continue
        argv = [sys.executable, *(os.path.expanduser(w) for w in shlex.split(command)),
                "--json", os.path.join(DATA, stem + ".json")]
        print("$", " ".join(argv[1:]), flush=True)
        failed += subprocess.call(argv, cwd=ROOT) != 0
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run every benchmark of the table first")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page or picture is not what the JSON gives")
    a = ap.parse_args(argv)
    if a.run and run_all():
        print("a benchmark failed; the page is made from what is there", file=sys.stderr)
    found = {p.name: measured(p) for p in PATHS}
    svg, tab = picture(found), table(found)
    with open(PAGE) as f:
        page = f.read()
    head, sep, rest = page.partition(START)
    if not sep or END not in rest:
        print(f"{PAGE} has no {START} ... {END} block", file=sys.stderr)
        return 2
    new = head + START + "\n" + tab + "\n" + END + rest.split(END, 1)[1]
    old_svg = read(PICTURE) if os.path.exists(PICTURE) else ""
    if a.check:
        stale = [n for n, old, now in (("BENCHMARKS.md", page, new), ("paths.svg", old_svg, svg)) if old != now]
        print("stale: " + ", ".join(stale) if stale else "page and picture match the JSON")
        return 1 if stale else 0
    write(PAGE, new)
    write(PICTURE, svg)
    print(f"wrote {os.path.relpath(PAGE, ROOT)} and {os.path.relpath(PICTURE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
