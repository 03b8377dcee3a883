"""The device side of the pipeline: two paths that feed a device at once.

*copy path*
    Pinned staging slots of a few MiB per core (:func:`default_slot_bytes`).  Each slot is
    filled by one native call that splits it over every core (:func:`engine.reader.split_reader`:
    native threads started once per load, GIL released, ``pread`` or a populated mapping,
    whichever measures faster, a truncated file an error and never a SIGBUS); its
    host-to-device copies are then issued on the path's stream and the next slot is filled
    while they run.  Three passes per byte (page cache read, slot write, DMA read), the
    last two mostly in the last-level cache: the slots are small enough to stay there.
*register path*
    For bytes already in the page cache (``mincore``), the file's read-only mapping itself
    is page-locked (``cudaHostRegister(..., cudaHostRegisterReadOnly)``) one slot-sized
    unit at a time and the device copies straight from it; the range is unregistered once
    the copy's event completes.  One pass over host memory; bounded by how fast one thread
    can page-lock.  Pages past the end of a truncated file cannot be page-locked: the
    refusal sends the unit to the copy path, whose read then raises
    :class:`~engine.errors.ReadError`.

Both paths take units (up to a slot of consecutive requests of one file,
:mod:`engine.device_units`) from one queue, the copy path from the front and the register
path from the back, so each runs at its own measured pace and the copy engine is never
idle; near the end a path leaves the last units to the other one when the rates say the
other would finish them sooner.  The staging slots are a ring
(:mod:`engine.device_staging`, which can also keep them between loads);
:class:`DeviceLoad` is one load.  What a framework provides is :class:`DeviceOps`
(:mod:`engine.sinks`).  A load of remote files has its own copy path
(:meth:`DeviceLoad._remote_copy_path`): connections instead of the native copy.

:func:`engine.pipeline.run_sources` is the entry point: it builds the sources, the
destination and the completion tracker that a :class:`DeviceLoad` is handed.
"""

from __future__ import annotations

import collections
import functools
import mmap
import os
import sys
import threading
import time
from typing import Protocol

import numpy as np

from . import device_ring
from ._threads import run_threads
from .device_staging import Ring
from .device_units import SLOT_ALIGN, Unit, UnitQueue, units
from .errors import DeviceError
from .reader import check_read, close_mapping, copy_mapping, kept, split_reader

__all__ = ["DeviceOps", "DeviceLoad", "REGISTER_DEPTH", "default_slot_bytes", "default_copy_threads"]

#: Units the register path keeps page-locked at once (one copying, one being page-locked).
REGISTER_DEPTH = 2
_PAGE = mmap.PAGESIZE
class DeviceOps(Protocol):
    """What the pipeline needs from a device framework (torch CUDA, CuPy, or a test double).

    ``free_staging``, ``wrap_host``, ``register`` and ``unregister`` are optional: without
    the last three the register path is off.
    """

    def alloc_staging(self, nbytes: int):
        """A pinned host buffer; returns ``(handle, writable memoryview)``."""

    def free_staging(self, handle) -> None:
        """Release a buffer from :meth:`alloc_staging` (unlock its pages)."""

    def wrap_host(self, view: memoryview):
        """A handle for read-only host memory (a file mapping) usable as a copy source."""

    def register(self, handle, offset: int, nbytes: int) -> bool:
        """Page-lock bytes ``[offset, offset + nbytes)`` of a :meth:`wrap_host` handle for
        DMA; ``False`` when refused (nothing is then locked)."""

    def unregister(self, handle, offset: int, nbytes: int) -> None:
        """Undo :meth:`register` of the same range."""

    def new_stream(self): ...

    def copy_to_device(self, dst, dst_offset: int, src_handle, src_offset: int, nbytes: int, stream) -> None:
        """Asynchronously copy ``nbytes`` of a staging or wrapped buffer to byte ``dst_offset`` of ``dst``."""

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
    """Bytes per staging slot (and per register unit) when the caller does not say: 4 MiB
    per copy thread (``threads``, default :func:`default_copy_threads`), at least 8 MiB and
    at most 64 MiB.

    Small slots: a slot is written by the copy threads and read by the DMA engine at once,
    and two slots of a few MiB stay in the last-level cache in between, so its bytes cross
    host memory once (page cache read) instead of three times; they are also page-locked in
    no time at a load's start, and bound what a load holds locked (two slots and two
    registered units).  On this project's 2-core test host, 8 MiB slots took the host side
    of the copy path from 0.40x to 0.56-1.06x of the machine's copy limit, where the
    128 MiB slots of before spent most of each load page-locking and writing back memory
    (``scripts/bench_host.py``; BENCHMARKS.md).  4 MiB per thread keeps each share's own cost
    (waking a thread, a system call or a populate) small next to its copy.
    """
    n = threads or default_copy_threads()
    return max(8 << 20, min(64 << 20, n * SHARE_BYTES))


class DeviceLoad:
    """One device load: the units, the two paths, their threads and their clean-up.

    ``sources`` are :class:`engine.pipeline.Source` s, ``dest`` a device
    :class:`engine.pipeline.Destination`, ``tracker`` reports each tensor when its last
    copy has completed (``tracker.landed([(key, nbytes), ...])``); the other arguments are
    those of :func:`engine.pipeline.run_sources`.
    """

    def __init__(
        self, sources, dest, tracker, cancel, *, threads, slots, slot_bytes, gpu_path, fill, after_copy=None,
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
        can_register = all(hasattr(self.ops, m) for m in ("wrap_host", "register", "unregister"))
        # remote files have no page cache to register, and their own copy path
        self.remote = any(s.ranges is not None for s in sources)
        if self.remote and (fill is not None or not all(s.ranges is not None for s in sources)):
            raise ValueError("a device load of remote files takes no fill hook and no local files")
        # the native chunk ring: every plain load of local files (hooks still take the slots below)
        self.use_ring = (gpu_path != "register" and fill is None and after_copy is None and not self.remote
                         and device_ring.supports(self.ops))
        self.ring = None
        if self.use_ring:
            g = device_ring.default_geometry()
            if slot_bytes:
                chunk = max(4096, slot_bytes // 4096 * 4096)
                g = device_ring.Geometry(chunk, max(2, min(g.chunks, device_ring.MAX_RING_BYTES // chunk)), g.threads)
            if threads:
                g = g._replace(threads=threads)
            self.ring = g
        # page-locking the file's mapping itself: only when asked for (it measured slower than
        # the copy path on an H100 host and page-locks the file's pages; BENCHMARKS.md)
        self.use_register = gpu_path == "register" and fill is None and can_register and not self.remote
        if gpu_path == "register" and not can_register:
            raise DeviceError("gpu_path='register' asked for, but the device cannot page-lock host memory")
        self.gpu_path = gpu_path
        self.units = [u for i, s in enumerate(sources)
                      for u in units(i, s.requests, self.slot_bytes, splittable=fill is None)]

    # -- set-up and tear-down --------------------------------------------------------------

    def run(self) -> None:
        if self.use_ring:
            self.ring_stats = device_ring.load(self.sources, self.dest, self.tracker, self.cancel, self.ring)
            return
        maps: dict[int, tuple] = {}  # source -> (mmap, handle)
        try:
            copy_only, shared = self.units, []  # type: list[Unit], list[Unit]
            if self.use_register:
                copy_only, shared = [], []
                for u in self.units:
                    if self._registrable(u, maps):
                        shared.append(u)
                    else:
                        copy_only.append(u)
            self.maps = maps
            copy_shares = self.gpu_path != "register"
            self.queue = UnitQueue(copy_only, shared, self.cancel, copy_shares=copy_shares)
            # slots beyond the first are worth page-locking ahead only if the copy path
            # may take more than one unit
            self.copy_units = len(copy_only) + (len(shared) if copy_shares else 0)
            jobs = [self._remote_copy_path if self.remote else self._copy_path]
            if shared:
                self.queue.register_active = True
                jobs.append(self._register_path)
            run_threads(jobs, name="engine-device", on_error=self._stop)
        finally:
            mappings = [m for m, _ in maps.values() if m is not None]
            maps.clear()  # drops the handles (and their exports of the mappings) first
            self.maps = {}
            for m in mappings:
                try:
                    m.close()
                except BufferError:  # a view is still alive somewhere: the GC unmaps it
                    pass

    def _stop(self) -> None:
        self.cancel.set()
        queue = getattr(self, "queue", None)
        if queue is not None:
            with queue.cond:
                queue.cond.notify_all()

    def _mapping(self, index: int, maps: dict):
        if index not in maps:
            src = self.sources[index]
            try:
                size = os.fstat(src.fd).st_size
                m = mmap.mmap(src.fd, size, access=mmap.ACCESS_READ) if size else None
            except (OSError, ValueError):
                m = None
            maps[index] = (m, self.ops.wrap_host(memoryview(m)) if m is not None else None)
        return maps[index]

    def _registrable(self, unit: Unit, maps: dict) -> bool:
        m, _ = self._mapping(unit.source, maps)
        if m is None:
            return False
        spans = unit.spans()
        return spans[-1][0] + spans[-1][1] <= len(m)  # else the file is shorter than its plan

    # -- the copy path ---------------------------------------------------------------------

    def _copy_path(self) -> None:
        ops, queue = self.ops, self.queue
        ops.bind_thread()
        stream = ops.new_stream()
        ring = Ring(ops, self.slots, self.slot_bytes + SLOT_ALIGN, ahead=self.copy_units > 1)
        in_flight: list = [None] * self.slots  # (event, landed parts) per slot
        reader = None
        mappings: dict[int, mmap.mmap | None] = {}  # source -> the split copies' mapping
        if self.fill is None:
            reader = split_reader(self.threads)  # native threads for the whole load
        k = 0
        try:
            while (unit := queue.take_copy()) is not None:
                began = time.monotonic()
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
                queue.finished("copy", unit.nbytes, time.monotonic() - began)
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
        units = self.units  # a remote file has no mapping to register: every unit is copied
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

    # -- the register path -----------------------------------------------------------------

    def _register_path(self) -> None:
        ops, queue = self.ops, self.queue
        ops.bind_thread()
        stream = ops.new_stream()
        in_flight: collections.deque = collections.deque()  # (event, handle, ranges, parts)
        try:
            while (unit := queue.take_register()) is not None:
                began = time.monotonic()
                m, handle = self.maps[unit.source]
                ranges = self._page_ranges(unit, len(m))
                # the oldest unit is retired first: the depth bound, and a neighbour that
                # shares a page with this unit must be unregistered before it is registered
                while in_flight and (
                    len(in_flight) >= REGISTER_DEPTH or _overlaps(in_flight, handle, ranges)
                ):
                    self._retire(in_flight.popleft())
                done = []
                for off, n in ranges:
                    if self.cancel.is_set() or not ops.register(handle, off, n):
                        break
                    done.append((off, n))
                if len(done) < len(ranges):
                    for off, n in done:
                        ops.unregister(handle, off, n)
                    queue.register_settled(unit, accepted=False)
                    continue
                queue.register_settled(unit, accepted=True)
                src = self.sources[unit.source]
                targets = self.dest.device_targets
                parts = []
                try:
                    for key, toff, foff, n in unit.copies(src.row_base, from_file=True):
                        ops.copy_to_device(targets[key], toff, handle, foff, n, stream)
                        parts.append((key, n))
                    self._after_copy(unit, stream)
                finally:  # whatever was issued is waited for before its range is unregistered
                    in_flight.append((ops.record(stream), handle, ranges, parts))
                queue.finished("register", unit.nbytes, time.monotonic() - began)
        finally:
            queue.register_done()
            while in_flight:
                self._retire(in_flight.popleft())

    @staticmethod
    def _page_ranges(unit: Unit, limit: int) -> list[tuple[int, int]]:
        """The unit's spans widened to whole pages (the last one clipped to the mapping's
        pages), as ``(offset, nbytes)``."""
        end_limit = -(-limit // _PAGE) * _PAGE
        out: list[tuple[int, int]] = []
        for off, n in unit.spans():
            a = off // _PAGE * _PAGE
            b = min(-(-(off + n) // _PAGE) * _PAGE, end_limit)
            if out and out[-1][0] + out[-1][1] >= a:  # spans that share a page: one range
                a = out[-1][0]
                out.pop()
            out.append((a, b - a))
        return out

    def _retire(self, item) -> None:
        event, handle, ranges, parts = item
        try:
            self.ops.wait(event)
        finally:
            for off, n in ranges:
                self.ops.unregister(handle, off, n)
        if not self.cancel.is_set():
            self.tracker.landed(parts)


def _overlaps(in_flight, handle, ranges) -> bool:
    for _, h, held, _ in in_flight:
        if h is not handle:
            continue
        for a, n in held:
            for b, m in ranges:
                if a < b + m and b < a + n:
                    return True
    return False
