"""engine.numerics.cuda_kernels compiled for a real GPU target (PTX for an H100, sm_90), without a GPU.

The simulator pass (tests/test_device.py) checks what the kernels compute; this checks that
Numba's CUDA target types and lowers them for every dtype a load feeds them, and that the
quantization keeps IEEE division and no flush-to-zero (its bit-identity with the CPU depends
on both).  Needs the CUDA toolkit's NVVM (a CUDA_HOME, or ``pip install "numba-cuda[cu13]"``, which brings
it as wheels); a GPU is not needed.  numpy 2.5 removed ``numpy.row_stack``, which numba-cuda
refers to: the tests at the end take it off numpy in a fresh interpreter and check that the
kernels still load and compile.  ``scripts/ptx_lane.py`` (tests/test_ptx_lane.py) compiles
every kernel at every signature the engine launches.
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


needs_nvvm = pytest.mark.skipif(
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


@needs_nvvm
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


@needs_nvvm
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



# --------------------------------------------------------------------------- numpy 2.5's row_stack


def _numba_cuda() -> bool:
    """numba-cuda (NVIDIA's CUDA target, the one that refers to numpy.row_stack) is installed."""
    if SIM:
        return False
    try:
        import numba.cuda

        return getattr(numba.cuda, "implementation", "") == "NVIDIA"
    except Exception:  # no CUDA target at all
        return False


WITHOUT_ROW_STACK = """
import numpy
del numpy.row_stack  # as numpy 2.5 removed it, __all__ included
numpy.__all__ = [n for n in numpy.__all__ if n != "row_stack"]
"""


@pytest.mark.skipif(not _numba_cuda(), reason="needs numba-cuda (pip install 'numba-cuda[cu13]'); a GPU is not needed")
def test_array_support_loads_without_numpy_row_stack():
    # numba-cuda's array support (loaded by the first compile) runs overload(np.row_stack):
    # importing the kernels loads it under a stand-in and takes the stand-in off again
    from conftest import run_python

    out = run_python(WITHOUT_ROW_STACK + """
import sys
import engine.numerics.cuda_kernels
assert "numba.cuda.np.arrayobj" in sys.modules
assert "row_stack" not in vars(numpy)
try:
    numpy.row_stack
except AttributeError:
    print("ok")
""")
    assert out.split() == ["ok"]


@pytest.mark.skipif(not (_numba_cuda() and _nvvm()), reason="needs numba-cuda with NVVM (pip install "
                    "'numba-cuda[cu13]'); a GPU is not needed")
def test_a_kernel_compiles_without_numpy_row_stack():
    from conftest import run_python

    out = run_python(WITHOUT_ROW_STACK + """
import numba.cuda.dispatcher as disp
from numba import cuda
from numba import types as T
from engine.numerics import cuda_kernels as ck

class H100:
    compute_capability = (9, 0)

disp.get_current_device = lambda: H100()
print(".entry" in cuda.compile_ptx(ck.scales_from_keys.py_func, (T.Array(T.uint32, 1, "C"), T.int64, T.int64,
                                   T.Array(T.float32, 1, "C")), cc=(9, 0))[0])
""")
    assert out.split() == ["True"]


def test_numpy_keeps_its_own_row_stack():
    from conftest import run_python

    out = run_python("""
import numpy
own = vars(numpy).get("row_stack")
import engine.numerics.cuda_kernels
print(vars(numpy).get("row_stack") is own)
""")
    assert out.split() == ["True"]
