"""Device scratch for the tensors a load quantizes: where their source bytes land before the
kernels turn them into int8, and how a load is cut into windows (ring runs of their own) so
that scratch never holds them all at once.

:class:`Staging` is a device load's row -> byte buffer map: the unquantized tensors'
destinations, and for each tensor to quantize a buffer of its source bytes carved, with the
other tensors of its window, from one device allocation (:func:`carve`).
:func:`cut_windows` is where a window closes.  :mod:`engine.loading.load_hooks` stages each
window's scratch before its ring run and frees it after.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["ALIGN", "Staging", "carve", "cut_windows"]


class Staging(dict):
    """Row -> device byte buffer: the destinations of the unquantized tensors, and for the
    tensors to quantize a staging buffer of their source bytes: carved from one allocation
    per window (:meth:`stage`), or made at first use."""

    def __init__(self, targets, sizes: dict[int, int], empty) -> None:
        super().__init__(targets)
        self.sizes = sizes
        self._empty = empty
        self._lock = threading.Lock()

    def stage(self, rows: list[int]) -> None:
        """The scratch of ``rows`` (a window's tensors to quantize, in file order) in two
        device allocations, not one per tensor: the last row's own (it may straddle into the
        next window, and must not keep this window's block alive there), and one block for
        the others, each a view of it at an aligned offset.  A block lives until the last of
        its views goes."""
        rows = [r for r in rows if not dict.__contains__(self, r) and self.sizes.get(r, 0)]
        for group in (rows[:-1], rows[-1:]):
            offsets, total = carve([self.sizes[r] for r in group])
            if not total:
                continue
            block = self._empty((total,), np.uint8)
            with self._lock:
                for r, off in zip(group, offsets, strict=True):
                    self[r] = block[off : off + self.sizes[r]]

    def __missing__(self, row: int):
        with self._lock:  # two reader threads may bring the first pieces of one tensor
            if dict.__contains__(self, row):
                return dict.__getitem__(self, row)
            if row not in self.sizes:
                raise KeyError(row)
            buf = self._empty((self.sizes[row],), np.uint8)
            self[row] = buf
            return buf


#: alignment of the buffers carved from one device allocation (that of cudaMalloc's
#: smallest blocks: every view dtype and vector load of the kernels is aligned)
ALIGN = 256


def carve(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes laid one after another at ``align``, and the
    bytes they span."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // align) * align
    return offsets, end


def cut_windows(requests, sizes: dict[int, int], limit: int):
    """Consecutive runs of ``requests`` (one file's, in file order), each with the rows whose
    first bytes it holds (in file order): ``(window, fresh)``.  A run closes before a request
    that starts a tensor of ``sizes`` (row -> source bytes of a tensor to quantize) once the
    run's such tensors would pass ``limit`` bytes; a tensor may straddle two runs."""
    seen: set[int] = set()
    window: list = []
    fresh: list[int] = []  # the rows whose first bytes are in the window, in file order
    staged = 0
    for req in requests:
        new = [r for r in dict.fromkeys(p.row for p in req.pieces) if r in sizes and r not in seen]
        starts = sum(sizes[r] for r in new)
        if window and starts and staged + starts > limit:
            yield window, fresh
            window, fresh, staged = [], [], 0
        window.append(req)
        fresh += new
        staged += starts
        seen.update(new)
    if window:
        yield window, fresh
