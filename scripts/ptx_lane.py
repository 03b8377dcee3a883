"""Compile every CUDA kernel of engine.numerics.cuda_kernels to PTX for sm_90, without a GPU.

Each kernel at every signature engine.numerics.device launches it with goes through
``numba.cuda.compile_ptx``, as a GPU host's first load would, with the checks bit-identity with the CPU
needs (IEEE division, no flush-to-zero).  ``python scripts/ptx_lane.py`` runs two passes, each in a fresh
interpreter: numpy as installed, and ``numpy.row_stack`` removed (as numpy 2.5 did) before numba-cuda
loads.  Exit status 1 if any kernel failed.  Needs ``pip install "numba-cuda[cu13]"`` (NVVM as wheels).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

#: an H100's or H200's compute capability
CC = (9, 0)
#: the float formats of each kernel family (device.SUPPORTED_NAMES, quantize.INPUTS) and their
#: views: (values, signed, unsigned)
STATS_KINDS = ("F64", "F32", "F16", "BF16")
QUANT_KINDS = ("F32", "F16", "BF16")
VIEWS = {"F32": ("float32", "int32", "uint32"), "F64": ("float64", "int64", "uint64"),
         "F16": ("uint16", "int16", "uint16"), "BF16": ("uint16", "int16", "uint16")}


def signatures() -> list[tuple[str, str, tuple]]:
    """(kernel name, label, argument types) of every launch in engine.numerics.device: C-contiguous
    arrays, Python ints as int64, ``absmask``/``lim`` of the unsigned view's type, tuples of constants."""
    from numba import types as T

    def a1(t):
        return T.Array(t, 1, "C")

    def a2(t):
        return T.Array(t, 2, "C")

    i64 = T.int64
    out: list[tuple[str, str, tuple]] = []
    # probe(): one byte; DeviceQuantizer: the NaN/Inf counts (int64) and the keys (int32)
    for t in ("uint8", "int64", "int32"):
        out.append(("fill_zero", t, (a1(getattr(T, t)),)))
    acc = (a2(T.int64), a2(T.float64), a2(T.int64), a1(T.uint64))  # cnt, mom, skey, ukey
    for kind in STATS_KINDS:
        ft, it, ut = (getattr(T, n) for n in VIEWS[kind])
        sc, uc = T.UniTuple(it, 3), T.UniTuple(ut, 4)
        out.append(("init_stats", kind, (sc, uc, *acc)))
        out.append(("stats_fold", kind, (i64, a1(ft), a1(it), a1(ut), sc, uc, *acc)))
    for kind in QUANT_KINDS:
        ft, _, ut = (getattr(T, n) for n in VIEWS[kind])
        keys, bad = a1(T.uint32), a1(T.int64)
        out.append(("absmax_runs", kind, (a1(ut), ut, ut, i64, i64, i64, keys, bad)))
        out.append(("absmax_columns", kind, (a1(ut), ut, ut, i64, i64, i64, i64, keys, bad)))
        out.append(("quantize_elements", kind, (i64, a1(ft), a1(ut), ut, ut, i64, i64, a1(T.float32), a1(T.int8))))
    out.append(("scales_from_keys", "all", (a1(T.uint32), i64, i64, a1(T.float32))))
    return out


def _check(name: str, ptx: str) -> str | None:
    """What is wrong with the PTX of kernel ``name``, or None."""
    if ".entry" not in ptx:
        return "no .entry in the PTX"
    if name in ("stats_fold", "quantize_elements", "scales_from_keys") and "ftz" in ptx:
        return "flush-to-zero in the PTX: subnormals would not match the CPU"
    if name in ("quantize_elements", "scales_from_keys") and "div.rn.f32" not in ptx:
        return "no IEEE division (div.rn.f32): the int8 values would not match the CPU"
    return None


def run_pass(label: str) -> int:
    """Compile every signature in this process; print one line each; the number that failed."""
    import numba.cuda.dispatcher as disp
    from numba import cuda

    from engine.numerics import cuda_kernels as ck

    class Device:  # device functions ask the current device for its compute capability
        compute_capability = CC

    disp.get_current_device = lambda: Device()  # type: ignore[attr-defined]  # no GPU here
    failed = 0
    for name, what, sig in signatures():
        start = time.perf_counter()
        try:
            ptx = cuda.compile_ptx(getattr(ck, name).py_func, sig, cc=CC)[0]
            why = _check(name, ptx)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then counted
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        took = time.perf_counter() - start
        failed += why is not None
        status = "ok  " if why is None else "FAIL"
        print(f"{status} [{label}] sm_{CC[0]}{CC[1]} {name}[{what}] ({', '.join(map(str, sig))}) "
              f"{took:.2f} s{'' if why is None else ': ' + why}", flush=True)
    return failed


def _without_row_stack() -> None:
    """``row_stack`` off numpy as numpy 2.5 did, its ``__all__`` entry too (``from numpy import *``)."""
    import numpy

    if "row_stack" in vars(numpy):
        del numpy.row_stack
    numpy.__all__ = [n for n in numpy.__all__ if n != "row_stack"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pass", dest="which", choices=("both", "installed", "no-row-stack"), default="both")
    args = parser.parse_args(argv)
    if args.which == "no-row-stack":
        if "numba" in sys.modules:
            raise SystemExit("--pass no-row-stack must run before numba is imported")
        _without_row_stack()
    if args.which != "both":
        failed = run_pass(args.which)
        if args.which == "no-row-stack" and "row_stack" in vars(sys.modules["numpy"]):
            print("FAIL [no-row-stack] numpy.row_stack was left on numpy", flush=True)
            failed += 1
        return 1 if failed else 0
    # both: each in a fresh interpreter, so that neither sees what the other loaded
    status = 0
    for which in ("installed", "no-row-stack"):
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--pass", which]).returncode
        status = status or rc
    print("PTX lane:", "passed" if status == 0 else "FAILED", flush=True)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
