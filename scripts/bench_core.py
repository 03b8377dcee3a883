"""Core benchmarks of safetensors-engine against the reference ``safetensors`` package.

The targets of the performance issue, engine and reference in the same run, interleaved rep by
rep (``impl``: ``reference`` is the safetensors package, every other the engine):

  header100k      open a file of 100,000 tensors and read every dtype and shape
                  (``engine-bulk``: read_header + its table; ``engine-parse``: read_header only)
  header_small    open a file of a few hundred tensors, per open (``engine-header``: read_header)
  first_open      import + first safe_open + every dtype and shape, in a bare fresh interpreter
  first_tensor    the same, then one get_tensor (numpy imported on both sides)
  first_open_pt   first_open with framework="pt" in a process that has imported torch (untimed)
  first_tensor_pt the same, then one get_tensor (a BF16 torch tensor)
  lazy2g          lazy (mmap) load of a 2 GB BF16 checkpoint, then read every byte
  many_load       load_file of 100,000 tiny tensors
  save2g          save_file of a 2 GB BF16 checkpoint (``engine-nofsync``: fsync=False), extra peak RSS
  pread2g         owned load (backend="pread") of the 2 GB checkpoint

Every sample is a fresh process after an untimed warm-up on a one-tensor file (imports and first-use
costs paid alike), data files warm in the page cache, saves after an ``os.sync()``.  "goal" is the
issue's target: ref/x at least a ratio ("no slower" passes at 0.95), or a time.

    python scripts/bench_core.py --quick              # smoke run, small sizes
    python scripts/bench_core.py --json bench.json    # the full run: ~4.1 GB of disk, ~9 min
"""

from __future__ import annotations

import gc
import hashlib
import os
import resource
import shutil
import sys
import tempfile
import time

import harness
from benchmarks import common

MB = 1 << 20

# case: (title, data file, impls, goal); goal ("ratio", r): ref/x >= r; ("max_us", t): under t us;
# ("ratio+peak", r, MiB): also an extra peak RSS under MiB
CASES = {
    "header100k": ("open {many:,} tensors, every dtype+shape", "many",
                   ["reference", "engine", "engine-bulk", "engine-parse"], ("ratio", 5.0)),
    "header_small": ("open {small_n} tensors (per open)", "small", ["reference", "engine", "engine-header"],
                     ("max_us", 1000.0)),
    "first_open": ("import + first open of {small_n} tensors, every dtype+shape", "small", ["reference", "engine"],
                   ("ratio", 1.0)),
    "first_tensor": ("first_open, then one get_tensor ({small_n} F32 tensors)", "small_f32", ["reference", "engine"],
                     ("ratio", 1.0)),
    "first_open_pt": ("torch imported, then import + first open of {small_n} tensors ('pt')", "small",
                      ["reference", "engine"], ("ratio", 1.0)),
    "first_tensor_pt": ("first_open_pt, then one get_tensor ({small_n} BF16 tensors)", "small",
                        ["reference", "engine"], ("ratio", 1.0)),
    "lazy2g": ("lazy load {ckpt_gb} + read every byte", "ckpt", ["reference", "engine"], ("ratio", 0.95)),
    "many_load": ("load_file {many:,} tiny tensors", "many", ["reference", "engine"], ("ratio", 3.0)),
    "save2g": ("save_file {ckpt_gb} BF16", None, ["reference", "engine", "engine-nofsync"], ("ratio+peak", 0.95, 64.0)),
    "pread2g": ("owned load {ckpt_gb} (pread)", "ckpt", ["reference", "engine"], ("ratio", 0.95)),
}
BYTES = {"lazy2g", "save2g", "pread2g"}  # GB/s of the checkpoint's tensor bytes


def _digest(rows) -> str:
    norm = sorted((str(k), str(d).replace("torch.", ""), tuple(int(x) for x in s)) for k, d, s in rows)
    return hashlib.sha1(repr(norm).encode()).hexdigest()[:12]


def sample(case: str, impl: str, path: str | None, spec: dict) -> dict:
    """One sample of ``case`` by ``impl`` in this fresh process: its measurements."""
    import safetensors
    import safetensors.torch as st_torch

    import engine
    import engine.torch as en_torch
    import engine.writing.writer as en_writer
    from engine.base import dtypes as en_dtypes

    ref = impl == "reference"
    opener = safetensors.safe_open if ref else engine.safe_open
    res: dict = {}
    common.prepare("reference" if ref else "engine", base=spec["dir"])
    gc.collect()
    if case == "header100k":
        # the cyclic collector's time: a row per tensor in a process that imported torch sets off
        # full collections that walk every one of torch's objects
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
            with opener(path, framework="pt") as f:
                rows = [(k, (s := f.get_slice(k)).get_dtype(), s.get_shape()) for k in f.keys()]
        elif impl == "engine-bulk":
            t = engine.read_header(path).table
            rows = list(zip(t.names, [en_dtypes.NAMES[c] for c in t.codes.tolist()], t.shapes, strict=False))
        else:
            h = engine.read_header(path)
            rows = None
        res["seconds"] = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
        res.update(gc_seconds=gc_time[0], gc_full=gc_time[1])
        rows = rows or [(k, h[k].dtype, h[k].shape) for k in h.keys()]
        res.update(digest=_digest(rows), count=len(rows))
    elif case == "header_small":
        def op():
            if impl == "engine-header":
                return engine.read_header(path).keys()
            with opener(path, framework="pt") as f:
                return f.keys()

        res["first_seconds"] = harness.times(op, 1, warmup=0)[0]
        loops = spec["loops"]
        res["samples"] = [harness.times(lambda: [op() for _ in range(loops)], 1, warmup=0)[0] / loops
                          for _ in range(spec["repeat"])]
        res["count"] = len(op())
    elif case in ("lazy2g", "pread2g", "many_load"):
        rss0 = common.rss_bytes()
        common.reset_hwm()
        t0 = time.perf_counter()
        sd = (st_torch if ref else en_torch).load_file(path, backend="pread" if case == "pread2g" else "mmap")
        res["load_seconds"] = time.perf_counter() - t0
        if case == "lazy2g":
            res["checksum"] = common.touch_all(sd)
        res["seconds"] = time.perf_counter() - t0
        res["extra_peak"] = common.hwm_bytes() - rss0
        res.setdefault("checksum", common.touch_all(sd))
        res.update(digest=_digest((k, t.dtype, t.shape) for k, t in sd.items()), count=len(sd))
    elif case == "save2g":
        tensors = common.checkpoint_tensors(spec["ckpt"])
        out = spec["out"]
        gc.collect()
        rss0 = common.rss_bytes()
        res["hwm_reset"] = common.reset_hwm()
        maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        save = {"reference": st_torch.save_file, "engine": en_torch.save_file,
                "engine-nofsync": lambda t, o: en_writer.save_file(t, o, fsync=False)}[impl]
        res["seconds"] = harness.times(lambda: save(tensors, out), 1, warmup=0)[0]
        res["extra_peak"] = common.hwm_bytes() - rss0
        res["extra_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(rss0, maxrss0)
        res["file_bytes"] = os.path.getsize(out)
        with safetensors.safe_open(out, framework="pt") as f:  # the reference can read it
            res["count"] = len(f.keys())
        with open(out, "rb") as f:  # the engine promises the reference's layout, byte for byte
            res["digest"] = hashlib.sha1(f.read(int.from_bytes(f.read(8), "little"))).hexdigest()[:12]
        os.unlink(out)
    return res


# a bare interpreter (the _pt rows import torch first, untimed), so that every import the library
# makes on the way to its first open is counted; the timed part is common.first_open_code (asv's too)
FIRST_OPEN = """{setup}import time
t0 = time.perf_counter()
{body}seconds = time.perf_counter() - t0
import hashlib, json
digest = hashlib.sha1(repr(sorted(rows)).encode()).hexdigest()[:12]
print("RESULT " + json.dumps({{"seconds": seconds, "count": len(rows), "digest": digest}}))
"""


def _first_open(case: str, impl: str, path: str) -> dict:
    pt = case.endswith("_pt")
    body = common.first_open_code(impl, path, first_tensor=case.startswith("first_tensor"), framework="pt" if pt else "np")
    return harness.run_code(FIRST_OPEN.format(body=body, setup=common.TORCH_SETUP if pt else ""), check=False)


def _summarize(report, case: str, title: str, impl: str, samples: list[dict], nbytes: int | None) -> None:
    ok = [s for s in samples if "error" not in s]
    extra: dict = {"errors": [s["error"] for s in samples if "error" in s]}
    for key in ("extra_peak", "extra_maxrss", "load_seconds", "gc_seconds", "gc_full", "first_seconds", "digest",
                "checksum", "count", "file_bytes", "hwm_reset"):
        vals = [s[key] for s in ok if key in s]
        if key.startswith("extra") and vals:  # the largest; figures: the median; outputs: the same in every sample
            extra[key + "_bytes"] = max(vals)
        elif vals:
            extra[key] = harness.median(vals) if key.endswith(("seconds", "full")) else vals[0] if all(
                v == vals[0] for v in vals) else "VARIES"
    if "gc_seconds" in extra:  # the sample's own work, collector time taken out
        extra["without_gc_s"] = harness.median(s["seconds"] - s["gc_seconds"] for s in ok)
    report.add(title, impl, ok[0]["samples"] if ok and "samples" in ok[0] else [s["seconds"] for s in ok], nbytes,
               target=case, **extra)


def _goal(report, row: dict, goal: tuple) -> None:
    """The issue's goal for ``row`` and whether it is met, and whether its outputs equal the reference's."""
    ref = next((r for r in report.rows if r["case"] == row["case"] and r["impl"] == "reference"), {})
    same = all(ref[k] == row[k] for k in ("digest", "checksum", "count", "file_bytes") if k in ref and k in row)
    med, ratio = row["median_s"], row.get("x_reference")
    if row["impl"] == "reference" or med is None or (goal[0] != "max_us" and row["impl"] == "engine-parse"):
        row.update(goal="", check="" if same else "(DIFFERS)")
        return
    if goal[0] == "max_us":
        text, passed = f"< {goal[1]:.0f} us", med * 1e6 < goal[1]
    else:
        text = f">= {goal[1]:g}x" if goal[1] >= 1 else "no slower"
        passed = ratio is not None and ratio >= goal[1]
        if goal[0] == "ratio+peak":
            text += f", < {goal[2]:.0f} MiB"
            passed = passed and row.get("extra_peak_bytes", 1e18) < goal[2] * MB
    row.update(goal=text, check=("yes" if passed else "NO") + ("" if same else " (DIFFERS)"))


def main(argv=None) -> int:
    ap = harness.parser(__doc__, dir=None)
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--repeat", type=int, help="samples per measurement (default 5, 3 with --quick)")
    ap.add_argument("--only", nargs="+", choices=list(CASES), help="run these targets only")
    a = ap.parse_args(argv)
    common.compile_engine()  # no sample compiles the engine's modules
    repeat = a.repeat or (3 if a.quick else 5)
    sz = {"many": 10_000, "ckpt": 64 << 20, "loops": 200} if a.quick else \
        {"many": 100_000, "ckpt": 2_000_000_000, "loops": 2000}
    cases = a.only or list(CASES)
    bench_dir = a.dir or tempfile.mkdtemp(prefix="engine-bench-")
    os.makedirs(bench_dir, exist_ok=True)
    big = bool({"lazy2g", "pread2g", "save2g"} & set(cases))
    need = sz["ckpt"] * (big + ("save2g" in cases)) + 64 * MB + sz["many"] * 400
    free = shutil.disk_usage(bench_dir).free
    if free < need * 1.1:
        harness.cannot(f"not enough free disk space in {bench_dir}: need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB "
                       "free; use --dir elsewhere, --quick or --only")
    make = {"many": lambda: common.many_tensors_file(sz["many"], base=bench_dir),
            "small": lambda: common.small_model_file(32, base=bench_dir),
            "small_f32": lambda: common.small_model_file(32, base=bench_dir, dtype="F32"),  # numpy
            "ckpt": lambda: common.checkpoint_file(sz["ckpt"], base=bench_dir)}  # has no BF16 for the reference
    files = {f: make[f]() for f in {CASES[c][1] for c in cases} - {None}}
    ckpt_bytes = common.entries_bytes(common.checkpoint_entries(sz["ckpt"]))
    labels = {"many": sz["many"], "small_n": len(common.model_entries(32, 1, 1, 1, 1)),
              "ckpt_gb": f"{ckpt_bytes / 1e9:.2f} GB"}
    spec = {"dir": bench_dir, "loops": sz["loops"], "repeat": repeat, "ckpt": sz["ckpt"],
            "out": os.path.join(bench_dir, "save-out.safetensors")}
    report = harness.Report()
    try:
        for case in cases:
            title, file, impls, goal = CASES[case]
            path = files.get(file) if file else None
            failed: dict = {}

            def one(impl, case=case, path=path, failed=failed):
                if impl in failed:
                    return failed[impl]  # failed once: do not pay for the other samples
                if case == "save2g":
                    os.sync()  # the previous sample's dirty pages must not slow this one
                elif path:
                    common.warm_cache(path)
                got = _first_open(case, impl, path) if case.startswith("first_") else \
                    harness.call(sample, case, impl, path, spec, timeout=1200, check=False)
                if "error" in got:
                    failed[impl] = got
                return got

            print(f"== {case}: {title.format(**labels)}", file=sys.stderr, flush=True)
            got = harness.rounds(impls, 1 if case == "header_small" else repeat, one)
            for impl in impls:
                _summarize(report, case, title.format(**labels), impl, got[impl], ckpt_bytes if case in BYTES else None)
    finally:
        if a.dir is None:
            shutil.rmtree(bench_dir, ignore_errors=True)
    report.against("x_reference", "reference")
    for row in report.rows:
        _goal(report, row, CASES[row["target"]][3])
        if row.get("errors"):
            report.note(f"{row['target']}/{row['impl']}: {row['errors'][0]}")
        if "gc_seconds" in row:
            report.note(f"{row['target']}/{row['impl']}: cyclic GC {harness.fmt_time(row['gc_seconds'])} "
                        f"({row['gc_full']:g} full collections), without it {harness.fmt_time(row['without_gc_s'])}")
    report.note(f"median of {repeat} samples, each a fresh process after an untimed warm-up (header_small: the "
                "median per open over in-process batches); extra peak = peak RSS during the call minus RSS before")
    return report.finish(a.json, "target", "impl", "median_s", "gbps", "x_reference", "extra_peak_bytes", "goal", "check")


if __name__ == "__main__":
    sys.exit(main())
