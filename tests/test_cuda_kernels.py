"""engine.numerics.cuda_kernels compiled for a real GPU target (PTX for an H100, sm_90), without a GPU.

The simulator pass (tests/test_device.py) checks what the kernels compute; this checks that
Numba's CUDA target types and lowers them for every dtype a load feeds them, and that the
quantization keeps IEEE division and no flush-to-zero (its bit-identity with the CPU depends
on both).  Needs the CUDA toolkit's NVVM (a CUDA_HOME, or the ``nvidia-cuda-nvcc-cu12``
wheel's directory as CUDA_HOME); a GPU is not needed.
"""

from __future__ import annotations

import numba
import pytest

SIM = bool(numba.config.ENABLE_CUDASIM)


def _nvvm() -> bool:
    if SIM:
        return False
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
        return True
    except Exception:  # no libnvvm, no CUDA toolkit
        return False


pytestmark = pytest.mark.skipif(
    not _nvvm(),
    reason="needs the CUDA toolkit's NVVM (CUDA_HOME), and Numba's real CUDA target (not the simulator)",
)

if not SIM:
    from numba import cuda
    from numba import types as T

A1 = lambda t: T.Array(t, 1, "C")  # noqa: E731
A2 = lambda t: T.Array(t, 2, "C")  # noqa: E731
VIEWS = {"F32": ("float32", "int32", "uint32"), "F64": ("float64", "int64", "uint64"),
         "F16": ("uint16", "int16", "uint16"), "BF16": ("uint16", "int16", "uint16")}


@pytest.fixture
def ptx(monkeypatch):
    import numba.cuda.dispatcher as disp

    class H100:  # device functions ask the current device for its compute capability
        compute_capability = (9, 0)

    monkeypatch.setattr(disp, "get_current_device", lambda: H100())

    def compile_(kernel, sig):
        return cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))[0]

    return compile_


@pytest.mark.parametrize("kind", list(VIEWS))
def test_statistics_kernels_compile(ptx, kind):
    from engine.numerics import cuda_kernels as ck

    ft, it, ut = (getattr(T, n) for n in VIEWS[kind])
    sc, uc = T.UniTuple(it, 3), T.UniTuple(ut, 4)
    acc = (A2(T.int64), A2(T.float64), A2(T.int64), A1(T.uint64))
    assert ".entry" in ptx(ck.init_stats, (sc, uc, *acc))
    code = ptx(ck.stats_fold, (T.int64, A1(ft), A1(it), A1(ut), sc, uc, *acc))
    assert "ftz" not in code
    assert ".entry" in ptx(ck.fill_zero, (A1(it),))


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_quantization_kernels_compile_with_ieee_division(ptx, kind):
    from engine.numerics import cuda_kernels as ck

    ft, _, ut = (getattr(T, n) for n in VIEWS[kind])
    assert ".entry" in ptx(ck.absmax_runs, (A1(ut), ut, ut, T.int64, T.int64, T.int64, A1(T.uint32), A1(T.int64)))
    assert ".entry" in ptx(ck.absmax_columns,
                           (A1(ut), ut, ut, T.int64, T.int64, T.int64, T.int64, A1(T.uint32), A1(T.int64)))
    code = ptx(ck.quantize_elements, (T.int64, A1(ft), A1(ut), ut, ut, T.int64, T.int64, A1(T.float32), A1(T.int8)))
    assert "div.rn.f32" in code and "ftz" not in code  # true IEEE division, subnormals kept
    assert "div.rn.f32" in ptx(ck.scales_from_keys, (A1(T.uint32), T.int64, T.int64, A1(T.float32)))

