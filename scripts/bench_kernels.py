"""Full-size benchmarks of the Numba kernels against the issue's targets (``TARGETS``).

``engine.stats`` and per-tensor / per-row int8 quantization of an F32 array of ``--size`` (BF16 and
F16: half) against torch or NumPy (``benchmarks/bench_kernels.py``'s baselines), engine runs first;
quantization checked bit for bit against ``tests/naive.py``, with its extra peak RSS.

    python scripts/bench_kernels.py --size 64MiB      # smoke run (default 1 GiB, the issue's size)
"""

from __future__ import annotations

import gc
import os
import sys
import time

import harness
import numpy as np
from benchmarks import bench_kernels as B
from benchmarks import common

GIB, MIB = 1 << 30, 1 << 20
# row: (baseline, the issue's seconds at 1 GiB, target ratio)
TARGETS = {"stats_f32": ("torch", 1.45, 10.0), "stats_bf16": ("numpy", 6.5, 15.0),
           "quant_tensor": ("torch", 1.85, 5.0), "quant_row": ("torch", 1.85, 5.0),
           "stats_f16": ("numpy", None, None), "quant_row_f16": ("torch", None, None)}


def timed(op) -> float:
    t0 = time.perf_counter()
    out = op()
    dt = time.perf_counter() - t0
    del out
    gc.collect()
    return dt


def extra_peak(op) -> float | None:
    """Peak RSS above the current RSS during ``op()`` (freed memory handed back first, so that an
    output does not reuse pages an earlier run freed); None where not measurable."""
    gc.collect()
    B.trim_heap()
    before = common.rss_bytes()
    if not common.reset_hwm():
        return None
    out = op()
    peak = common.hwm_bytes() - before
    del out
    gc.collect()
    return peak


def check_quantize(x: np.ndarray, axis, q: np.ndarray, scale: np.ndarray, rows: int) -> bool:
    """Engine output == tests/naive.py's oracle, bit for bit, computed on row slabs."""
    import naive

    slabs = range(0, x.shape[0], rows)
    if axis is None:
        want_s = naive.scale_of(np.float32(max(float(naive.absmax(x[i : i + rows])) for i in slabs)))
        return bool(want_s.view(np.uint32) == np.asarray(scale).view(np.uint32)) and all(
            np.array_equal(q[i : i + rows], naive.quantize_with_scale(x[i : i + rows], want_s)) for i in slabs)
    for i in slabs:
        q0, s0 = naive.quantize_int8(x[i : i + rows], axis)
        if not (np.array_equal(q[i : i + rows], q0) and np.array_equal(scale[i : i + rows].view(np.uint32),
                                                                       s0.view(np.uint32))):
            return False
    return True


def main(argv=None) -> int:
    p = harness.parser(__doc__, size=GIB)
    p.add_argument("--repeat", type=int, default=5, help="engine runs per row")
    p.add_argument("--baseline-repeat", type=int, default=3, help="baseline runs per row")
    p.add_argument("--only", nargs="+", choices=list(TARGETS))
    a = p.parse_args(argv)
    if a.repeat < 3 or a.baseline_repeat < 1:
        p.error("--repeat must be >= 3 and --baseline-repeat >= 1")
    import numba

    import engine

    have_torch = B._have_torch()
    n32 = a.size // 4
    report = harness.Report()
    for name in a.only or list(TARGETS):
        base, issue_s, target = TARGETS[name]
        print(f"[{name}] preparing data...", file=sys.stderr, flush=True)
        extra: dict = {}
        if name.startswith("stats"):
            arr = B.make_data(name[len("stats_"):].upper(), n32)  # BF16 and F16: half the bytes
            ops = {"engine": B.stats_op("engine", arr)}
            if base != "torch" or have_torch:
                ops[base] = B.stats_op(base, arr)
        else:
            axis = None if name == "quant_tensor" else 0
            side = 1 << 14 if n32 >= 1 << 28 else max(1, int(np.sqrt(n32)))
            arr = B.make_data("F16" if name.endswith("f16") else "F32", (n32 // side) * side).reshape(-1, side)
            ops = {"engine": B.quantize_op("engine", arr, axis)}
            if have_torch:
                ops["torch"] = B.quantize_op("torch", arr, axis)
            peak = extra_peak(ops["engine"])
            q, s = engine.quantize_int8(arr, axis)
            ok = check_quantize(arr, axis, q, s, rows=max(1, (64 * MIB) // (4 * arr.shape[1])))
            extra = dict(extra_peak_bytes=peak, budget_bytes=q.nbytes + s.nbytes, bit_identical=ok)
            del q, s
        if base not in ops:
            print(f"[{name}] {base} not installed: baseline skipped", file=sys.stderr)
        print(f"[{name}] timing {', '.join(ops)}...", file=sys.stderr, flush=True)
        times = {k: [timed(op) for _ in range(a.repeat if k == "engine" else a.baseline_repeat)] for k, op in ops.items()}
        eng = report.add(name, "engine", times["engine"], arr.nbytes, **extra)
        for k in ops.keys() - {"engine"}:
            report.add(name, k, times[k], arr.nbytes, target=target)
        if a.size == GIB and issue_s is not None:
            report.add(name, f"{base}, the issue's figure", issue_s, arr.nbytes, target=target)
        for r in report.rows:
            if r["case"] == name and r is not eng:
                r["x_base"] = r["median_s"] / eng["median_s"]
                r["verdict"] = ("PASS" if r["x_base"] >= target else "MISS") if target else None
        del arr, ops
        gc.collect()
    report.note(f"Numba {numba.__version__} ({numba.get_num_threads()} threads); engine: median of {a.repeat} runs, "
                f"baselines: median of {a.baseline_repeat}; load average {os.getloadavg()[0]:.2f} at the end")
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_base", "target", "verdict", "bit_identical",
                         "extra_peak_bytes", "budget_bytes")


if __name__ == "__main__":
    sys.exit(main())
