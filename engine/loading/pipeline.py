"""The threaded pipeline: read plans of one or many files -> destinations.

Host destinations (numpy arrays, CPU torch tensors) are filled straight from the file by
worker threads that take read requests (see :func:`engine.planning.plan.plan_reads`) in file order:
each piece of a request is a slice of its tensor's memory and one ``preadv`` scatters the
request into them.  No staging, one copy (page cache to destination).

Device destinations (CUDA) of local files go through the native chunk ring
(:mod:`engine.gpu.device_ring`): small page-locked chunks filled by native copy threads, each
chunk's copy to the device issued in order as soon as it is full; remote files too, whose
connections (``threads`` of them) each take the next chunks and receive their ranged GET
straight into them.  Loads with device kernels (``stats=True``, ``quantize="int8"``:
:mod:`engine.loading.load_hooks`) take the same ring: the ring reports the tensors whose last
copy has completed, a batch every few milliseconds, and the completion callback launches each
one's kernels on a side stream, where they overlap the copies of the chunks that follow.  A
destination's ``windows`` cuts such a load into consecutive ring runs, so that the source
bytes of the tensors being quantized (landed in device scratch buffers) are never all on the
device at once.  The ring is the one device path: device operations without its entry points
(:class:`~engine.gpu.device_ring.DeviceOps`) fail the load with a
:class:`~engine.errors.DeviceError`.
On the host, worker threads, one per connection (``threads``), receive each request of a
remote file into its tensors.

A tensor is *complete* when every byte of it has landed (for a device: when the events of
all its copies have completed); completions are reported through a callback as they happen,
which is what :func:`engine.stream` yields from.  Several files (the shards of a
checkpoint) run as one pipeline: :func:`run_sources`.

Memory bounds of a device load: page-locked host memory ``chunks * chunk_bytes`` of the ring
(:data:`engine.gpu.geometry.MAX_RING_BYTES` at most by default; each chunk locked on first
use); no file mapping outlives its chunk's copy.  A ring stays set up for a moment after the load (:data:`engine.gpu.rings.LINGER_SECONDS`,
so that a loop of small loads sets it up once) and is then closed; nothing stays page-locked
after that unless :func:`engine.gpu.rings.keep_rings` (``engine.keep_staging``) asks for it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from engine.base._threads import run_threads
from engine.errors import Cancelled, ChecksumError, DeviceError
from engine.format.checksums import (
    Checks,
    combine_rows,
    crc32c,
    join,
    mismatch,
    read_again,
    read_until_agreed,
)
from engine.gpu import device_ring
from engine.gpu.device_ring import DeviceOps
from engine.gpu.geometry import cores, geometry_for
from engine.io.reader import (
    FaultAhead,
    check_read,
    close_mapping,
    copy_mapping,
    default_threads,
    kept,
    populate_write,
    split_piece_bytes,
    split_reader,
)
from engine.planning.plan import Request

__all__ = [
    "DeviceOps",
    "Destination",
    "Source",
    "run",
    "run_sources",
    "Cancelled",
    "GPU_PATHS",
    "default_copy_threads",
]

#: Ways to feed a device, both the chunk ring (kept so that callers naming them keep working).
GPU_PATHS = ("auto", "copy")


@functools.cache
def default_copy_threads() -> int:
    """Native threads that split each batch of a host load: every core (at least 1)."""
    return cores()


class Destination:
    """Where each selected tensor's bytes go.

    Parameters
    ----------
    host_views : dict of key -> writable byte memoryview, optional
        For host destinations.
    device_targets : dict of key -> device byte buffer, optional
        For device destinations, with ``device_ops``.
    device_ops : DeviceOps, optional
    fresh : bool, default False
        The host views are newly allocated memory that no page has touched yet: before a
        remote file's bytes are received into a view, its pages are faulted in with one
        system call (:func:`engine.io.reader.populate_write`) rather than one fault per 4 KiB
        inside the receive.
    windows : callable, optional
        Device destinations through the ring: ``windows(requests)`` yields consecutive
        runs of one file's requests, each moved by a ring run of its own before the next is
        asked for (the targets of a run's tensors are looked up when it is planned); see
        :meth:`engine.loading.load_hooks.LoadWork.windows`.
    hooked : bool, default False
        The completion callback launches device kernels (the ring reports more often).

    Keys are the rows of the file (plus the file's ``row_base`` when several files run as
    one pipeline, see :class:`Source`).
    """

    def __init__(self, host_views=None, device_targets=None, device_ops: DeviceOps | None = None,
                 fresh: bool = False, windows: Callable[[Sequence[Request]], Iterable[Sequence[Request]]] | None = None,
                 hooked: bool = False) -> None:
        if (host_views is None) == (device_targets is None):
            raise ValueError("give exactly one of host_views and device_targets")
        if device_targets is not None and device_ops is None:
            raise ValueError("device destinations need device_ops")
        self.host_views = host_views
        self.device_targets = device_targets
        self.device_ops = device_ops
        self.fresh = fresh
        self.windows = windows
        self.hooked = hooked

    @property
    def on_device(self) -> bool:
        return self.device_targets is not None


class Source(NamedTuple):
    """One file of a load: an open descriptor, its name, its read plan, and the number added
    to each piece's row to key the destination (distinct per file of one pipeline).

    A remote file has no descriptor (``fd`` is -1) and ``ranges`` instead:
    ``ranges(offset, views)`` fills ``views`` back to back from the file at ``offset``
    (:meth:`engine.net.remote_reads.RangeReads.reader`).  Worker threads then call it once per
    request, each on its own connection.

    ``mapping``: a read-only mapping of the whole file that the caller holds beyond the load
    (an open ``safe_open`` handle's): a device load copies out of it and leaves it mapped,
    instead of mapping the file for itself.
    """

    fd: int
    path: str | None
    requests: Sequence[Request]
    row_base: int = 0
    ranges: Callable[[int, Sequence[memoryview]], None] | None = None
    mapping: object = None
    checks: Checks | None = None  # the file's recorded checksums, when the load verifies them


class _Tracker:
    """Outstanding bytes per tensor; reports each tensor once, when its last byte lands.

    Where a source carries checksums (``Source.checks``), each of its whole tensors is
    verified when its last byte lands, before it is reported: its CRC-32C is ``digests[key]``
    (segments joined in order by the copy: :meth:`add_ordered`) or the join of the segments
    recorded out of order (:meth:`add_segment`).  A mismatch raises
    :class:`~engine.errors.ChecksumError` and the tensor is never reported; where the bytes
    came over a network (``reread``, set for remote files), the tensor is first read
    again from the server into its destination (until its checksum comes or two reads agree:
    :func:`~engine.format.checksums.read_until_agreed`), and only a mismatch that stays raises
    (the error says whether two reads agreed: the file's own bytes are damaged)."""

    def __init__(self, sizes: dict[int, int], on_complete: Callable[[int], None] | None,
                 checked: dict[int, tuple[Checks, int]] | None = None) -> None:
        self.remaining = sizes
        self.on_complete = on_complete
        self.lock = threading.Lock()
        self.checked = checked or {}
        n = max(self.checked) + 1 if self.checked else 0
        self.digests = np.zeros(n, dtype=np.uint32)
        # each checked key's recorded digest, for one comparison per batch of keys
        self.want = np.zeros(n, dtype=np.uint32)
        for key, (c, row) in self.checked.items():
            self.want[key] = c.expected[row]
        self.segments: dict[int, list[tuple[int, int, int]]] = {}
        #: ``reread(key)``: the tensor read again into its destination, its new CRC-32C
        self.reread: Callable[[int], int] | None = None

    @classmethod
    def of(cls, sources: Sequence[Source], on_complete) -> _Tracker:
        remaining: dict[int, int] = {}
        for src in sources:
            base = src.row_base
            for req in src.requests:
                for p in req.pieces:
                    remaining[base + p.row] = remaining.get(base + p.row, 0) + p.nbytes
        checked: dict[int, tuple[Checks, int]] = {}
        for src in sources:
            c = src.checks
            if c is None:
                continue
            base = src.row_base
            for key in {base + p.row for req in src.requests for p in req.pieces}:
                row = key - base
                if remaining.get(key) == int(c.sizes[row]):  # whole tensors only (not a slice)
                    checked[key] = (c, row)
        return cls(remaining, on_complete, checked)

    def add_ordered(self, crcs, sizes, keys) -> None:
        """Join segments copied in each tensor's byte order (``crcs[i]`` of ``sizes[i]``
        bytes of tensor ``keys[i]``) onto the tensors' digests, natively."""
        combine_rows(crcs, sizes, keys, self.digests)

    def add_segment(self, key: int, offset: int, nbytes: int, crc: int) -> None:
        """A segment of tensor ``key`` landed out of order: ``nbytes`` at ``offset`` in it."""
        with self.lock:
            self.segments.setdefault(key, []).append((offset, nbytes, crc))

    def verified(self, done: list[int]) -> tuple[list[int], ChecksumError | None]:
        """The keys of ``done`` whose digests match (all of them where nothing is checked),
        and the error of the first that does not."""
        keys = [k for k in done if k in self.checked]
        if not keys:
            return done, None
        with self.lock:
            for k in keys:  # tensors that landed out of order: their segments joined now
                segs = self.segments.pop(k, None)
                if segs is not None:
                    self.digests[k] = join(segs)
        ks = np.asarray(keys, dtype=np.intp)
        bad = ks[self.digests[ks] != self.want[ks]].tolist()
        if not bad:
            return done, None
        again: dict[int, tuple[int, bool]] = {}
        if self.reread is not None:  # bytes that crossed a network: read again
            reread = self.reread
            for k in bad:
                again[k] = read_until_agreed(int(self.digests[k]), int(self.want[k]), functools.partial(reread, k))
            bad = [k for k in bad if again[k][0] != int(self.want[k])]
            if not bad:
                return done, None
        first = bad[0]
        c, row = self.checked[first]
        err = mismatch(c.path, c.names[row], int(self.want[first]), int(self.digests[first]))
        if first in again:
            err = read_again(err, *again[first])
        failed = set(bad)
        return [k for k in done if k not in failed], err

    def landed(self, parts) -> None:
        """``parts``: iterable of ``(key, nbytes)``."""
        done = []
        with self.lock:
            for key, nbytes in parts:
                left = self.remaining[key] - nbytes
                self.remaining[key] = left
                if left == 0:
                    done.append(key)
        failed: ChecksumError | None = None
        if self.checked and done:
            done, failed = self.verified(done)
        if self.on_complete is not None:
            for key in done:
                self.on_complete(key)
        if failed is not None:  # the tensors that passed are reported, the failed one never
            raise failed


def run(fd: int, requests: Sequence[Request], dest: Destination, *, path: str | None = None, **options) -> int:
    """Execute ``requests`` of one open file into ``dest``; returns bytes read.

    :func:`run_sources` with one :class:`Source`; ``options`` as it takes them.
    """
    return run_sources([Source(fd, path, requests)], dest, **options)


def run_sources(
    sources: Sequence[Source],
    dest: Destination,
    *,
    threads: int | None = None,
    slot_bytes: int | None = None,
    gpu_path: str = "auto",
    on_complete: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
    fill: Callable[[int, Request, list], None] | None = None,
) -> int:
    """Execute the read plans of one or more files into ``dest``; returns bytes read.

    Parameters
    ----------
    sources : sequence of Source
        Files and their plans; rows are keyed ``row_base + row`` in ``dest``.
    dest : Destination
    threads : int, optional
        Native threads that split each batch of a host load and copy threads of the ring
        (default every core, :func:`default_copy_threads`, and the ring's geometry); with
        ``fill``, the worker threads of a host load (default
        :func:`engine.io.reader.default_threads`); for remote files, the connections (one
        thread each, host or device).
    slot_bytes : int, optional
        Bytes per chunk of the ring (default :func:`engine.gpu.geometry.default_geometry`).
    gpu_path : {"auto", "copy"}, default "auto"
        Device destinations: both are the chunk ring.  ``"register"`` (page-locking the file's
        own mapping) was removed: it measured slower than the copy path on an H100 host
        (``scripts/gpu_check.py``, 2026-11-26).
    on_complete : callable, optional
        ``on_complete(key)`` once per tensor, when its last byte has landed.
    cancel : threading.Event, optional
        Set it to stop the load; :class:`Cancelled` is raised.
    fill : callable, optional
        Host destinations of local files: ``fill(fd, request, targets)`` replaces the plain
        read of each request: it must fill ``targets`` (one writable host memoryview per
        piece) or raise.  It runs on worker threads before the pieces are reported complete:
        the place for work that must see the bytes while they are in the CPU cache
        (statistics, see :class:`engine.loading.cpu_stats.StatsCollector`).  A device load
        takes none (the ring's copy threads are native): device kernels are launched from
        ``on_complete`` on whole landed tensors (``Destination(hooked=True)``) and the CPU
        fold reads the file at hand-out (:mod:`engine.loading.loader`).

    Returns
    -------
    int
        Bytes of tensor data moved.

    Raises
    ------
    ReadError
        Names the file, offset and size of the first failed read (after every thread has
        stopped and every issued copy has completed).
    Cancelled
        ``cancel`` was set.
    DeviceError
        A device operation failed, or the destination's device operations cannot drive the
        ring.
    ValueError
        A ``fill`` hook with a device destination or remote files.

    Notes
    -----
    Copies of tensor bytes: host destinations 1 (page cache or socket to tensor); device
    destinations 2 (page cache or socket to a page-locked chunk of the ring, then to the
    device by DMA).  No thread of
    the load outlives the call and every issued copy has completed when it returns.
    """
    if gpu_path == "register":
        raise ValueError("gpu_path='register' was removed: page-locking the file's own mapping measured slower "
                         "than the copy path on an H100 host and held the file's pages locked; use 'auto'")
    if gpu_path not in GPU_PATHS:
        raise ValueError(f"gpu_path must be one of {GPU_PATHS}, not {gpu_path!r}")
    if dest.on_device:
        if fill is not None:
            raise ValueError("a device load takes no fill hook: the ring's copy threads are native")
        if not device_ring.supports(dest.device_ops):
            path = sources[0].path if sources else None
            raise DeviceError(f"the device operations {type(dest.device_ops).__name__} cannot drive the chunk ring: "
                              "they lack runtime_path, device_index or address", path=path)
    cancel = cancel or threading.Event()
    tracker = _Tracker.of(sources, on_complete)
    total = sum(r.nbytes for s in sources for r in s.requests)
    if not total:
        return 0
    remote = [s for s in sources if s.ranges is not None]
    # a load served partly from local copies of remote files (remote_cache): the local files
    # first, on their own path, then the server's
    groups = [[s for s in sources if s.ranges is None], remote] if remote and len(remote) < len(sources) \
        else [sources]
    for group in groups:
        if cancel.is_set():
            break
        if dest.on_device:
            if any(s.ranges is not None for s in group):
                # remote files: ``threads`` is the connections, which fill the ring's chunks
                # themselves; the ring's own copy threads (its default geometry, so the ring
                # is the one local loads keep) stay asleep
                _run_ring(group, dest, tracker, cancel, geometry_for(slot_bytes),
                          connections=threads or default_threads())
            else:
                _run_ring(group, dest, tracker, cancel, geometry_for(slot_bytes, threads))
        else:
            _run_host(group, dest, tracker, cancel, threads, fill)
    if cancel.is_set():
        path = sources[0].path if sources else None
        raise Cancelled("the load was cancelled", reason="Cancelled", path=path)
    return total


def _run_ring(sources, dest, tracker, cancel, geometry, connections: int | None = None) -> None:
    """Device destinations through the chunk ring: one run, or one per window of
    ``dest.windows`` (a single file's requests), each finished before the next is planned."""
    if dest.windows is None or len(sources) != 1:
        device_ring.load(sources, dest, tracker, cancel, geometry, hooked=dest.hooked, connections=connections)
        return
    src = sources[0]
    for window in dest.windows(src.requests):
        if cancel.is_set():
            return
        device_ring.load([src._replace(requests=window)], dest, tracker, cancel, geometry, hooked=dest.hooked,
                         connections=connections)


# -- host destinations ---------------------------------------------------------------------------


#: bytes of requests per native split copy of a host load: large enough that what a batch
#: costs beyond its bytes (the Python call, and the threads that wait at its end for the
#: last piece) is paid once per GiB, small enough that tensors are reported complete (and a
#: cancel is seen) while the load goes on, after each GiB
HOST_BATCH_BYTES = 1 << 30


def _batches(requests: Sequence[Request], limit: int):
    batch: list[Request] = []
    size = 0
    for r in requests:
        batch.append(r)
        size += r.nbytes
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _run_host(sources, dest, tracker, cancel, threads, fill) -> None:
    """Host destinations: each batch of requests is one native call that deals its bytes in
    pieces to ``threads`` native threads (started once for the load, no more than the load
    has pieces), GIL released; with ``fill``, or for remote files, worker threads take whole
    requests instead."""
    if any(s.ranges is not None for s in sources):
        if fill is not None:  # a fill hook reads the file itself; a remote file has no descriptor
            raise ValueError("a load of remote files takes no fill hook")
        _run_host_fill(sources, dest, tracker, cancel, threads or default_threads(), None)
        return
    if fill is not None:
        _run_host_fill(sources, dest, tracker, cancel, threads or default_threads(), fill)
        return
    views = dest.host_views
    # no more threads than the load has pieces: an idle thread still costs its start and join
    total = sum(r.nbytes for s in sources for r in s.requests)
    # the destination (a caller's tensors, an owned block) is not read right away: its
    # stores go past the caches
    reader = split_reader(max(1, min(threads or default_copy_threads(), -(-total // split_piece_bytes()))),
                          stream=True)
    try:
        for src in sources:
            mapping = copy_mapping(src.fd)
            try:
                for batch in _batches(src.requests, HOST_BATCH_BYTES):
                    if cancel.is_set():
                        return
                    offsets: list[int] = []
                    targets: list[memoryview] = []
                    keys: list[int] = []
                    for req in batch:
                        for p in req.pieces:
                            if p.nbytes:
                                offsets.append(req.offset + p.request_offset)
                                targets.append(views[src.row_base + p.row][p.tensor_offset : p.tensor_offset + p.nbytes])
                                keys.append(src.row_base + p.row)
                    # a file with checksums: each target's CRC-32C taken as it is copied
                    crcs = np.zeros(len(targets), dtype=np.uint32) if src.checks is not None else None
                    check_read(reader.copy(src.fd, mapping, np.array(offsets, dtype=np.int64), targets, keep=kept(mapping),
                                           digests=crcs),
                               "the load", src.path, src.fd)
                    if crcs is not None:
                        tracker.add_ordered(crcs, np.array([t.nbytes for t in targets], dtype=np.int64),
                                            np.array(keys, dtype=np.int64))
                    tracker.landed((src.row_base + p.row, p.nbytes) for req in batch for p in req.pieces)
            finally:
                close_mapping(mapping)
    finally:
        reader.close()


class _Reread:
    """A checked tensor of a remote file read again from the server into its host
    destination (the pieces the load planned for it), its CRC-32C taken over the whole
    tensor: the tracker's ``reread`` after a mismatch.  Copies of tensor bytes: 1 (socket to
    the destination, again)."""

    def __init__(self, sources, views) -> None:
        self.views = views
        self.pieces: dict[int, tuple[Any, list]] = {}
        for src in sources:
            if src.ranges is None:
                continue
            for req in src.requests:
                for p in req.pieces:
                    if p.nbytes:
                        self.pieces.setdefault(src.row_base + p.row, (src, []))[1].append(
                            (req.offset + p.request_offset, p.nbytes, p.tensor_offset))

    def __call__(self, key: int) -> int:
        src, pieces = self.pieces[key]
        view = self.views[key]
        read = getattr(src.ranges, "fresh", src.ranges)  # from the server, not what a stream kept
        for offset, nbytes, at in pieces:
            read(offset, [view[at : at + nbytes]])
        return crc32c(view)


def _run_host_fill(sources, dest, tracker, cancel, threads, fill) -> None:
    work = [(s, req) for s in sources for req in s.requests]
    lock = threading.Lock()
    next_index = [0]

    def take():
        with lock:
            i = next_index[0]
            if i >= len(work) or cancel.is_set():
                return None
            next_index[0] = i + 1
        return work[i]

    def worker() -> None:
        views = dest.host_views
        while (item := take()) is not None:
            src, req = item
            base = src.row_base
            targets = [views[base + p.row][p.tensor_offset : p.tensor_offset + p.nbytes] for p in req.pieces]
            if src.ranges is not None:
                if dest.fresh:
                    for t in targets:
                        populate_write(t)
                src.ranges(req.offset, targets)
            else:
                fill(src.fd, req, targets)
            if src.checks is not None:
                # the request just landed (from a socket or a fill hook), its bytes still in
                # the cache: each piece's CRC now, joined per tensor when it is complete
                for p, t in zip(req.pieces, targets, strict=True):
                    if p.nbytes and base + p.row in tracker.checked:
                        tracker.add_segment(base + p.row, p.tensor_offset, p.nbytes, crc32c(t))
            tracker.landed((base + p.row, p.nbytes) for p in req.pieces)

    if any(s.ranges is not None and s.checks is not None for s in sources):
        tracker.reread = _Reread(sources, dest.host_views)
    ahead = None
    if dest.fresh and any(s.ranges is not None for s in sources):
        # fresh memory that sockets fill: other threads fault it in, in the order of the work,
        # so the receiving threads only receive
        views = dest.host_views
        ahead = FaultAhead(views[s.row_base + p.row][p.tensor_offset : p.tensor_offset + p.nbytes]
                           for s, req in work for p in req.pieces if p.nbytes)
    try:
        run_threads([worker] * max(1, min(threads, len(work))), on_error=cancel.set)
    finally:
        if ahead is not None:
            ahead.close()
