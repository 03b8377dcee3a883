"""Destinations for tensor bytes: numpy arrays, torch tensors (and later CuPy).

A sink knows how to make a framework's tensor that *views* a mapped file and how to
allocate an owned tensor whose raw bytes a reader fills.  Each framework lives in its
own module, which imports its framework at the top: importing it is the opt-in.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sinks._host import HOST_ALIGNMENT, host_block, pack_offsets

__all__ = ["get_sink", "map_file", "fill_target", "host_block", "pack_offsets", "HOST_ALIGNMENT"]


def __getattr__(name: str):
    # owned host blocks (engine.sinks._host) are imported on first use: opening a file and
    # handing out mapped views needs none of them
    if name in ("host_block", "pack_offsets", "HOST_ALIGNMENT"):
        from engine.sinks import _host

        return getattr(_host, name)
    raise AttributeError(f"module 'engine.sinks' has no attribute {name!r}")

def map_file(sink, fd: int):
    """A mapping of the whole file ``fd`` as ``sink`` hands out views of it
    (``sink.mmap_access``): private copy-on-write for numpy and torch, whose arrays and
    tensors are writable while writes never reach the file.  ``mmap`` is imported here, by
    the first mapping: opening a file and reading its header need none."""
    import mmap

    return mmap.mmap(fd, 0, access=getattr(mmap, sink.mmap_access))


def get_sink(kind: str, device="cpu"):
    """The sink of ``kind``: ``"numpy"``, ``"torch"`` or ``"cupy"`` (a load's framework name, as the
    reference spells it, is resolved to one by :func:`engine.loading.sink_kind`)."""
    if kind == "numpy":
        from engine.sinks.numpy import NumpySink

        return NumpySink()
    if kind == "cupy":
        from engine.sinks.cupy import CupySink

        return CupySink(device)
    if kind != "torch":
        raise ValueError(f"no sink of kind {kind!r}")
    from engine.sinks.torch import TorchSink

    return TorchSink(device)


def fill_target(x):
    """An existing tensor (numpy, torch or CuPy) as a destination that a load fills in place
    (:class:`engine.sinks._targets.FillTarget`): its dtype, shape, layout, memory and, on a
    device, the operations that copy into it.

    Raises
    ------
    TensorMismatchError
        Anything else.
    """
    # no framework is imported here: a torch tensor or a CuPy array exists only if its
    # framework is imported already
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        from engine.base import dtypes
        from engine.sinks._targets import NumpyTarget

        return NumpyTarget(x, dtypes.from_numpy(x.dtype), x.shape, x.flags.c_contiguous and x.flags.writeable)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from engine.sinks.torch import fill_target as torch_target

        return torch_target(x)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        from engine.sinks.cupy import fill_target as cupy_target

        return cupy_target(x)
    from engine.errors import TensorMismatchError

    raise TensorMismatchError(
        f"cannot load into a {type(x).__name__}; expected a numpy array, a torch tensor or a CuPy array"
    )
