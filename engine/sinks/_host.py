"""Owned host memory for loads: one private block per load, tensors packed into it."""

from __future__ import annotations

import functools
import glob
import mmap
import os

from engine.base import dtypes

#: Alignment of each tensor inside an owned host block when it cannot simply follow its
#: neighbour (a cache line; also enough for every dtype's itemsize).
HOST_ALIGNMENT = 64


#: Blocks at least this large ask for transparent huge pages.
HUGE_BLOCK_BYTES = 4 << 20


def huge_pages() -> bool:
    """Whether owned blocks ask for transparent huge pages: ``ENGINE_HUGE_PAGES=1`` or ``0``
    where set, else yes unless :func:`free_pages_reported` (there a fresh huge page is
    one the hypervisor has taken back, and its first touch costs more than 512 small ones)."""
    env = os.environ.get("ENGINE_HUGE_PAGES", "").strip().lower()
    if env:
        return env not in ("0", "no", "off", "false")
    return not free_pages_reported()


#: log2 of a transparent huge page in base pages (2 MiB / 4 KiB)
_HUGE_ORDER = 9
#: VIRTIO_BALLOON_F_REPORTING: the balloon hands free memory back to the hypervisor
_BALLOON_REPORTING_BIT = 5


@functools.cache
def free_pages_reported(sysfs: str = "/sys") -> bool:
    """Whether this machine is a VM whose balloon reports free blocks of huge-page size or
    more to the hypervisor (virtio-balloon free page reporting), which discards their
    backing: a fresh huge page then comes from such a block and is faulted in twice, by the
    guest and by the host."""
    try:
        with open(os.path.join(sysfs, "module/page_reporting/parameters/page_reporting_order")) as f:
            if int(f.read().strip()) > _HUGE_ORDER:
                return False
    except (OSError, ValueError):
        return False
    for features in glob.glob(os.path.join(sysfs, "bus/virtio/drivers/virtio_balloon/virtio*/features")):
        try:
            with open(features) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _BALLOON_REPORTING_BIT and bits[_BALLOON_REPORTING_BIT] == "1":
            return True
    return False


def host_block(nbytes: int) -> mmap.mmap:
    """Private anonymous memory for an owned load: one block per load, tensors are views.

    Not a mapping of the file: reads fill it.  Faulting this fresh memory in is most of the
    cost of an owned load from a warm page cache or a socket, so a block of
    :data:`HUGE_BLOCK_BYTES` or more asks for transparent huge pages (``MADV_HUGEPAGE``):
    where the kernel grants them, one fault maps 2 MiB instead of 4 KiB.  Where it does not
    (``transparent_hugepage=never``, no free 2 MiB blocks), the advice is ignored and the
    block is ordinary pages.  :func:`huge_pages` says when the advice is given.
    """
    block = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= HUGE_BLOCK_BYTES and huge_pages():
        try:
            block.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages
            pass
    return block


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
