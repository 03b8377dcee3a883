"""Owned host memory for loads: one private block per load, tensors packed into it."""

from __future__ import annotations

import mmap

from .. import dtypes

#: Alignment of each tensor inside an owned host block when it cannot simply follow its
#: neighbour (a cache line; also enough for every dtype's itemsize).
HOST_ALIGNMENT = 64


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
