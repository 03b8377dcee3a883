#!/usr/bin/env python
"""Core benchmarks of safetensors-engine against the reference ``safetensors`` package.

Measures the targets of the performance issue, engine and reference in the same run,
interleaved rep by rep so that drift and neighbours' load hit both alike:

  header100k    open a file of 100,000 tensors and read every dtype and shape
  header_small  open a file of a few hundred tensors (microseconds per open)
  first_open    import + first safe_open + every dtype and shape of that file, in a bare
                fresh interpreter (what a short-lived tool pays)
  first_tensor  the same, then one get_tensor (numpy imported on both sides: the engine
                imports none for headers alone)
  first_open_pt   first_open with framework="pt" in a process that has imported torch
                  (untimed): every transformers, vLLM or accelerate process
  first_tensor_pt the same, then one get_tensor (a BF16 torch tensor)
  lazy2g        lazy (mmap) load of a 2 GB BF16 checkpoint, then read every byte
  many_load     load_file of 100,000 tiny tensors
  save2g        save_file of a 2 GB BF16 checkpoint, time and extra peak RSS
  pread2g       owned load (backend="pread") of the 2 GB checkpoint

Every sample runs in a fresh Python process, after an untimed warm-up on a one-tensor
file that pays imports and lazy first-use costs alike for both libraries (torch with one
intra-op thread, so the read loop does not spin on a busy core), so no sample
profits from caches an earlier one filled and peak memory is the operation's own.  Data
files are read beforehand so the page cache is warm; saves start after an ``os.sync()``.
``header_small`` repeats its open in one process and reports the median per call.

Usage::

    python scripts/bench_core.py --quick              # smoke run, small sizes, ~3 min
    python scripts/bench_core.py --json bench.json    # the full run: ~4.1 GB of disk, ~9 min
    python scripts/bench_core.py --only header100k many_load --repeat 9

GB/s is 1e9 bytes per second of tensor data; "ref/x" is the reference's median time over
this row's (above 1: faster than the reference).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# measure the checkout this script lives in (its extension built in place, see
# asv_benchmarks/README.md), and share the asv suites' data generators
sys.path[:0] = [REPO, os.path.join(REPO, "asv_benchmarks")]
from benchmarks import common  # noqa: E402

GB = 1e9
MB = 1 << 20

# --------------------------------------------------------------------------- sizes


def sizes(quick: bool) -> dict:
    if quick:
        return {"many": 10_000, "ckpt": 64 << 20, "small_layers": 32, "small_loops": 200}
    return {"many": 100_000, "ckpt": 2_000_000_000, "small_layers": 32, "small_loops": 2000}


# --------------------------------------------------------------------------- cases
#
# impl names: "reference" is the safetensors package; every other impl is the engine.
# goal: (kind, value); "ratio" = ref/x at least value, "max_us" = median under value µs,
# "peak_mb" adds an extra-peak-RSS bound to the ratio goal.

CASES = {
    "header100k": {
        "title": "open {many:,} tensors, every dtype+shape",
        "file": "many",
        "impls": ["reference", "engine", "engine-bulk", "engine-parse"],
        "goal": ("ratio", 5.0),
        "notes": {
            "reference": "safe_open + get_slice(k).get_shape()/get_dtype() for all keys",
            "engine": "engine.safe_open, the identical loop",
            "engine-bulk": "engine.read_header + table (names, codes, shapes) -> dict",
            "engine-parse": "engine.read_header only",
        },
    },
    "header_small": {
        "title": "open {small_n} tensors (per open)",
        "file": "small",
        "impls": ["reference", "engine", "engine-header"],
        "goal": ("max_us", 1000.0),
        "inproc": True,
        "notes": {
            "reference": "safe_open(..., 'pt') + keys()",
            "engine": "engine.safe_open(..., 'pt') + keys()",
            "engine-header": "engine.read_header + keys()",
        },
    },
    "first_open": {
        "title": "import + first open of {small_n} tensors, every dtype+shape",
        "file": "small",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 1.0),
        "notes": {
            "reference": "import safetensors; safe_open(..., 'np'); get_slice(k).get_dtype()/get_shape() for all keys",
            "engine": "import engine; the identical calls",
        },
    },
    "first_tensor": {
        "title": "first_open, then one get_tensor ({small_n} F32 tensors)",
        "file": "small_f32",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 1.0),
        "notes": {
            "reference": "first_open's calls + get_tensor(first key)",
            "engine": "the identical calls",
        },
    },
    "first_open_pt": {
        "title": "torch imported, then import + first open of {small_n} tensors ('pt'), every dtype+shape",
        "file": "small",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 1.0),
        "notes": {
            "reference": "import torch (untimed); import safetensors; safe_open(..., 'pt'); every get_dtype/get_shape",
            "engine": "import torch (untimed); import engine; the identical calls",
        },
    },
    "first_tensor_pt": {
        "title": "first_open_pt, then one get_tensor ({small_n} BF16 tensors)",
        "file": "small",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 1.0),
        "notes": {
            "reference": "first_open_pt's calls + get_tensor(first key)",
            "engine": "the identical calls",
        },
    },
    "lazy2g": {
        "title": "lazy load {ckpt_gb} + read every byte",
        "file": "ckpt",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 0.95),
        "bytes": True,
        "notes": {"reference": "load_file (mmap) + int64 sum per tensor", "engine": "engine.torch.load_file, same loop"},
    },
    "many_load": {
        "title": "load_file {many:,} tiny tensors",
        "file": "many",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 3.0),
        "notes": {"reference": "safetensors.torch.load_file", "engine": "engine.torch.load_file"},
    },
    "save2g": {
        "title": "save_file {ckpt_gb} BF16",
        "file": None,
        "impls": ["reference", "engine", "engine-nofsync"],
        "goal": ("ratio+peak", 0.95, 64.0),
        "bytes": True,
        "notes": {
            "reference": "safetensors.torch.save_file (no fsync)",
            "engine": "engine.torch.save_file (temp + fsync + rename)",
            "engine-nofsync": "engine.writing.writer.save_file(fsync=False)",
        },
    },
    "pread2g": {
        "title": "owned load {ckpt_gb} (pread)",
        "file": "ckpt",
        "impls": ["reference", "engine"],
        "goal": ("ratio", 0.95),
        "bytes": True,
        "notes": {"reference": "load_file(backend='pread')", "engine": "engine.torch.load_file(backend='pread')"},
    },
}


# --------------------------------------------------------------------------- worker side


def _digest(rows) -> str:
    norm = sorted((str(k), str(d), tuple(int(x) for x in s)) for k, d, s in rows)
    return hashlib.sha1(repr(norm).encode()).hexdigest()[:12]


def _meta_rows(tensors: dict):
    return [(k, str(t.dtype).replace("torch.", ""), tuple(t.shape)) for k, t in tensors.items()]


def worker(spec: dict) -> dict:
    """Run one sample in this (fresh) process and return its measurements."""
    import safetensors
    import safetensors.torch as st_torch

    import engine
    import engine.torch as en_torch
    import engine.writing.writer as en_writer
    from engine.base import dtypes as en_dtypes

    case, impl, path = spec["case"], spec["impl"], spec.get("path")
    ref = impl == "reference"
    res: dict = {}
    if case == "preflight":
        return {"engine": engine.__file__}
    common.prepare(impl if ref else "engine", base=spec["dir"])
    gc.collect()

    if case == "header100k":
        # time spent in the cyclic garbage collector during the sample: the harness keeps
        # a row of (name, dtype, shape) per tensor in a process that imported torch, and
        # the full collections these rows set off walk every one of torch's objects
        gc_time = [0.0, 0, 0.0]  # seconds, full collections, start of the current one

        def on_gc(phase, info):
            if phase == "start":
                gc_time[2] = time.perf_counter()
            else:
                gc_time[0] += time.perf_counter() - gc_time[2]
                gc_time[1] += info["generation"] == 2

        gc.callbacks.append(on_gc)
        t0 = time.perf_counter()
        if impl in ("reference", "engine"):
            opener = safetensors.safe_open if ref else engine.safe_open
            with opener(path, framework="pt") as f:
                rows = []
                for k in f.keys():
                    s = f.get_slice(k)
                    rows.append((k, s.get_dtype(), s.get_shape()))
        elif impl == "engine-bulk":
            h = engine.read_header(path)
            t = h.table
            names = en_dtypes.NAMES
            rows = list(zip(t.names, [names[c] for c in t.codes.tolist()], t.shapes, strict=False))
        else:  # engine-parse
            h = engine.read_header(path)
            rows = None
        res["seconds"] = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
        res["gc_seconds"], res["gc_full"] = gc_time[0], gc_time[1]
        if rows is None:
            rows = [(k, h[k].dtype, h[k].shape) for k in h.keys()]
        res["digest"] = _digest(rows)
        res["count"] = len(rows)

    elif case == "header_small":
        if impl == "engine-header":
            def op():
                return engine.read_header(path).keys()
        else:
            opener = safetensors.safe_open if ref else engine.safe_open

            def op():
                with opener(path, framework="pt") as f:
                    return f.keys()
        first = time.perf_counter()
        op()
        res["first_seconds"] = time.perf_counter() - first
        loops, samples = spec["loops"], []
        for _ in range(spec["repeat"]):
            t0 = time.perf_counter()
            for _ in range(loops):
                op()
            samples.append((time.perf_counter() - t0) / loops)
        res["samples"] = samples
        res["count"] = len(op())

    elif case in ("lazy2g", "pread2g", "many_load"):
        load = st_torch.load_file if ref else en_torch.load_file
        backend = "pread" if case == "pread2g" else "mmap"
        rss0 = common.rss_bytes()
        common.reset_hwm()
        t0 = time.perf_counter()
        sd = load(path, backend=backend)
        t1 = time.perf_counter()
        if case == "lazy2g":
            res["checksum"] = common.touch_all(sd)
            t2 = time.perf_counter()
            res["seconds"], res["load_seconds"] = t2 - t0, t1 - t0
        else:
            res["seconds"] = t1 - t0
        res["extra_peak"] = common.hwm_bytes() - rss0
        if case != "lazy2g":
            res["checksum"] = common.touch_all(sd)
        res["digest"] = _digest(_meta_rows(sd))
        res["count"] = len(sd)

    elif case == "save2g":
        tensors = common.checkpoint_tensors(spec["ckpt"])
        out = spec["out"]
        gc.collect()
        rss0 = common.rss_bytes()
        res["hwm_reset"] = common.reset_hwm()
        maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.perf_counter()
        if impl == "reference":
            st_torch.save_file(tensors, out)
        elif impl == "engine":
            en_torch.save_file(tensors, out)
        else:
            en_writer.save_file(tensors, out, fsync=False)
        res["seconds"] = time.perf_counter() - t0
        res["extra_peak"] = common.hwm_bytes() - rss0
        res["extra_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(rss0, maxrss0)
        res["file_bytes"] = os.path.getsize(out)
        with safetensors.safe_open(out, framework="pt") as f:  # the reference can read it
            res["count"] = len(f.keys())
        with open(out, "rb") as f:  # the engine promises the reference's layout, byte for byte
            n = int.from_bytes(f.read(8), "little")
            res["digest"] = hashlib.sha1(f.read(n)).hexdigest()[:12]
        os.unlink(out)
    else:
        raise SystemExit(f"unknown case {case}")
    return res


# --------------------------------------------------------------------------- parent side


# first_open runs in a bare interpreter (nothing imported beyond site; the _pt rows import
# torch first, untimed, as the processes that use them have), so that every
# import the library makes on the way to its first open is counted
# the timed part is common.first_open_code (the same text as asv's FirstOpen)
FIRST_OPEN = """{setup}import time
t0 = time.perf_counter()
{body}seconds = time.perf_counter() - t0
import hashlib, json
digest = hashlib.sha1(repr(sorted(rows)).encode()).hexdigest()[:12]
print("RESULT " + json.dumps({{"seconds": seconds, "count": len(rows), "digest": digest}}))
"""


FIRST_OPEN_CASES = ("first_open", "first_tensor", "first_open_pt", "first_tensor_pt")


def run_child(spec: dict, timeout: float = 1200) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    if spec.get("case") in FIRST_OPEN_CASES:
        torch_rows = spec["case"].endswith("_pt")
        body = common.first_open_code(spec["impl"], spec["path"], first_tensor=spec["case"].startswith("first_tensor"),
                                      framework="pt" if torch_rows else "np")
        setup = common.TORCH_SETUP if torch_rows else ""
        cmd = [sys.executable, "-c", FIRST_OPEN.format(body=body, setup=setup)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]}


def machine_info(bench_dir: str) -> dict:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - report, never fail on this
            return f"unavailable ({type(exc).__name__})"

    cpu = platform.processor()
    mem = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        rev += "+dirty" if dirty else ""
    except OSError:
        rev = "unknown"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": round(mem / GB, 1) if mem else None,
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "numpy": version("numpy"),
        "safetensors": version("safetensors"),
        "engine": f"{version('engine')} @ {rev}",
        "bench_dir": bench_dir,
    }


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def summarize(case: str, impl: str, samples: list[dict]) -> dict:
    ok = [s for s in samples if "error" not in s]
    out = {"impl": impl, "n": len(ok), "errors": [s["error"] for s in samples if "error" in s]}
    if not ok:
        return out
    if CASES[case].get("inproc"):
        times = ok[0]["samples"]
        out["first_seconds"] = ok[0]["first_seconds"]
    else:
        times = [s["seconds"] for s in ok]
    out.update(median=statistics.median(times), min=min(times), max=max(times), times=times)
    for key in ("extra_peak", "extra_maxrss", "load_seconds", "gc_seconds", "gc_full"):
        vals = [s[key] for s in ok if key in s]
        if vals:
            out[key] = max(vals) if key in ("extra_peak", "extra_maxrss") else statistics.median(vals)
    if "gc_seconds" in out:  # the sample's own work, collector time taken out
        out["without_gc"] = statistics.median(s["seconds"] - s["gc_seconds"] for s in ok)
    for key in ("digest", "checksum", "count", "file_bytes", "hwm_reset"):
        vals = {json.dumps(s.get(key)) for s in ok if key in s}
        if vals:
            out[key] = json.loads(vals.pop()) if len(vals) == 1 else "VARIES"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--repeat", type=int, default=None, help="samples per measurement (default 5, 3 with --quick)")
    ap.add_argument("--dir", default=None, help="where the data files go (default: a temp dir under /tmp, removed)")
    ap.add_argument("--json", metavar="OUT", default=None, help="save machine description and results here")
    ap.add_argument("--only", nargs="+", choices=list(CASES), default=None, help="run these targets only")
    ap.add_argument("--keep", action="store_true", help="keep the generated files of a temp --dir")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    common.compile_engine()  # no sample compiles the engine's modules (see compile_engine)

    repeat = args.repeat or (3 if args.quick else 5)
    sz = sizes(args.quick)
    cases = args.only or list(CASES)
    own_dir = args.dir is None
    bench_dir = args.dir or tempfile.mkdtemp(prefix="engine-bench-")
    os.makedirs(bench_dir, exist_ok=True)

    # disk: the checkpoint, one saved copy (the writer's temp file becomes it), the small files
    ckpt_path = os.path.join(bench_dir, f"v{common.GEN_VERSION}-ckpt-{sz['ckpt']}.safetensors")
    big = any(c in cases for c in ("lazy2g", "pread2g", "save2g"))
    need = (0 if os.path.exists(ckpt_path) or not big else sz["ckpt"]) + (sz["ckpt"] if "save2g" in cases else 0)
    need += 64 * MB + sz["many"] * 400
    free = shutil.disk_usage(bench_dir).free
    if free < need * 1.1:
        print(f"not enough free disk space in {bench_dir}: need {need / GB:.1f} GB, {free / GB:.1f} GB free; "
              "use --dir elsewhere, --quick or --only", file=sys.stderr)
        return 2

    # pip compiles an installed package's bytecode; a checkout run with PYTHONDONTWRITEBYTECODE=1
    # would compile every engine module again in every sample, which no installed user pays
    import compileall

    compileall.compile_dir(os.path.join(REPO, "engine"), quiet=1)
    pre = run_child({"case": "preflight", "impl": ""}, timeout=300)
    if "error" in pre:
        print(f"cannot import the engine or the reference: {pre['error']}\n"
              "(build the extension in place: python setup.py build_ext --inplace)", file=sys.stderr)
        return 2

    info = machine_info(bench_dir)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(f"free disk in {bench_dir}: {free / GB:.1f} GB (need ~{need / GB:.1f} GB); repeat={repeat}")

    files = {}
    t0 = time.perf_counter()
    if {"header100k", "many_load"} & set(cases):
        files["many"] = common.many_tensors_file(sz["many"], base=bench_dir)
    if {"header_small", "first_open", "first_open_pt", "first_tensor_pt"} & set(cases):
        files["small"] = common.small_model_file(sz["small_layers"], base=bench_dir)
    if "first_tensor" in cases:  # F32: the reference's numpy has no BF16
        files["small_f32"] = common.small_model_file(sz["small_layers"], base=bench_dir, dtype="F32")
    if big:
        files["ckpt"] = common.checkpoint_file(sz["ckpt"], base=bench_dir)
    ckpt_bytes = common.entries_bytes(common.checkpoint_entries(sz["ckpt"]))
    print(f"data ready in {time.perf_counter() - t0:.1f} s: "
          + ", ".join(f"{k}={os.path.getsize(p) / MB:.1f} MiB" for k, p in files.items()))
    if "many" in files:
        with open(files["many"], "rb") as f:
            print(f"  many-tensor header: {int.from_bytes(f.read(8), 'little') / 1e6:.1f} MB")
    labels = {"many": sz["many"], "small_n": len(common.model_entries(sz["small_layers"], 1, 1, 1, 1)),
              "ckpt_gb": f"{ckpt_bytes / GB:.2f} GB"}

    results = {}
    try:
        for case in cases:
            spec_c = CASES[case]
            path = files.get(spec_c["file"]) if spec_c["file"] else None
            title = spec_c["title"].format(**labels)
            print(f"\n== {case}: {title}", flush=True)
            samples: dict = {impl: [] for impl in spec_c["impls"]}
            reps = 1 if spec_c.get("inproc") else repeat
            for rep in range(reps):
                for impl in spec_c["impls"]:
                    if samples[impl] and all("error" in x for x in samples[impl]):
                        continue  # failed on its first sample: do not pay for the others
                    spec = {"case": case, "impl": impl, "path": path, "dir": bench_dir}
                    if case == "header_small":
                        spec.update(loops=sz["small_loops"], repeat=repeat)
                    if case == "save2g":
                        spec.update(ckpt=sz["ckpt"], out=os.path.join(bench_dir, "save-out.safetensors"))
                        os.sync()  # previous sample's dirty pages must not slow this one
                    elif path:
                        common.warm_cache(path)
                    r = run_child(spec)
                    samples[impl].append(r)
                    shown = r.get("error") or fmt_time(r["seconds"] if "seconds" in r else statistics.median(r["samples"]))
                    print(f"  rep {rep + 1}/{reps} {impl:<15} {shown}", flush=True)
            summary = {impl: summarize(case, impl, s) for impl, s in samples.items()}
            results[case] = {"title": title, "notes": spec_c["notes"], "goal": spec_c["goal"],
                             "bytes": ckpt_bytes if spec_c.get("bytes") else None, "impls": summary}
    finally:
        if own_dir and not args.keep:
            shutil.rmtree(bench_dir, ignore_errors=True)

    info["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print()
    print(render(results, info, repeat))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "repeat": repeat, "quick": args.quick, "sizes": sz, "results": results},
                      f, indent=1)
        print(f"\nsaved {args.json}")
    return 0


def render(results: dict, info: dict, repeat: int) -> str:
    head = ["target", "impl", "median", "min-max", "GB/s", "ref/x", "extra peak", "goal", "check"]
    rows = []
    for case, r in results.items():
        ref = r["impls"].get("reference", {}).get("median")
        goal = r["goal"]
        for impl, s in r["impls"].items():
            if "median" not in s:
                rows.append([case, impl, "ERROR", "; ".join(map(str, s["errors"]))[:60], "", "", "", "", ""])
                continue
            med = s["median"]
            ratio = ref / med if ref and impl != "reference" else None
            gbs = f"{r['bytes'] / med / GB:.2f}" if r["bytes"] else ""
            peak = f"{s['extra_peak'] / MB:.0f} MiB" if "extra_peak" in s else ""
            goal_s = check = ""
            if impl != "reference":
                if goal[0] == "max_us":
                    goal_s, check = f"< {goal[1]:.0f} µs", "yes" if med * 1e6 < goal[1] else "NO"
                elif impl != "engine-parse":
                    goal_s = f"≥ {goal[1]:g}×" if goal[1] >= 1 else "no slower"
                    passed = ratio is not None and ratio >= goal[1]
                    if goal[0] == "ratio+peak":
                        goal_s += f", < {goal[2]:.0f} MiB"
                        passed = passed and s.get("extra_peak", 1e18) < goal[2] * MB
                    check = "yes" if passed else "NO"
            digest_ok = _agree(r["impls"], impl)
            rows.append([case, impl, fmt_time(med), f"{fmt_time(s['min'])}-{fmt_time(s['max'])}", gbs,
                         f"{ratio:.2f}" if ratio else "", peak, goal_s, check + ("" if digest_ok else " (DIFFERS)")])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False))  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("")
    out.append(f"median of {repeat} samples, each in a fresh process after an untimed warm-up (header_small: median "
               f"per open over {repeat} in-process batches); warm page cache; GB = 1e9 bytes; ref/x = reference / row;")
    out.append("'no slower' passes at ref/x ≥ 0.95 (5% noise allowance; '≥ 1×' has none); extra peak = peak RSS during the call "
               "minus RSS before it (VmHWM after a clear_refs reset).")
    out.append(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB; python {info['python']}, "
               f"torch {info['torch']}, safetensors {info['safetensors']}, engine {info['engine']}; {info['date']}; "
               f"load average at start {_load(info.get('load_avg'))}, at end {_load(info.get('load_avg_end'))}")
    for case, r in results.items():
        for impl, s in r["impls"].items():
            extra = []
            if "load_seconds" in s:
                extra.append(f"load_file itself {fmt_time(s['load_seconds'])}")
            if "extra_maxrss" in s:
                extra.append(f"ru_maxrss extra {s['extra_maxrss'] / MB:.0f} MiB")
            if "first_seconds" in s:
                extra.append(f"first open in process {fmt_time(s['first_seconds'])}")
            if "gc_seconds" in s:
                ref_wo = r["impls"].get("reference", {}).get("without_gc")
                ratio = f", ref/x {ref_wo / s['without_gc']:.2f}" if ref_wo and impl != "reference" else ""
                extra.append(f"cyclic GC {fmt_time(s['gc_seconds'])} ({s['gc_full']:g} full collections), "
                             f"without it {fmt_time(s['without_gc'])}{ratio}")
            if extra:
                out.append(f"  {case}/{impl}: " + ", ".join(extra))
    return "\n".join(out)


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg) if avg else "n/a"


def _agree(impls: dict, impl: str) -> bool:
    """Whether this impl's outputs match the reference's: names, dtypes and shapes (digest),
    tensor bytes (checksum), tensor count, and for saves the header bytes and file size."""
    ref, mine = impls.get("reference", {}), impls.get(impl, {})
    return all(ref[k] == mine[k] for k in ("digest", "checksum", "count", "file_bytes") if k in ref and k in mine)


if __name__ == "__main__":
    sys.exit(main())
