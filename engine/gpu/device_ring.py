"""File to device through the native chunk ring (:mod:`engine.gpu._ring`): the copy path of a
device load.

A load's pieces (file, offset, bytes, device address) are cut into chunks once
(:mod:`engine.gpu.chunk_plan`: one ``chunk_bytes``-aligned block of a file per chunk), then one
native call moves them: ``threads`` copy threads each take the next chunk, wait for its slot's
previous copy to complete, fill it from the page cache; the calling thread issues each chunk's
``cudaMemcpyAsync`` in order on the load's stream as soon as it is full.  Two copies of each
byte: page cache -> page-locked chunk, chunk -> device by DMA.  No Python runs per chunk:
the calling thread takes the GIL every few tens of milliseconds to report the tensors that
have landed and to see a cancel.

The ring's shape (chunk size, chunks in flight, copy threads) is a
:class:`~engine.gpu.geometry.Geometry`: host-dependent defaults, ``ENGINE_RING`` or the
loaders' ``ring=`` argument (:mod:`engine.gpu.geometry`).

Remote files (a :class:`~engine.loading.pipeline.Source` with ``ranges``) take the same ring: the
load's connections, one Python thread each, fill the chunks instead of the copy threads
(:mod:`engine.gpu.remote_fill`: one ranged GET of a few chunks' file blocks straight into the
page-locked chunks); the issuing thread sends their DMAs in order as for a local file.  Two
copies of each byte: socket -> page-locked chunk, chunk -> device by DMA (a copy more with
``cache_dir``: the body written from the chunk to the local copy).  An HTTP request is an event
of the interpreter anyway; nothing else runs in Python per chunk.

What a device framework provides (its :class:`DeviceOps`, :mod:`engine.sinks`): the path of the
CUDA runtime it loaded (``runtime_path()``), its device index (``device_index``, resolved on the
caller's thread), the consumer's fence (``consumer_fence()``: an event recorded on the caller's
current stream when the operations were made, which the copies wait for) and the device address
of a target (``address(target)``).  The ring copies on a stream of its own.  The ring is the one
device path: nothing else moves bytes to a device.

Rings are set up, kept between loads and closed by :mod:`engine.gpu.rings`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Protocol

import numpy as np

from engine.errors import DeviceError
from engine.gpu.chunk_plan import Digests, Landing, Pieces, plan
from engine.gpu.cudart import runtime
from engine.gpu.geometry import Geometry, checked, default_geometry, stores
from engine.gpu.records import LoadRecord, publish
from engine.gpu.remote_fill import DeviceReread, Fillers
from engine.gpu.rings import KEPT, new_ring
from engine.io.reader import check_read, close_mapping, copy_mapping, copy_source, kept

__all__ = ["DeviceOps", "supports", "load", "prepare", "unmap_mode", "flush_unmaps"]

_LOG = logging.getLogger(__name__)


class DeviceOps(Protocol):
    """What the ring needs from a device framework (torch CUDA, CuPy, or a test double);
    :func:`supports` checks for it."""

    @property
    def device_index(self) -> int:
        """The CUDA device the load's targets live on."""

    def runtime_path(self) -> str | None:
        """The path of the ``libcudart`` the framework loaded, ``"driver:"`` and the CUDA
        driver's where it loaded none (:func:`engine.gpu.cudart.cuda_runtime_path`), or None."""

    def consumer_fence(self) -> int | None:
        """An event (``cudaEvent_t``) recorded on the caller's current stream on the device
        when these operations were made, on the caller's thread (where its allocations were
        made and its kernels queued): a load's copies start after it.  None: nothing to wait
        for."""

    def address(self, target) -> int:
        """The device address of a byte target."""

    # optional: ``fence_again()`` records the fence again, on the calling thread's current
    # stream, between the ring runs of one load (engine.loading.load_hooks' windows): the next
    # run's copies then also wait for the work queued there since


UNMAPS = ("end", "chunk")


def unmap_mode() -> str:
    """When the pages a load mapped to copy its files are given back: ``"end"`` (the
    default: each file is mapped once for the load, copy threads copy out of it with no
    system call per chunk, and the mapping is dropped in one step after the load, on a
    thread of its own) or ``"chunk"`` (each chunk's mapped run is unmapped as soon as it is
    copied, ``MADV_DONTNEED``: on a many-core host each is a TLB shootdown across the
    process).  The mapped pages are the page cache's, not new memory: the process's
    anonymous and page-locked memory is the same either way.  ``ENGINE_RING_UNMAP`` picks
    one; ``scripts/gpu_check.py`` times both."""
    value = os.environ.get("ENGINE_RING_UNMAP", "end").strip().lower()
    if value not in UNMAPS:
        raise ValueError(f"ENGINE_RING_UNMAP must be one of {UNMAPS}, not {value!r}")
    return value


class _Closer:
    """Closes file mappings on one thread of its own, after the load that used them: a
    whole file's page-table entries are torn down off the caller's path."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Nothing pending and no thread (also a forked child's start: the thread and what it
        was given are the parent's)."""
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.pending = 0
        self.thread: threading.Thread | None = None

    def close(self, mappings) -> None:
        if not mappings:
            return
        with self.cond:
            self.pending += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="engine-unmap", daemon=True)
                self.thread.start()
        self.jobs.put(mappings)

    def _run(self) -> None:
        while True:
            mappings = self.jobs.get()
            try:
                for m in mappings:
                    close_mapping(m)
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()

    def flush(self) -> None:
        """Wait until every mapping handed over so far is closed."""
        with self.cond:
            while self.pending:
                self.cond.wait()


CLOSER = _Closer()
if hasattr(os, "register_at_fork"):  # in a forked child the thread and its jobs are the parent's
    os.register_at_fork(after_in_child=CLOSER.forget)


def flush_unmaps() -> None:
    """Wait until the mappings of finished loads are dropped (:func:`unmap_mode` ``"end"``)."""
    CLOSER.flush()


class _Runs:
    """The device loads and ring set-ups in flight, for the exit hook (:func:`_at_exit`)."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """None in flight (also a forked child's start: the runs are the parent's threads')."""
        self.cond = threading.Condition()
        self.live: dict[int, dict] = {}
        self.exiting = False

    def enter(self, cancel: threading.Event | None) -> dict:
        """A run starts (its ``ring`` set once it has one); DeviceError once the
        interpreter is exiting."""
        entry: dict = {"cancel": cancel, "ring": None}
        with self.cond:
            if self.exiting:
                raise DeviceError("the interpreter is exiting: no device load starts now")
            self.live[id(entry)] = entry
        return entry

    def given_back(self, entry: dict) -> None:
        """The run's ring is about to be given back (the reaper may close it then): it is
        never stopped from here on (under the lock :meth:`stop` holds while it stops rings)."""
        with self.cond:
            entry["ring"] = None

    def leave(self, entry: dict) -> None:
        with self.cond:
            self.live.pop(id(entry), None)
            self.cond.notify_all()

    def stop(self, timeout: float) -> bool:
        """No run starts from now on; each one in flight is cancelled (natively: a run
        whose issuing thread waits for no GIL stops too) and waited for, at most ``timeout``
        seconds.  True when none is left."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self.exiting = True
            while self.live:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                for entry in self.live.values():
                    if entry["cancel"] is not None:
                        entry["cancel"].set()
                    if entry["ring"] is not None:
                        entry["ring"].stop()  # again each time: a run that was starting resets it
                self.cond.wait(min(left, 0.05))
        return True


RUNS = _Runs()

#: seconds the exit hook waits for the runs in flight (a cancelled run waits for its issued
#: copies; a ring's page-locking ahead of a load is not cancelled, only waited for)
EXIT_WAIT_SECONDS = 10.0


def _at_exit() -> None:
    """At interpreter exit, before the CUDA runtime's own teardown (its library's exit
    handlers run after the interpreter's): every device load in flight on a daemon thread is
    cancelled and waited for, a ring being set up too, and every ring closed, so that no
    thread of the engine calls the runtime while it is torn down.  Runs before
    :mod:`engine.gpu.rings`' own hook (registered after it)."""
    RUNS.stop(EXIT_WAIT_SECONDS)
    KEPT.release()
    KEPT.settle(EXIT_WAIT_SECONDS)


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RUNS.forget)


def supports(ops) -> bool:
    """Whether a device framework's operations can drive the ring."""
    return all(hasattr(ops, m) for m in ("runtime_path", "address")) and hasattr(ops, "device_index")


def consumer_fence(ops) -> int | None:
    """``ops.consumer_fence()`` where the framework has one (a test double may not)."""
    get = getattr(ops, "consumer_fence", None)
    return get() if get is not None else None


def _ring_key(ops, g: Geometry) -> tuple:
    return (ops.runtime_path(), ops.device_index, g)


def prepare(ops, geometry: Geometry | None = None, *, background: bool = False, linger: bool = False):
    """Set up the ring of ``ops``'s device (threads, events, every chunk page-locked) ahead of
    the first load.  Returns ``(seconds, cudaHostRegister calls)`` the page-locking took:
    ``(0.0, 0)`` when a ring is already set up or being set up for the device; None with
    ``background`` (the set-up runs on a thread of its own: a load that starts meanwhile
    waits for this ring rather than setting up a second one, and starts copying as soon as
    it is ready).  The ring is kept until a load takes it (``linger``: for
    :data:`~engine.gpu.rings.LINGER_SECONDS` only, as after a load)."""
    g = checked(geometry or default_geometry())
    key = _ring_key(ops, g)
    if not KEPT.pending(key):
        return None if background else (0.0, 0)

    def setup():
        ring = entry = None
        try:
            entry = RUNS.enter(None)
            ring = new_ring(ops, g)
            return ring.lock_all()
        finally:
            try:
                if ring is None:
                    KEPT.drop(key)
                elif not KEPT.give(key, ring, linger=linger):
                    ring.close()
            finally:
                if entry is not None:
                    RUNS.leave(entry)

    if not background:
        return setup()

    def quietly():
        try:
            setup()
        except Exception as exc:  # the load that follows sets its own ring up, and reports
            _LOG.debug("preparing the copy ring failed: %s", exc)

    threading.Thread(target=quietly, name="engine-ring-prepare", daemon=True).start()
    return None


#: seconds between the issuing thread's reports of landed tensors: a load with device kernels
#: reports (and launches them) more often, so that they start sooner after their copies
POLL_SECONDS = 0.05
HOOKED_POLL_SECONDS = 0.01


def load(sources, dest, tracker, cancel: threading.Event, geometry: Geometry | None = None, *,
         hooked: bool = False, connections: int | None = None) -> dict:
    """Move every request of ``sources`` (local or remote files) into ``dest``'s device targets
    through a chunk ring; reports tensors to ``tracker`` as they land (each once every copy into it has
    completed).  Returns what the ring did, as :meth:`LoadRecord.as_dict` (also published to
    :func:`load_records`).

    ``sources`` are local files, or remote ones (each with ``ranges``, no descriptor): those
    are filled by ``connections`` threads (default the ring's thread count), one ranged GET
    per run of the file in as many chunks as the sources' largest planned request holds
    (at most half the ring), received straight into the page-locked chunks (see the module's
    doc).  Copies of tensor bytes: 2 (file or socket -> chunk, chunk -> device).

    A source's ``mapping`` (a caller's mapping of the file, held beyond the load) is copied
    from and left mapped; otherwise each file is mapped for the load (see :func:`unmap_mode`)
    or read with ``pread`` (:func:`engine.io.reader.copy_source`).

    ``hooked``: the tracker's completion callback launches device kernels on each landed
    tensor (:mod:`engine.loading.load_hooks`): reports come every :data:`HOOKED_POLL_SECONDS`, and
    an exception it raises stops the load and propagates once every issued copy has completed.

    Raises :class:`~engine.errors.ReadError` naming the file of a failed read (a remote
    file's: the error its reader raised after its retries, naming the URL, the byte range
    and the reason), :class:`~engine.errors.DeviceError` for a failure of the runtime;
    returns early, with ``cancel`` set, when cancelled.  Every issued copy has completed, and
    every connection thread has ended, when it returns.
    """
    t_start = time.perf_counter()
    remote = [s.ranges is not None for s in sources]
    if any(remote) and not all(remote):
        raise ValueError("a ring load takes local files or remote ones, not both")
    ops = dest.device_ops
    g = checked(geometry or default_geometry())
    targets = dest.device_targets
    pieces = Pieces(sources, targets, ops.address)
    c_file, c_seg, s_pos, s_off, s_len, s_dst = plan(pieces, g.chunk_bytes)
    # files with checksums: the copy threads take each piece's CRC per chunk as they fill it
    digests = Digests(pieces, len(sources), g.chunk_bytes, tracker) \
        if getattr(tracker, "checked", None) and len(pieces.len) else None
    landing = Landing(pieces, c_seg, s_len, tracker, digests)
    if not len(c_file):
        return {}
    source, unmap = ("network" if remote[0] else copy_source()), unmap_mode()
    used = [] if remote[0] else sorted(set(c_file.tolist()))
    mappings: dict[int, object] = {}  # mappings this load made (or took from the kept ones)
    arrays: list = []
    fds = np.full(len(sources), -1, np.int32)
    maps = np.zeros(len(sources), np.uint64)
    lens = np.zeros(len(sources), np.int64)
    keeps = np.zeros(len(sources), np.uint8)
    key = _ring_key(ops, g)
    entry = RUNS.enter(cancel)  # left in the finally below, once the ring is given back
    t_ring = time.perf_counter()
    ring, cold = KEPT.take(key)
    fillers = None
    try:
        if ring is None:
            ring, cold = new_ring(ops, g), True
        with RUNS.cond:
            entry["ring"] = ring
        setup_s = time.perf_counter() - t_ring
        for i in used:
            fds[i] = sources[i].fd
            m = sources[i].mapping  # the caller's, held beyond the load
            if m is None:
                m = mappings[i] = copy_mapping(sources[i].fd)
            if m is not None:
                # the only views of the mapping: cleared before it is closed
                arrays.append(np.frombuffer(m, np.uint8))
                maps[i] = arrays[-1].ctypes.data if len(arrays[-1]) else 0
                lens[i] = len(arrays[-1])
                keeps[i] = i not in mappings or unmap == "end" or kept(m)

        def poll(done: int) -> bool:
            t0 = time.perf_counter()
            try:
                landing.upto(done)
            except BaseException:
                if fillers is not None:
                    cancel.set()  # the run stops: connections waiting between tries stop too
                raise
            finally:
                landing.seconds += time.perf_counter() - t0
            return cancel.is_set()

        if remote[0] and digests is not None:
            # bytes that crossed a network and fail their checksum are read again, onto the device
            tracker.reread = DeviceReread(sources, pieces, targets, ops.address, ring)
        if remote[0]:
            # one request per ``group`` chunks of a file: the request size the caller planned
            # (remote_load's chunk_bytes), the ring's chunks however small
            planned = max((r.nbytes for src in sources for r in src.requests), default=0)
            fillers = Fillers(ring, sources, c_file, c_seg, s_pos, s_off, s_len, cancel,
                              connections or ring.threads, max(1, planned // ring.chunk_bytes))
        try:
            kind, code, chunk, at, missing = ring.run(
                c_file, c_seg, s_pos, s_off, s_len, s_dst, fds, maps, lens, keeps, poll,
                HOOKED_POLL_SECONDS if hooked else POLL_SECONDS,
                adaptive=source != "mmap", stream_stores=stores() == "stream",
                fillers=fillers.count if fillers else 0, start=fillers.start if fillers else None,
                wait_for=consumer_fence(ops), **(digests.arrays() if digests is not None else {}))
        finally:
            if fillers is not None:
                fillers.join()  # they left the run before it returned: only their exits remain
        run = ring.last_run
        record = LoadRecord(
            chunks=int(run["chunks"]), bytes=int(s_len.sum()), chunk_bytes=ring.chunk_bytes, slots=ring.chunks,
            threads=fillers.count if fillers is not None else int(run["threads"]), seconds=time.perf_counter() - t_start, fill_wait_s=run["fill_wait_s"],
            slot_wait_s=run["slot_wait_s"], fill_s=fillers.fill_s if fillers is not None else run["fill_s"], lock_s=run["lock_s"],
            lock_calls=int(run["lock_calls"]), cold=cold, setup_s=setup_s, source=source, unmap=unmap,
            pread_bytes=int(run["pread_bytes"]), mmap_bytes=int(run["mmap_bytes"]), pageable=ring.pageable,
            network_bytes=int(run["net_bytes"]), reported=landing.reported, report_s=landing.seconds, hooked=hooked)
        if kind == 0 and (fillers is None or fillers.error() is None):
            # the last tensors (their kernels too) before the record is published, while the
            # load still holds the ring: a tensor read again after a failed checksum is put on
            # the device through it, which a ring given back may be closed under
            t0 = time.perf_counter()
            landing.upto(len(c_file))
            record = dataclasses.replace(record, reported=landing.reported,
                                         report_s=landing.seconds + time.perf_counter() - t0)
    finally:
        arrays.clear()
        later = []
        for m in mappings.values():
            if unmap == "end" and m is not None and not kept(m):
                later.append(m)  # a whole file's page tables: torn down off the caller's path
            else:
                close_mapping(m)  # None, a kept mapping given back, or one "chunk" emptied as it went
        CLOSER.close(later)
        RUNS.given_back(entry)
        try:
            if ring is not None and not KEPT.give(key, ring):
                ring.close()
        finally:
            RUNS.leave(entry)
    if kind == 1:
        src = sources[int(c_file[chunk])]
        check_read((code, at, missing), "the load", src.path, src.fd)  # raises: code is an errno or -1
    if kind == 2:
        src = sources[int(c_file[chunk])]
        rt = runtime(ops.runtime_path())
        raise DeviceError(
            f"copying {src.path or 'the file'} to the device failed (chunk {chunk} of {len(c_file)}): "
            f"{rt.error_string(code)} (CUDA error {code})", path=src.path)
    failed = fillers.error() if fillers is not None else None
    if failed is not None:
        raise failed
    if kind == 3:
        publish(record)
        cancel.set()
        return record.as_dict()
    publish(record)
    return record.as_dict()
