"""How a load on the slot path is cut up: :class:`Unit` s of up to a staging slot of
consecutive requests of one file, each request placed in the slot at a position aligned as
its file offset is (:func:`slot_position`).  Used by :mod:`engine.gpu.device_load`."""

from __future__ import annotations

import collections
import mmap
from collections.abc import Sequence

from engine.planning.plan import Piece, Request

__all__ = ["SLOT_ALIGN", "slot_position", "Unit", "units"]

_PAGE = mmap.PAGESIZE

#: A request lands in a staging slot at an address that shares its file offset's place in a
#: 64-byte line: the kernel's copy out of the page cache runs at memory speed when source
#: and destination are aligned alike, and at two thirds of it or less when they are not
#: (a file whose data starts 8 bytes into a line is the common case).  Slots are allocated
#: this much larger than ``slot_bytes`` so that a lone request fits with its padding.
SLOT_ALIGN = 64


def slot_position(pos: int, offset: int) -> int:
    """The first slot position at or after ``pos`` aligned as file ``offset`` is, mod
    :data:`SLOT_ALIGN`; contiguous requests therefore follow each other with no gap."""
    return pos + (offset - pos) % SLOT_ALIGN


class Unit:
    """Up to one slot of consecutive requests of one file.

    ``requests`` are whole requests of the plan or, where a unit boundary falls inside one,
    parts of it cut at a page boundary.  ``slot_offsets[i]`` is where request ``i``
    lands in a staging slot (:func:`slot_position`); ``nbytes`` counts the requests' bytes,
    ``end`` the slot bytes used, padding included.
    """

    __slots__ = ("source", "requests", "slot_offsets", "nbytes", "end")

    def __init__(self, source: int, requests: list[Request]) -> None:
        self.source = source
        self.requests = requests
        offs, pos, total = [], 0, 0
        for r in requests:
            pos = slot_position(pos, r.offset)
            offs.append(pos)
            pos += r.nbytes
            total += r.nbytes
        self.slot_offsets = offs
        self.nbytes = total
        self.end = pos

    def copies(self, row_base: int, from_file: bool) -> list[tuple[int, int, int, int]]:
        """``(key, tensor_offset, source_offset, nbytes)`` per device copy; a tensor's pieces
        that follow each other in the unit are merged into one copy.  The source offset is
        in the file (``from_file``) or in the staging slot."""
        out: list[list[int]] = []
        for r, slot_off in zip(self.requests, self.slot_offsets, strict=True):
            at = r.offset if from_file else slot_off
            for p in r.pieces:
                key = row_base + p.row
                src = at + p.request_offset
                if out:
                    k, t, s, n = out[-1]
                    if k == key and t + n == p.tensor_offset and s + n == src:
                        out[-1][3] += p.nbytes
                        continue
                out.append([key, p.tensor_offset, src, p.nbytes])
        return [tuple(c) for c in out]  # type: ignore[misc]


def _split_request(r: Request, cut: int) -> tuple[Request, Request]:
    """``r`` as two requests, the first ending at file offset ``cut`` (inside ``r``)."""
    at = cut - r.offset
    left, right = [], []
    for p in r.pieces:
        end = p.request_offset + p.nbytes
        if end <= at:
            left.append(p)
        elif p.request_offset >= at:
            right.append(Piece(p.row, p.tensor_offset, p.request_offset - at, p.nbytes))
        else:
            first = at - p.request_offset
            left.append(Piece(p.row, p.tensor_offset, p.request_offset, first))
            right.append(Piece(p.row, p.tensor_offset + first, 0, p.nbytes - first))
    return Request(r.offset, at, tuple(left)), Request(cut, r.nbytes - at, tuple(right))


def units(index: int, requests: Sequence[Request], slot_bytes: int, splittable: bool) -> list[Unit]:
    """Group a file's requests (in file order) into units of at most ``slot_bytes``.

    With ``splittable``, a request that does not fit is cut at the last page boundary that
    fits; otherwise it starts the next unit (a request larger than a slot is a unit alone:
    the caller sizes slots to the largest request then).
    """
    units: list[Unit] = []
    cur: list[Request] = []
    size = 0  # slot bytes used by ``cur``, padding included
    pending = collections.deque(r for r in requests if r.nbytes)
    while pending:
        r = pending.popleft()
        start = slot_position(size, r.offset)
        # a unit's first request has the whole slot: slots are SLOT_ALIGN larger for its padding
        room = max(0, slot_bytes - start) if cur else slot_bytes
        if r.nbytes <= room:
            cur.append(r)
            size = start + r.nbytes
            continue
        if splittable:
            cut = (r.offset + room) // _PAGE * _PAGE
            if cut <= r.offset and not cur:  # a slot smaller than a page: cut anywhere
                cut = r.offset + room
            if cut > r.offset:
                head, tail = _split_request(r, cut)
                units.append(Unit(index, cur + [head]))
                cur, size = [], 0
                pending.appendleft(tail)
                continue
        if cur:  # close this unit; r starts the next one
            units.append(Unit(index, cur))
            cur, size = [], 0
            pending.appendleft(r)
            continue
        units.append(Unit(index, [r]))
    if cur:
        units.append(Unit(index, cur))
    return units
