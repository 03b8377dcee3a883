"""Destinations for tensor bytes: numpy arrays, torch tensors (and later CuPy).

A sink knows how to make a framework's tensor that *views* a mapped file and how to
allocate an owned tensor whose raw bytes a reader fills.  Each framework lives in its
own module, which imports its framework at the top: importing it is the opt-in.
"""

from __future__ import annotations

import mmap

from ..errors import DeviceError, SafetensorError

#: Alignment of each tensor inside an owned host block when it cannot simply follow its
#: neighbour (a cache line; also enough for every dtype's itemsize).
HOST_ALIGNMENT = 64

_FRAMEWORKS = {
    "np": "numpy",
    "numpy": "numpy",
    "pt": "torch",
    "torch": "torch",
    "cp": "cupy",
    "cupy": "cupy",
}


def get_sink(framework: str, device="cpu"):
    """The sink for a framework name as the reference spells it (``"np"``, ``"pt"``, ...)."""
    try:
        kind = _FRAMEWORKS[framework]
    except (KeyError, TypeError):
        raise SafetensorError(
            f"unsupported framework {framework!r}; expected one of {sorted(_FRAMEWORKS)}",
            reason="InvalidFramework",
        ) from None
    if kind == "numpy":
        from .numpy import NumpySink

        if str(device) != "cpu":
            raise DeviceError(f"numpy arrays live on the CPU; device {device!r} needs framework='pt'")
        return NumpySink()
    if kind == "cupy":
        from .cupy import CupySink

        return CupySink(device)
    from .torch import TorchSink

    return TorchSink(device)


def host_block(nbytes: int) -> mmap.mmap:
    """Private anonymous memory for an owned load: one block per load, tensors are views.

    Not a mapping of the file: reads fill it with ``preadv``.  First touch of this fresh
    memory (page faults) is most of the cost of an owned load from a warm page cache.
    Transparent huge pages (``MADV_HUGEPAGE``) were tried and dropped: in a fresh process
    the kernel compacts memory to find them, which made loads slower, not faster.
    """
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def pack_offsets(specs, file_begins) -> tuple[list[int], int]:
    """Offsets of tensors ``specs`` = [(row, code, shape, nbytes)] (file order) in one block.

    A tensor that follows its predecessor directly in the file follows it in the block too
    (when its itemsize allows), so a coalesced read lands in one contiguous span; others
    start at the next :data:`HOST_ALIGNMENT` boundary.
    """
    from .. import dtypes

    offsets, pos, prev_end = [], 0, None
    for row, code, _shape, nbytes in specs:
        itemsize = dtypes.DTYPES[code].itemsize
        if prev_end is not None and int(file_begins[row]) == prev_end and pos % itemsize == 0:
            off = pos
        else:
            off = -(-pos // HOST_ALIGNMENT) * HOST_ALIGNMENT
        offsets.append(off)
        pos = off + nbytes
        prev_end = int(file_begins[row]) + nbytes
    return offsets, pos
