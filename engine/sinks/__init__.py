"""Destinations for tensor bytes: numpy arrays, torch tensors (and later CuPy).

A sink knows how to make a framework's tensor that *views* a mapped file and how to
allocate an owned tensor whose raw bytes a reader fills.  Each framework lives in its
own module, which imports its framework at the top: importing it is the opt-in.
"""

from __future__ import annotations

from ..errors import DeviceError, SafetensorError

__all__ = ["get_sink", "sink_kind", "map_file", "host_block", "pack_offsets", "HOST_ALIGNMENT"]


def __getattr__(name: str):
    # owned host blocks (engine.sinks._host) are imported on first use: opening a file and
    # handing out mapped views needs none of them
    if name in ("host_block", "pack_offsets", "HOST_ALIGNMENT"):
        from . import _host

        return getattr(_host, name)
    raise AttributeError(f"module 'engine.sinks' has no attribute {name!r}")

_FRAMEWORKS = {
    "np": "numpy",
    "numpy": "numpy",
    "pt": "torch",
    "torch": "torch",
    "cp": "cupy",
    "cupy": "cupy",
}


def sink_kind(framework: str, device="cpu") -> str:
    """``"numpy"``, ``"torch"`` or ``"cupy"`` for a framework name as the reference spells it
    (``"np"``, ``"pt"``, ...), checked without importing the framework.

    Raises ``SafetensorError`` for an unknown name and ``DeviceError`` for numpy on a device
    other than the CPU.
    """
    try:
        kind = _FRAMEWORKS[framework]
    except (KeyError, TypeError):
        raise SafetensorError(
            f"unsupported framework {framework!r}; expected one of {sorted(_FRAMEWORKS)}",
            reason="InvalidFramework",
        ) from None
    if kind == "numpy" and str(device) != "cpu":
        raise DeviceError(f"numpy arrays live on the CPU; device {device!r} needs framework='pt'")
    return kind


def map_file(sink, fd: int):
    """A mapping of the whole file ``fd`` as ``sink`` hands out views of it
    (``sink.mmap_access``): private copy-on-write for numpy and torch, whose arrays and
    tensors are writable while writes never reach the file.  ``mmap`` is imported here, by
    the first mapping: opening a file and reading its header need none."""
    import mmap

    return mmap.mmap(fd, 0, access=getattr(mmap, sink.mmap_access))


def get_sink(framework: str, device="cpu"):
    """The sink for a framework name as the reference spells it (``"np"``, ``"pt"``, ...)."""
    kind = sink_kind(framework, device)
    if kind == "numpy":
        from .numpy import NumpySink

        return NumpySink()
    if kind == "cupy":
        from .cupy import CupySink

        return CupySink(device)
    from .torch import TorchSink

    return TorchSink(device)
