"""Statistics folded on the CPU as a load reads: :class:`StatsCollector`, the pipeline's read
hook on the reader threads (host destinations), and the fold of a tensor's bytes from the
file at hand-out where no reader thread saw them (a device load through the ring, whose copy
threads are native).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from engine.base import dtypes as _dt
from engine.format.header import Header
from engine.io.reader import pread_into

__all__ = ["StatsCollector"]


class StatsCollector:
    """Statistics of tensors as their pieces are read, on the reader threads.

    Its :meth:`fill` is the pipeline's read hook.  A piece of at least ``WINDOW`` bytes is
    read and summarised in one native call, a window at a time, so that the kernel finds
    each window in the L2 cache where the read just left it (summarising a whole 16 MiB
    request after reading it would fetch it back from memory).  Smaller pieces are read
    together with one ``preadv`` and summarised right after.  Each reader thread has its
    own accumulator per tensor; they merge when the tensor is complete.
    """

    #: bytes per window: well inside a core's L2 with room for the kernel's scratch
    WINDOW = 256 << 10

    def __init__(self, header: Header, rows: list[int], path: str | None) -> None:
        from engine.numerics import statistics  # Numba: only for a load that asks for statistics

        self._new = statistics.Accumulator
        self._empty = statistics.Stats.empty()
        self.path = path
        t = header.table
        self.kind: dict[int, str] = {}
        for r in rows:
            d = _dt.DTYPES[int(t.codes[r])]
            if not d.sub_byte and d.name in statistics.SUPPORTED_NAMES:
                self.kind[r] = d.name
        self._acc: dict[int, dict[int, Any]] = {}  # row -> thread id -> Accumulator

    def _accumulator(self, row: int):
        per_thread = self._acc.setdefault(row, {})  # atomic: both threads get the same dict
        me = threading.get_ident()
        acc = per_thread.get(me)
        if acc is None:  # only this thread adds its own key
            acc = per_thread[me] = self._new(self.kind[row])
        return acc

    def fill(self, fd: int, req, targets: list) -> None:
        kind = self.kind
        run: list = []  # small pieces, contiguous in the file, read together
        run_offset = req.offset

        def flush() -> None:
            if run:
                pread_into(fd, run_offset, [v for _, v in run], path=self.path)
                for row, v in run:
                    if row in kind:
                        self._accumulator(row).add(v)
                run.clear()

        for p, view in zip(req.pieces, targets, strict=True):
            if p.nbytes < self.WINDOW or p.row not in kind:
                if not run:
                    run_offset = req.offset + p.request_offset
                run.append((p.row, view))
                continue
            flush()
            offset = req.offset + p.request_offset
            dest = np.frombuffer(view, np.uint8)
            acc = self._accumulator(p.row)
            done = acc.read(fd, offset, dest, self.WINDOW)
            if done < p.nbytes:  # a short read or an error: read the rest the usual way
                pread_into(fd, offset + done, [view[done:]], path=self.path)
                acc.add(view[done:])
        flush()

    #: bytes of the host buffer :meth:`fold_file` reads through
    SCRATCH = 4 << 20

    def fold_file(self, fd: int, offset: int, nbytes: int, row: int) -> None:
        """Fold ``row``'s bytes from the file (``nbytes`` at ``offset``) when no reader thread
        saw them: a device load through the ring, whose copy threads are native, folds the
        tensors the device does not summarise this way as each is handed out (the bytes come
        from the page cache again, through a bounded host buffer, never back from the device)."""
        if row not in self.kind or not nbytes:
            return
        acc = self._accumulator(row)
        scratch = np.empty(min(nbytes, self.SCRATCH), np.uint8)
        done = 0
        while done < nbytes:
            n = min(len(scratch), nbytes - done)
            view = scratch[:n]
            got = acc.read(fd, offset + done, view, self.WINDOW)
            if got < n:  # a short read or an error: the rest the usual way, which raises with the reason
                pread_into(fd, offset + done + got, [memoryview(view)[got:]], path=self.path)
                acc.add(memoryview(view)[got:])
            done += n

    def result(self, row: int):
        """Statistics of a complete tensor (asked once per tensor: its accumulators go)."""
        if row not in self.kind:
            return None
        out = self._empty
        for acc in self._acc.pop(row, {}).values():
            out = out.merge(acc.result())
        return out
