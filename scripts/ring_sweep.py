"""The chunk ring's geometry by measurement (also ``scripts/gpu_check.py --sweep``).

Device loads of the checkpoint (``engine.load_into(directory, tensors)``) over a grid: chunk size,
chunks in flight (at most :data:`MAX_PINNED` page-locked), copy threads (the cores less 8, 6, 4, 2, 0),
``ENGINE_COPY_SOURCE``, ``ENGINE_RING_STORES`` and ``ENGINE_RING_UNMAP``.  One child, the CUDA context up
once, loads each configuration twice (the rate: their median); the order keeps a sweep cut short by its
budget useful (every geometry, then every variant of the :data:`TOP` fastest, then the rest), and the
fastest's bytes are checked at the end.  ``--short`` (gpu_check's): the default geometry with every source
under each unmap mode, then three other shapes, each second load reusing the first's ring.  ``--device
cpu``: the dry run on the emulated runtime (tests/emucudart), every configuration's bytes checked:
``python scripts/ring_sweep.py --device cpu --size 16MB --short --json sweep.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import harness

# isort: split
import bench_gpu
import checkout_path

MIB = 1 << 20
#: the grid on a GPU, and the dry run's (a small checkpoint, the emulated runtime)
CHUNK_MIB, CHUNKS = (1, 2, 4, 8, 16), (8, 16, 32, 64)
DRY_CHUNK_MIB, DRY_CHUNKS = (1, 4), (4, 16)
#: the most a configuration page-locks (the engine's own default ceiling)
MAX_PINNED = 256 * MIB
THREAD_OFFSETS = (-8, -6, -4, -2, 0)
#: (``ENGINE_COPY_SOURCE``, ``ENGINE_RING_STORES``, ``ENGINE_RING_UNMAP``); "-": left unset (a chunk
#: filled by ``pread`` holds no mapping to store or unmap)
VARIANTS = (("auto", "stream", "end"), ("auto", "cached", "end"), ("pread", "-", "-"), ("mmap", "stream", "end"),
            ("auto", "stream", "chunk"), ("mmap", "stream", "chunk"))
SHORT_SOURCES, SHORT_UNMAP = ("pread", "mmap", "auto"), ("end", "chunk")
TOP = 3
#: the variables a configuration sets, and a configuration's keys
KNOBS = ("ENGINE_RING", "ENGINE_COPY_SOURCE", "ENGINE_RING_STORES", "ENGINE_RING_UNMAP")
KEYS = ("chunk_mib", "chunks", "threads", "source", "stores", "unmap")
Config = tuple[int, int, int, str, str, str]


def thread_counts(cores: int) -> list[int]:
    return sorted({max(1, cores + d) for d in THREAD_OFFSETS})


def geometries(dry: bool) -> list[tuple[int, int]]:
    """(chunk MiB, chunks) pairs of the grid, page-locking at most :data:`MAX_PINNED`."""
    sizes, counts = (DRY_CHUNK_MIB, DRY_CHUNKS) if dry else (CHUNK_MIB, CHUNKS)
    return [(m, n) for m in sizes for n in counts if m * n * MIB <= MAX_PINNED]


def short_configs(default: tuple[int, int, int], cores: int) -> list[Config]:
    """``default`` (chunk MiB, chunks, threads) with every source under each unmap mode, then half and
    twice the chunk size (the same page-locked bytes) and another thread count."""
    mib, chunks, threads = default
    out: list[Config] = [(mib, chunks, threads, src, "-", unmap) for unmap in SHORT_UNMAP for src in SHORT_SOURCES]
    other = cores if cores != threads else max(1, threads // 2)
    for m, n, t in [(max(1, mib // 2), chunks * 2, threads), (mib * 2, max(2, chunks // 2), threads),
                    (mib, chunks, other)]:
        if (m, n, t, "-", "-", "-") not in out and (m, n, t) != default:
            out.append((m, n, t, "-", "-", "-"))
    return out


def order(geoms: list[tuple[int, int]], threads: list[int], base_threads: int, rates: dict,
          first: tuple[int, int] | None = None) -> Iterator[tuple[str, Config]]:
    """Configurations in the order timed, with their stage: ``A`` every geometry at the default threads
    and variant (``first`` first), ``B`` every thread count and variant of the :data:`TOP` fastest by
    ``rates`` (read as the sweep goes), ``C`` the rest."""
    seen: set = set()
    if first in geoms:
        geoms = [first, *[g for g in geoms if g != first]]

    def fresh(stage, configs):
        for c in configs:
            if c not in seen:
                seen.add(c)
                yield stage, c

    yield from fresh("A", [(m, n, base_threads, *VARIANTS[0]) for m, n in geoms])
    rank = sorted(geoms, key=lambda g: -rates.get((g[0], g[1], base_threads, *VARIANTS[0]), 0.0))
    yield from fresh("B", [(m, n, t, *v) for m, n in rank[:TOP] for t in threads for v in VARIANTS])
    yield from fresh("C", [(m, n, t, *v) for m, n in rank[TOP:] for t in threads for v in VARIANTS])


# -- the child: one process, every configuration ------------------------------------------------------


class _Cuda:
    """Torch tensors on the device, made once; ``engine.load_into(directory, tensors)``."""

    reference = None

    def __init__(self, files: list[str], dev: str) -> None:
        import torch

        self.torch = torch
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context is up before any clock
        self.name = torch.cuda.get_device_name(torch.device(dev))
        self.directory = os.path.dirname(files[0])
        self.tensors = bench_gpu._dst(files, dev)[0]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        torch.cuda.synchronize()

    def load(self, cold: bool = True) -> float:
        """Seconds of one load; ``cold``: the rings earlier loads left are closed first."""
        import engine
        from engine.gpu import rings

        if cold:
            rings.release_rings()
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.load_into(self.directory, self.tensors, strict=True)
        self.torch.cuda.synchronize()
        return time.perf_counter() - t0

    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()
        self.torch.cuda.synchronize()

    def fingerprint(self) -> str:
        return bench_gpu.checksum(self.tensors)

    def close(self) -> dict:
        return {}


class _Emulated:
    """The checkpoint's tensors as host arrays behind the emulated CUDA runtime: the engine's pipeline
    and chunk ring as on a GPU, each copy a memcpy on the emulator's stream thread."""

    def __init__(self, files: list[str]) -> None:
        import numpy as np
        from emucudart import EmulatedRingOps, Emulator

        import engine

        self.emu = Emulator()
        self.ops = EmulatedRingOps(self.emu)
        self.name = "the emulated CUDA runtime (tests/emucudart), not a GPU"
        self.layout, self.dst, base = [], {}, 0  # (file, begins, ends, data_start, base)
        ref = hashlib.blake2b(digest_size=16)
        for f in files:
            h = engine.read_header(f)
            t = h.table
            self.layout.append((f, t.begins, t.ends, h.data_start, base))
            with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for r in range(len(t.names)):
                    b, e = h.data_start + int(t.begins[r]), h.data_start + int(t.ends[r])
                    self.dst[base + r] = np.zeros(e - b, np.uint8)
                    ref.update(m[b:e])
            base += len(t.names)
        self.reference = ref.hexdigest()  # the files' bytes
        self.nbytes = sum(len(a) for a in self.dst.values())

    def load(self, cold: bool = True) -> float:
        from engine.gpu import rings
        from engine.loading import pipeline
        from engine.planning.plan import plan_reads

        if cold:
            rings.release_rings()
        with contextlib.ExitStack() as stack:
            sources = []
            for f, begins, ends, data_start, base in self.layout:
                fd = os.open(f, os.O_RDONLY)
                stack.callback(os.close, fd)
                rows = list(range(len(begins)))
                sources.append(pipeline.Source(fd, f, plan_reads(begins, ends, rows, data_start, 16 * MIB), base))
            t0 = time.perf_counter()
            pipeline.run_sources(sources, pipeline.Destination(device_targets=self.dst, device_ops=self.ops))
            return time.perf_counter() - t0

    def zero(self) -> None:
        for a in self.dst.values():
            a.fill(0)

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for key in sorted(self.dst):
            h.update(self.dst[key].data)
        return h.hexdigest()

    def close(self) -> dict:
        """Every chunk unlocked, every copy from a page-locked chunk on the ring's device, no event left."""
        from engine.gpu import rings

        rings.release_rings()
        self.ops.close()
        st = self.emu.stats()
        return {"emulator": st, "clean": not (st["registered"] or st["pageable"] or st["wrong_device"]
                                              or st["events"])}


def emulated_load(files: list[str]) -> dict:
    """gpu_check's dry row: every shard through the device pipeline in one load on the emulated runtime,
    its bytes checked against the files and nothing left behind."""
    target = _Emulated(files)
    seconds, records = _recorded(target, True)
    same, end = target.fingerprint() == target.reference, target.close()
    if not same or not end["clean"]:
        raise AssertionError("bytes differ from the files" if not same else f"the ring left the emulated"
                             f" runtime unclean: {end['emulator']}")
    return {"seconds": seconds, "bytes": target.nbytes, "copies": end["emulator"]["copies"], "records": records}


def _configure(cfg: Config) -> None:
    """The environment the engine reads a configuration from at each load ("-": unset)."""
    for name, value in zip(KNOBS, [f"{cfg[0]},{cfg[1]},{cfg[2]}", *cfg[3:]], strict=True):
        if value == "-":
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _recorded(target, cold: bool) -> tuple[float, dict]:
    with bench_gpu.ring_records() as records:
        seconds = target.load(cold)
    return seconds, records


def child(dev: str, files: list[str], seconds: float, short: bool, log: str) -> dict:
    """Time the grid (or the short sweep) within ``seconds``, one JSON line per event appended to ``log``
    as it goes (a child stopped from outside leaves what it did): start, warm-up, each config, check, end."""
    t_start = time.monotonic()
    deadline = t_start + seconds
    dry = not dev.startswith("cuda")
    out = open(log, "a")

    def emit(event: dict) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    target = _Emulated(files) if dry else _Cuda(files, dev)
    from engine.gpu.geometry import default_geometry

    saved = {k: os.environ.pop(k, None) for k in KNOBS}  # the first load and the default: the engine's
    default = default_geometry()
    cores = max(1, len(os.sched_getaffinity(0)))  # as the engine counts them for its default
    threads, geoms = thread_counts(cores), geometries(dry)
    first = (default.chunk_bytes // MIB, default.chunks)
    short_list = short_configs((*first, default.threads), cores) if short else []
    total = len(short_list) if short else len(geoms) * len(threads) * len(VARIANTS)
    emit({"event": "start", "device": target.name, "cores": cores, "threads": threads, "geometries": geoms,
          "variants": VARIANTS, "configs": total, "bytes": target.nbytes, "short": short,
          "default": [*first, default.threads], "engine_file": checkout_path.engine_origin(),
          "ring_file": checkout_path.engine_origin("engine.gpu._ring"), "setup_s": round(time.monotonic() - t_start, 2)})
    rates: dict = {}
    walls: list[float] = []
    try:
        # a process's first load pays for what only a first load sets up: untimed, at the default, into
        # zeroed tensors; on a GPU its bytes are the reference for the best's
        t0 = time.monotonic()
        target.zero()
        target.load()
        fp = target.fingerprint()
        target.reference = target.reference or fp
        emit({"event": "warm-up", "bytes_ok": fp == target.reference, "seconds": round(time.monotonic() - t0, 2)})
        plan = (("S", c) for c in short_list) if short else order(geoms, threads, default.threads, rates, first)
        for stage, cfg in plan:
            # no configuration starts that the budget would not cover, with the final check after it
            if walls and time.monotonic() + 2.5 * max(walls) + 2.0 > deadline:
                break
            _configure(cfg)
            record: dict = {"event": "config", "stage": stage, **dict(zip(KEYS, cfg, strict=True))}
            t0 = time.monotonic()
            try:
                # the grid sets the ring up for each load; the short sweep's second load reuses its first's
                s1, rec1 = _recorded(target, True)
                if dry:  # the emulator's bytes are cheap to check: every configuration's
                    target.zero()
                s2, rec2 = _recorded(target, not short)
                if dry:
                    record["bytes_ok"] = target.fingerprint() == target.reference
                record.update(seconds=[s1, s2], gbps=[target.nbytes / s / 1e9 for s in (s1, s2)], records=[rec1, rec2])
                record["median_gbps"] = statistics.median(record["gbps"])
                rates[cfg] = record["median_gbps"] if record.get("bytes_ok", True) else 0.0
            except Exception as exc:  # a geometry the ring refuses: reported, the sweep goes on
                record["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rates[cfg] = 0.0
            walls.append(time.monotonic() - t0)
            emit(record)
        if rates and max(rates.values()) > 0:
            best = max(rates, key=lambda c: rates[c])
            _configure(best)
            target.zero()
            seconds_best = target.load()
            fp = target.fingerprint()
            emit({"event": "check", "config": list(best), "bytes_ok": fp == target.reference, "fingerprint": fp,
                  "reference": target.reference, "seconds": seconds_best})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        closing = target.close()
    emit({"event": "end", "ran": len(walls), "not_run": total - len(walls),
          "elapsed_s": round(time.monotonic() - t_start, 1), **closing})
    out.close()
    return {"events": len(walls)}


# -- the parent ---------------------------------------------------------------------------------------


def run_child(dev: str, files: list[str], left: float, env: dict, short: bool = False) -> tuple[list[dict], str | None]:
    """The child within ``left`` seconds (it starts no configuration in the last 10): its events, and
    why it failed (or None)."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as log:
        t0 = time.monotonic()
        got = harness.call(child, dev, files, max(1.0, left - 10), short, log.name, env=env, timeout=max(1.0, left),
                           check=False)
        events = [json.loads(line) for line in log.read().splitlines() if line.strip()]
    if "error" in got and time.monotonic() - t0 >= left:
        return events, f"the child ran past the budget and was stopped ({left:.0f} s)"
    return events, got.get("error")


def summarize(events: list[dict]) -> dict:
    """``start``, ``warmup``, ``check``, ``end`` (None if missing), ``configs`` (fastest first), ``best``."""
    first = {e["event"]: e for e in reversed(events)}
    configs = sorted((e for e in events if e["event"] == "config"),
                     key=lambda e: -(e.get("median_gbps") or 0.0) if e.get("bytes_ok", True) else 0.0)
    best = next((e for e in configs if e.get("median_gbps") and e.get("bytes_ok", True)), None)
    return {"start": first.get("start"), "warmup": first.get("warm-up"), "end": first.get("end"),
            "check": first.get("check"), "configs": configs, "best": best}


def name(c: dict) -> str:
    """A configuration's shape and variant ("default": the variable left unset; stores only where set)."""
    knob = {k: "default" if c.get(k, "-") == "-" else c[k] for k in ("source", "stores", "unmap")}
    stores = f" stores {c['stores']}," if c.get("stores", "-") != "-" else ""
    return f"{c['chunk_mib']} MiB x {c['chunks']}, threads {c['threads']}, source {knob['source']},{stores} unmap {knob['unmap']}"


def env_line(c: dict) -> str:
    """The configuration as variables a shell takes: ``ENGINE_RING=chunk_mib,chunks,threads`` first."""
    return " ".join([f"ENGINE_RING={c['chunk_mib']},{c['chunks']},{c['threads']}",
                     *(f"{k}={c[key]}" for k, key in zip(KNOBS[1:], KEYS[3:], strict=True) if c.get(key, "-") != "-")])


def records_text(rec: dict | None) -> str:
    """A load's ring records in a table cell: waits, page-locking, bytes per source, shape, unmap mode,
    and with device kernels the reports' count and seconds."""
    if not rec:
        return "-"
    if not rec.get("loads"):
        return "no load through the ring"

    def sec(key):
        return "-" if rec.get(key) is None else f"{rec[key]:.3f}"

    def gb(key):
        return "-" if rec.get(key) is None else f"{rec[key] / 1e9:.1f}"

    shape = f" {rec['chunk_bytes'] / MIB:g}Mx{rec['slots']:g}/{rec.get('threads') or '?'}t" \
        if rec.get("chunk_bytes") and rec.get("slots") else ""
    return (f"{rec.get('loads', 0):g} loads ({rec.get('cold', 0):g} cold); wait fill {sec('fill_wait_s')}"
            f" slot {sec('slot_wait_s')} lock {sec('lock_s')} s; GB pread {gb('pread_bytes')} mmap {gb('mmap_bytes')}"
            + (f" network {gb('network_bytes')}" if rec.get("network_bytes") else "")
            + f";{shape} {rec.get('source') or '-'}, unmap {rec.get('unmap') or '-'}"
            + (f"; {rec['pageable']:g} PAGEABLE (chunks not page-locked)" if rec.get("pageable") else "")
            + (f"; kernels at {rec.get('reported') or 0:g} reports, {sec('report_s')} s" if rec.get("hooked") else ""))


def run(files: list[str] | None, dev: str, deadline: float, env: dict, meta: dict, json_path: str | None,
        md_path: str | None = None, short: bool = False) -> int:
    """The sweep until ``deadline`` (``time.monotonic()``): its configurations fastest first, the best,
    the default's rank and the best rate for each value of each key, printed and written to ``md_path``,
    and ``json_path`` in the common shape with the sweep's own keys.  1 if it failed."""
    events: list[dict] = []
    error: str | None = "no checkpoint"
    if files is not None:
        bench_gpu.warm(files)
        events, error = run_child(dev, files, deadline - time.monotonic() - 5, env, short)  # 5 s for the report
    result = summarize(events)
    start, best, check = result["start"] or {}, result["best"], result["check"] or {}
    where = {"parent": checkout_path.engine_origin(), "child": start.get("engine_file"),
             "child_ring": start.get("ring_file")}
    problems = [  # what makes the sweep fail, first found first: its figures are then not to be used
        (result["start"] is not None and not all(checkout_path.from_checkout(p or "") for p in where.values()),
         f"the engine is not all this checkout's ({harness.ROOT}): {where}"),
        (result["warmup"] is not None and not result["warmup"].get("bytes_ok"), "the first load's bytes differ"),
        (any(c.get("bytes_ok") is False for c in result["configs"]), "a configuration's bytes differ from the files"),
        (not (result["end"] or {}).get("clean", True), f"the emulated runtime was left unclean: {result['end']}"),
        (best is None, "no configuration ran"),
        (best is not None and not check.get("bytes_ok"), "the best configuration's bytes differ or were not checked"),
    ]
    error = error or next((why for bad, why in problems if bad), None)
    report = harness.Report()
    for c in result["configs"]:
        report.add(name(c), "engine", c.get("seconds"), start.get("bytes"), **{k: c.get(k) for k in (*KEYS, "stage")},
                   gbps=c.get("median_gbps"), load_gbps=c.get("gbps"), bytes_ok=c.get("bytes_ok"),
                   records=c.get("records"), ring=records_text((c.get("records") or [None])[0]),
                   each=" / ".join(f"{g:.2f}" for g in c.get("gbps", [])), detail=c.get("error"))
    ring = env_line(best).split()[0] if best else None
    ranked = [c for c in result["configs"] if c.get("median_gbps")] if best else []
    if best:
        report.note(f"\nbest: `{ring}` (with `{env_line(best)}`): {best['median_gbps']:.2f} GB/s"
                    f" ({'bytes checked' if check.get('bytes_ok') else 'BYTES DIFFER or not checked'})")
        d = start.get("default") or []
        ref = next((i for i, c in enumerate(ranked, 1) if [c["chunk_mib"], c["chunks"], c["threads"]] == d
                    and (c["source"], c["stores"], c["unmap"]) in (VARIANTS[0], ("-", "-", "-"))), None)
        if ref:
            report.note(f"the default ({d[0]} MiB x {d[1]} chunks, {d[2]} threads): rank {ref} of {len(ranked)}")
    for key in KEYS:
        by: dict = {}
        for c in ranked:
            by.setdefault(str(c[key]), []).append(c["median_gbps"])
        report.note(f"\n| {key} | best GB/s | median GB/s | configurations |\n|---|---:|---:|---:|\n" + "\n".join(
            f"| {v} | {max(r):.2f} | {statistics.median(r):.2f} | {len(r)} |" for v, r in sorted(by.items())))
    meta = {**meta, "engine_file": where, "device_name": start.get("device", dev)}
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        report.finish(json_path, "case", "stage", "median_s", "gbps", "each", "ring", "detail", meta=meta,
                      error=error, ring=ring, **{k: result[k] for k in ("best", "check", "start", "warmup", "end")})
    text = (f"ring sweep on {meta['device_name']}: {len(report.rows)} of {start.get('configs', '?')} configurations,"
            f" checkpoint {start.get('bytes', 0) / 1e9:.2f} GB of tensors, each loaded twice (GB/s: the median of the"
            f" two); engine {where}\n\n{table.getvalue()}")
    print(text)
    if md_path:
        with open(md_path, "w") as f:
            f.write(text)
    if error:
        print(f"FAILED: {error}")
    if ring:
        print(ring)
    return 1 if error else 0


def main(argv: list[str] | None = None, start: float | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the dry run on the emulated runtime")
    ap.add_argument("--size", default="16.06GB", help="checkpoint size (bench_gpu.py's, in --dir)")
    ap.add_argument("--dir", default=bench_gpu.DIR)
    ap.add_argument("--budget", type=float, default=210, help="seconds for the whole sweep, the checkpoint's too")
    ap.add_argument("--short", action="store_true", help="gpu_check.py's short sweep")
    ap.add_argument("--md", default=None, help="write the table here too")
    a = ap.parse_args(argv)
    deadline = (start or time.monotonic()) + a.budget
    size, env = harness.parse_size(a.size), harness.child_env(NUMBA_ENABLE_CUDASIM=None)
    # the sweep needs about a minute of the budget after the checkpoint to say anything
    got = harness.call(bench_gpu.made, os.path.join(a.dir, f"llama3-shapes-{size}"), size, env=env,
                       timeout=max(1.0, deadline - time.monotonic() - 60), check=False)
    rc = run(got.get("files"), a.device, deadline, env, {"device": a.device, "size": size, "budget_s": a.budget},
             a.json, a.md, a.short)
    if "error" in got:
        print(f"FAILED checkpoint: {got['error']}")
    return 1 if "error" in got else rc


if __name__ == "__main__":
    sys.exit(main())
