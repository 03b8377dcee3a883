"""The device side of the pipeline.

*the chunk ring* (:mod:`engine.gpu.device_ring`)
    Every plain device load of local files: small page-locked chunks filled by native copy
    threads, each chunk's host-to-device copy issued in order as soon as it is full, no
    Python per chunk.  Two copies of each byte (page cache -> chunk -> device).
*the slot path* (:class:`DeviceLoad` here)
    Loads whose bytes some Python must see or fetch: a ``fill`` hook (statistics folded on
    the CPU while the bytes are in the cache), an ``after_copy`` hook (device kernels queued
    after each request's copies) and remote files (connections fill the slots).  Pinned
    staging slots (:mod:`engine.gpu.device_staging`) taken in turn by units of up to a slot of
    consecutive requests (:mod:`engine.gpu.device_units`); each slot is filled (by one native
    split copy, by the fill hook, or by the connections) and its copies issued on the
    path's stream while the next one fills.

What a framework provides is :class:`DeviceOps` (:mod:`engine.sinks`).
:func:`engine.loading.pipeline.run_sources` is the entry point: it builds the sources, the
destination and the completion tracker that a :class:`DeviceLoad` is handed.
"""

from __future__ import annotations

import functools
import mmap
import os
import sys
import threading
from typing import Protocol

import numpy as np

from engine.base._threads import run_threads
from engine.gpu.device_staging import Ring
from engine.gpu.device_units import SLOT_ALIGN, Unit, units
from engine.io.reader import check_read, close_mapping, copy_mapping, kept, split_reader

__all__ = ["DeviceOps", "DeviceLoad", "default_slot_bytes", "default_copy_threads"]

_PAGE = mmap.PAGESIZE
class DeviceOps(Protocol):
    """What the pipeline needs from a device framework (torch CUDA, CuPy, or a test double).

    The chunk ring needs ``runtime_path``, ``device_index``, ``ring_stream`` and ``address``
    (see :mod:`engine.gpu.device_ring`); the slot path the methods below.  ``free_staging`` is
    optional.
    """

    def alloc_staging(self, nbytes: int):
        """A pinned host buffer; returns ``(handle, writable memoryview)``."""

    def free_staging(self, handle) -> None:
        """Release a buffer from :meth:`alloc_staging` (unlock its pages)."""

    def new_stream(self): ...

    def copy_to_device(self, dst, dst_offset: int, src_handle, src_offset: int, nbytes: int, stream) -> None:
        """Asynchronously copy ``nbytes`` of a staging buffer to byte ``dst_offset`` of ``dst``."""

    def record(self, stream):
        """An event that completes when everything issued on ``stream`` so far is done."""

    def wait(self, event) -> None:
        """Block (without the GIL) until ``event`` completes."""

    def bind_thread(self) -> None:
        """Make the device current in a worker thread."""


@functools.cache
def default_copy_threads() -> int:
    """Native threads that split each staging slot: every core (at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


#: each copy thread's share of a staging slot, by default
SHARE_BYTES = 4 << 20


@functools.cache
def default_slot_bytes(threads: int | None = None) -> int:
    """Bytes per staging slot of the slot path when the caller does not say: 4 MiB
    per copy thread (``threads``, default :func:`default_copy_threads`), at least 8 MiB and
    at most 64 MiB.

    Small slots: a slot is written by the copy threads and read by the DMA engine at once,
    and two slots of a few MiB stay in the last-level cache in between, so its bytes cross
    host memory once (page cache read) instead of three times; they are also page-locked in
    no time at a load's start, and bound what a load holds locked (two slots).  4 MiB per
    thread keeps each share's own cost (waking a thread, a system call or a populate) small
    next to its copy (BENCHMARKS.md has the runs).
    """
    n = threads or default_copy_threads()
    return max(8 << 20, min(64 << 20, n * SHARE_BYTES))


class DeviceLoad:
    """One device load on the slot path: its units, threads and clean-up.

    ``sources`` are :class:`engine.loading.pipeline.Source` s, ``dest`` a device
    :class:`engine.loading.pipeline.Destination`, ``tracker`` reports each tensor when its last
    copy has completed (``tracker.landed([(key, nbytes), ...])``); the other arguments are
    those of :func:`engine.loading.pipeline.run_sources`.
    """

    def __init__(
        self, sources, dest, tracker, cancel, *, threads, slots, slot_bytes, fill, after_copy=None,
    ) -> None:
        self.sources = sources
        self.dest = dest
        self.ops = dest.device_ops
        self.tracker = tracker
        self.cancel = cancel
        self.threads = threads or default_copy_threads()
        self.slots = max(1, slots)
        self.fill = fill
        self.after_copy = after_copy
        total = sum(r.nbytes for s in sources for r in s.requests)
        want = slot_bytes or default_slot_bytes(self.threads)
        # never a slot larger than the load (rounded up to a page); a fill hook sees whole
        # requests, so then a slot holds at least the largest one
        self.slot_bytes = max(1, min(want, -(-max(total, 1) // _PAGE) * _PAGE))
        if fill is not None:
            self.slot_bytes = max([self.slot_bytes] + [r.nbytes for s in sources for r in s.requests])
        # remote files have their own copy path: connections fill the slots
        self.remote = any(s.ranges is not None for s in sources)
        if self.remote and (fill is not None or not all(s.ranges is not None for s in sources)):
            raise ValueError("a device load of remote files takes no fill hook and no local files")
        self.units = [u for i, s in enumerate(sources)
                      for u in units(i, s.requests, self.slot_bytes, splittable=fill is None)]

    def run(self) -> None:
        run_threads([self._remote_copy_path if self.remote else self._copy_path], name="engine-device",
                    on_error=self.cancel.set)

    # -- the copy path ---------------------------------------------------------------------

    def _copy_path(self) -> None:
        ops = self.ops
        ops.bind_thread()
        stream = ops.new_stream()
        ring = Ring(ops, self.slots, self.slot_bytes + SLOT_ALIGN, ahead=len(self.units) > 1)
        in_flight: list = [None] * self.slots  # (event, landed parts) per slot
        reader = None
        mappings: dict[int, mmap.mmap | None] = {}  # source -> the split copies' mapping
        if self.fill is None:
            reader = split_reader(self.threads)  # native threads for the whole load
        k = 0
        try:
            for unit in self.units:
                if self.cancel.is_set():
                    break
                s = k % self.slots
                k += 1
                if in_flight[s] is not None:  # the slot's last copies must finish first
                    event, parts = in_flight[s]
                    ops.wait(event)
                    in_flight[s] = None
                    self.tracker.landed(parts)
                handle, view = ring.slot(s)
                if reader is not None and unit.source not in mappings:
                    mappings[unit.source] = copy_mapping(self.sources[unit.source].fd)
                self._read_unit(unit, view, reader, mappings.get(unit.source))
                src = self.sources[unit.source]
                targets = self.dest.device_targets
                parts = []
                for key, toff, soff, n in unit.copies(src.row_base, from_file=False):
                    ops.copy_to_device(targets[key], toff, handle, soff, n, stream)
                    parts.append((key, n))
                self._after_copy(unit, stream)
                in_flight[s] = (ops.record(stream), parts)
        finally:
            # every issued copy completes before its slot is released
            for item in in_flight:
                if item is not None:
                    ops.wait(item[0])
                    if not self.cancel.is_set():
                        self.tracker.landed(item[1])
            ring.free()
            if reader is not None:
                reader.close()
            for m in mappings.values():
                close_mapping(m)

    def _remote_copy_path(self) -> None:
        """The copy path for remote files: ``self.threads`` readers, one connection each, take
        the requests of the units in order and move on to the next unit's as soon as the
        current one's are all taken (its slot permitting), so no connection idles while a
        unit's last requests are still arriving; this thread copies each unit to the device
        once its last byte has landed and frees its slot when the copies have completed."""
        ops = self.ops
        ops.bind_thread()
        stream = ops.new_stream()
        units = self.units
        ring = Ring(ops, self.slots, self.slot_bytes + SLOT_ALIGN, ahead=len(units) > 1)
        cond = threading.Condition()
        left = [len(u.requests) for u in units]
        fillable = [0]  # units below this have their slot to fill
        errors: list[BaseException] = []
        work = iter([(ui, ri) for ui, u in enumerate(units) for ri in range(len(u.requests))])
        slots: list = []

        def reader() -> None:
            try:
                while True:
                    with cond:
                        item = next(work, None)
                        if item is None:
                            return
                        ui, ri = item
                        while ui >= fillable[0] and not self.cancel.is_set():
                            cond.wait()
                        if self.cancel.is_set():
                            return
                    unit = units[ui]
                    r, off = unit.requests[ri], unit.slot_offsets[ri]
                    view = slots[ui % self.slots][1]
                    self.sources[unit.source].ranges(r.offset, [view[off : off + r.nbytes]])
                    with cond:
                        left[ui] -= 1
                        if not left[ui]:
                            cond.notify_all()
            except BaseException as exc:  # handed to the copying thread
                with cond:
                    errors.append(exc)
                    self.cancel.set()
                    cond.notify_all()

        threads: list[threading.Thread] = []
        try:
            for s in range(min(self.slots, len(units))):
                slots.append(ring.slot(s))  # allocated on this (device-bound) thread
            with cond:
                fillable[0] = len(slots)
            for _ in range(max(1, min(self.threads, sum(left)))):
                t = threading.Thread(target=reader, name="engine-remote", daemon=True)
                t.start()
                threads.append(t)
            targets = self.dest.device_targets
            for ui, unit in enumerate(units):
                with cond:
                    while left[ui] and not self.cancel.is_set():
                        cond.wait()
                    if self.cancel.is_set():
                        break
                handle = slots[ui % self.slots][0]
                src = self.sources[unit.source]
                parts = []
                for key, toff, soff, n in unit.copies(src.row_base, from_file=False):
                    ops.copy_to_device(targets[key], toff, handle, soff, n, stream)
                    parts.append((key, n))
                self._after_copy(unit, stream)
                ops.wait(ops.record(stream))  # the readers fill other slots meanwhile
                self.tracker.landed(parts)
                with cond:
                    fillable[0] += 1
                    cond.notify_all()
        finally:
            if errors or sys.exc_info()[0] is not None:
                self.cancel.set()
            with cond:
                cond.notify_all()
            for t in threads:
                t.join()
            ring.free()
        if errors:
            raise errors[0]

    def _after_copy(self, unit: Unit, stream) -> None:
        """The ``after_copy`` hook for each request of a unit whose copies are issued."""
        if self.after_copy is not None:
            for r in unit.requests:
                self.after_copy(r, stream)

    def _read_unit(self, unit: Unit, view: memoryview, reader, mapping: mmap.mmap | None = None) -> None:
        src = self.sources[unit.source]
        if self.fill is not None:
            fill, reqs = self.fill, unit.requests

            def part(lo: int, hi: int) -> None:
                for r, off in zip(reqs[lo:hi], unit.slot_offsets[lo:hi], strict=True):
                    fill(src.fd, r, [view[off + p.request_offset : off + p.request_offset + p.nbytes]
                                     for p in r.pieces])

            n = max(1, min(self.threads, len(reqs)))
            bounds = [len(reqs) * i // n for i in range(n + 1)]
            run_threads([functools.partial(part, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
            return
        reqs = unit.requests
        file_offsets = np.fromiter((r.offset for r in reqs), np.int64, len(reqs))
        targets = [view[off : off + r.nbytes] for r, off in zip(reqs, unit.slot_offsets, strict=True)]
        # one native call: the unit's bytes split evenly over the reader's threads, GIL released
        check_read(reader.copy(src.fd, mapping, file_offsets, targets, keep=kept(mapping)), "the load", src.path,
                   src.fd)
