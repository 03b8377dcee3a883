"""Whether Numba's CUDA kernels can run in this process, asked once (:func:`device_kernels_unusable`),
and when they cannot, the one warning that says what runs instead and what to install.

A device load's statistics and int8 quantization run as the kernels of
:mod:`engine.numerics.device` where this probe says they work, and otherwise as the sink
framework's operations on the device or on the CPU (:func:`engine.loading.load_hooks.plan`
chooses).
"""

from __future__ import annotations

import threading
import warnings

from engine.errors import DeviceFallbackWarning

__all__ = ["device_kernels_unusable", "fallback_fix", "warn_fallback"]


#: the probe's verdict for this process: [None] (the kernels work) or [why not]
_KERNELS: list[str | None] = []
_KERNELS_LOCK = threading.Lock()
_WARNED: list[bool] = []


def device_kernels_unusable(gpu: int | None = None) -> str | None:
    """Why Numba's CUDA kernels cannot run in this process, or None where they can.

    Asked once per process (:func:`engine.device.probe` compiles and runs one small kernel
    on GPU ``gpu``, the load's: on the thread's current device only for None, which makes a
    context there); any failure, from a missing ``numba`` to a missing NVVM, counts.
    """
    with _KERNELS_LOCK:
        if not _KERNELS:
            try:
                from engine.numerics import device

                device.probe(gpu)
                _KERNELS.append(None)
            except Exception as exc:  # every way the kernels can fail to come up is a fallback
                _KERNELS.append(f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300])
        return _KERNELS[0]


def warn_fallback(why: str, framework: str | None) -> None:
    """The :class:`~engine.errors.DeviceFallbackWarning` of a load whose kernels cannot run
    (``why``), once per process: what runs instead (``framework``'s operations on the device,
    or the CPU for None) and what to install.  Called from :func:`engine.loading.load_hooks.plan`
    directly: its ``stacklevel`` counts the frames from there."""
    if not _WARNED:
        _WARNED.append(True)
        if framework is not None:
            instead = (f"statistics and int8 quantization of GPU loads run as {framework} operations on the device "
                       "instead (slower than the kernels)")
        else:
            instead = ("statistics of GPU loads are folded on the CPU and int8 quantization runs on the CPU, its "
                       "results copied to the device")
        warnings.warn(
            f"the engine's CUDA kernels cannot run here ({why}): {instead}; the results are the same. "
            f"{fallback_fix(why)}",
            DeviceFallbackWarning, stacklevel=4,
        )


def fallback_fix(why: str) -> str:
    """What to do about the probe's verdict ``why``: the install line or the upgrade that
    lets the kernels compile."""
    low = why.lower()
    install = f'pip install "numba-cuda[cu{_cuda_major()}]"'
    if "row_stack" in low:
        return ("To fix: numba-cuda refers to numpy.row_stack, which numpy 2.5 removed, and its array support "
                "was loaded before the engine could stand in for it: import engine.device before compiling other "
                f"numba-cuda kernels, or install a numba-cuda that no longer refers to it ({install} --upgrade)")
    if "no module named" in low or "nvvm" in low or "libdevice" in low or "cuda_home" in low:
        return (f"To fix: install numba-cuda with the NVVM compiler as wheels: {install} (matching the CUDA major "
                "version of your driver)")
    if "driver" in low:
        return (f"To fix: update the NVIDIA driver, or install the numba-cuda build for the CUDA version it "
                f"supports: {install}")
    return f"To fix: see the error above; installing numba-cuda with its NVVM ({install}) often does"


def _cuda_major() -> int:
    """The CUDA major version torch was built for, where torch is loaded (13 otherwise)."""
    import sys

    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None) or ""
    major = version.split(".")[0]
    return int(major) if major.isdigit() and int(major) in (12, 13) else 13
