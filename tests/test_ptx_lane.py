"""scripts/ptx_lane.py: every CUDA kernel at every signature the engine launches, compiled to
PTX for sm_90 without a GPU, with numpy as installed and with ``numpy.row_stack`` removed.

Needs numba-cuda with NVVM (``pip install "numba-cuda[cu13]"``, CI's PTX lane); skipped
elsewhere.  tests/test_device.py checks, under the simulator, that the lane's table holds the
argument types of every launch the device code makes.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numba
import pytest

LANE = pathlib.Path(__file__).parent.parent / "scripts" / "ptx_lane.py"


def _lane_runs() -> str | None:
    """Why the lane cannot run here, or None."""
    if numba.config.ENABLE_CUDASIM:
        return "the simulator compiles nothing"
    try:
        from numba import cuda
        from numba.cuda.cudadrv import nvvm

        if getattr(cuda, "implementation", "") != "NVIDIA":
            return "needs numba-cuda (pip install 'numba-cuda[cu13]'), not Numba's built-in CUDA target"
        nvvm.NVVM()
    except Exception as exc:  # no numba-cuda, no NVVM
        return f"needs numba-cuda with NVVM (pip install 'numba-cuda[cu13]'): {type(exc).__name__}"
    return None


@pytest.mark.skipif(_lane_runs() is not None, reason=str(_lane_runs()))
def test_the_ptx_lane_passes():
    out = subprocess.run([sys.executable, str(LANE)], capture_output=True, text=True, timeout=600)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    sys.path.insert(0, str(LANE.parent))
    try:
        import ptx_lane
    finally:
        sys.path.remove(str(LANE.parent))
    n = len(ptx_lane.signatures())
    for which in ("installed", "no-row-stack"):
        assert len([s for s in lines if s.startswith(f"ok   [{which}]")]) == n, which
    assert not [s for s in lines if s.startswith("FAIL")]


def test_the_lane_fails_when_a_kernel_does_not_compile(monkeypatch, capsys):
    # one line per signature and a non-zero status when any fails (here: no compiler at all)
    sys.path.insert(0, str(LANE.parent))
    try:
        import ptx_lane
    finally:
        sys.path.remove(str(LANE.parent))
    if numba.config.ENABLE_CUDASIM:
        pytest.skip("the simulator has no compile_ptx")
    from numba import cuda

    def broken(*args, **kwargs):
        raise RuntimeError("NVVM is broken")

    monkeypatch.setattr(cuda, "compile_ptx", broken)
    import numba.cuda.dispatcher as disp

    monkeypatch.setattr(disp, "get_current_device", disp.get_current_device)  # the lane replaces it
    assert ptx_lane.main(["--pass", "installed"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(ptx_lane.signatures())
    assert all(s.startswith("FAIL [installed]") and "NVVM is broken" in s for s in lines)
