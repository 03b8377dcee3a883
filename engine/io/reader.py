"""Positional reads of tensor bytes into caller-owned memory.

Two primitives under the threaded loads (:mod:`engine.loading.pipeline`): ``os.preadv``, which
releases the GIL and scatters file-contiguous bytes into several destination buffers in
one system call, and the native split copy (:func:`split_reader`), which spreads one large
set of segments evenly over native threads and takes the bytes either with ``pread`` or
out of a populated read-only mapping (:func:`copy_source`).  Either way a file truncated
underneath gives a :class:`~engine.errors.ReadError`, never a SIGBUS.
"""

from __future__ import annotations

import array
import functools
import os
import threading
from collections.abc import Sequence

from engine.base._files import IOV_MAX, PREFETCH_MIN_BYTES, file_size, on_network_mount
from engine.base._threads import map_threads, run_threads  # their public home is here
from engine.errors import ReadError
from engine.io.kept_mappings import KEPT_MAPPINGS, KeptMapping

__all__ = [
    "default_threads", "pread_into", "pread_runs", "pread_spans", "spans_bytes", "prefetch_mapping", "run_threads",
    "map_threads", "check_read", "FaultAhead", "fault_threads", "resident_pages", "populate_write", "start_writeback", "split_reader", "split_piece_bytes", "copy_source", "copy_mapping", "close_mapping", "kept",
    "COPY_SOURCES",
    "IOV_MAX",
]


#: where the native copies take a warm file's bytes from
COPY_SOURCES = ("auto", "pread", "mmap")


def copy_source() -> str:
    """Where native split copies take the bytes from: ``"auto"`` (the default), ``"pread"``
    or ``"mmap"``.

    ``"pread"``: each thread reads its share with ``pread``.  ``"mmap"``: each thread maps its
    share of a read-only mapping of the file (``MADV_POPULATE_READ``) and copies it out with
    ``memcpy``.  Both read the page cache once and write the destination once.  The mapping
    copies faster once it is mapped (no system call or page-cache lookup per chunk, and, for
    host destinations, stores that bypass the caches: the kernel's copy reads every
    destination line into the cache before writing it), but every load pays for building
    its page tables and tearing them down: little for a file the kernel cached in large folios (read ahead
    by large sequential reads, or written in large writes), one entry per 4 KiB page for a file
    cached page by page (read through small page faults).  Which one wins depends on how the
    page cache holds the file, so ``"auto"`` measures as it goes: every thread times what
    mapping its pieces' pages costs against copying them, maps while that is under a quarter,
    and ``pread``s past it, trying the mapping on part of a piece now and then
    (``engine.io._split.SplitReader``).
    ``ENGINE_COPY_SOURCE`` pins one (``scripts/bench_host.py --source all`` measures all three).
    A file truncated underneath is a ReadError either way (the populate reports pages the file
    no longer backs; a copy that faults anyway is caught; the rest is read with ``pread``,
    which names where the file ends).
    """
    value = os.environ.get("ENGINE_COPY_SOURCE", "auto").strip().lower()
    if value not in COPY_SOURCES:
        raise ValueError(f"ENGINE_COPY_SOURCE must be one of {COPY_SOURCES}, not {value!r}")
    return value


def copy_mapping(fd: int):
    """A read-only mapping of the whole file for the split copies (``mmap.mmap``), or None
    where they ``pread`` instead: :func:`copy_source` says ``"pread"``; it says ``"auto"`` and
    the file lies on a network or FUSE file system (:func:`engine.base._files.on_network_mount`:
    there a populate faults the file in through the mount a read-ahead window at a time,
    where a ``pread`` per piece asks for the whole piece); the file is empty; or it cannot be
    mapped.  With :func:`engine.keep_mappings` on, it is the file's kept mapping
    (:func:`kept`), where earlier loads left the pages they mapped.  Close it with
    :func:`close_mapping`."""
    source = copy_source()
    if source == "pread" or (source == "auto" and on_network_mount(fd)):
        return None
    m = KEPT_MAPPINGS.take(fd)
    if m is not None:
        return m
    import mmap

    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
    except (OSError, ValueError):
        return None


def close_mapping(m) -> None:
    """Unmap a :func:`copy_mapping` (None is fine), or give a kept one back; a view still
    alive somewhere leaves it to the garbage collector."""
    if isinstance(m, KeptMapping):
        KEPT_MAPPINGS.give(m)
    elif m is not None:
        try:
            m.close()
        except BufferError:
            pass


def kept(m) -> bool:
    """Whether ``m`` (from :func:`copy_mapping`) is a kept mapping: pass it to a split
    reader's ``copy(..., keep=kept(m))`` so that its pages stay mapped."""
    return isinstance(m, KeptMapping)


@functools.cache
def default_threads() -> int:
    """Reader threads when the caller does not say: one per core, between 2 and 8.

    Cached: ``os.cpu_count()`` reads a file under /sys on every call.
    """
    return max(2, min(8, os.cpu_count() or 2))


def pread_into(fd: int, offset: int, views: Sequence[memoryview], *, path: str | None = None) -> None:
    """Fill ``views`` with the bytes that follow each other in the file from ``offset``.

    Parameters
    ----------
    fd : int
        Open file descriptor.
    offset : int
        File offset of the first byte of ``views[0]``.
    views : sequence of writable byte memoryviews
        Destinations, contiguous in the file, at most ``IOV_MAX`` of them.
    path : str, optional
        File name for error messages.

    Raises
    ------
    ReadError
        On an I/O error, or when the file ends before every view is full.

    Notes
    -----
    Copies of tensor bytes: 1 (kernel page cache to the destination), none in user space.
    The GIL is released during each system call.
    """
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    done = 0
    while views:
        try:
            n = os.preadv(fd, views, offset + done)
        except OSError as exc:
            raise ReadError(
                f"reading {total} bytes at offset {offset} failed: {exc.strerror or exc}",
                reason="IoError",
                path=path,
                offset=offset + done,
                size=total - done,
            ) from exc
        if n == 0:
            raise ReadError(
                f"{_ended(fd, offset + done)} while reading {total} bytes at offset {offset}"
                " (truncated or replaced while reading?)",
                reason="ShortRead",
                path=path,
                offset=offset + done,
                size=total - done,
            )
        done += n
        # drop what was filled; continue inside a partially filled view
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def pread_runs(
    fd: int,
    dst: memoryview,
    src,
    run_bytes: int,
    base: int,
    *,
    path: str | None = None,
    threads: int = 1,
) -> None:
    """Read equal-sized runs at scattered file offsets into consecutive parts of ``dst``.

    Run ``i`` (``run_bytes`` bytes at file offset ``base + src[i]``) lands at
    ``dst[i * run_bytes:]``.  This is how a column block of a tensor is read: one run per
    row.  The loop is native code with the GIL released (``engine.io._spans``), so thousands of
    runs cost one Python call; with ``threads > 1`` the runs are shared among threads.

    Raises
    ------
    ReadError
        On an I/O error or the end of the file, naming the offset and the bytes missing.

    Notes
    -----
    Copies of tensor bytes: 1 (page cache to ``dst``).
    """
    import numpy as np

    from engine.io import _spans

    src = np.ascontiguousarray(src, dtype=np.int64)
    out = np.frombuffer(dst, dtype=np.uint8)
    n = src.size
    threads = max(1, min(threads, n))

    def part(lo: int, hi: int) -> None:
        check_read(_spans.pread_runs(fd, out[lo * run_bytes : hi * run_bytes], src[lo:hi], run_bytes, base),
                   f"a {run_bytes}-byte run", path, fd)

    bounds = [n * k // threads for k in range(threads + 1)]
    run_threads([lambda lo=lo, hi=hi: part(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=False)])


def _ended(fd: int, at: int) -> str:
    """How a short read is worded: the file's real size now, else where the read stopped."""
    size = file_size(fd)
    return f"the file holds {size} bytes" if size is not None else f"the file ended at offset {at}"


#: Bytes of a mapping brought in per call of :func:`prefetch_mapping`'s threads: large enough
#: that the kernel reads in long sequential runs, small enough to share a tensor among threads.
PREFETCH_PIECE = 32 << 20


def prefetch_mapping(buf, ranges, *, threads: int | None = None) -> int:
    """Read the parts of a file mapping that a load will hand out, on several threads.

    Parameters
    ----------
    buf : buffer
        The whole mapping (``mmap.mmap``, read-only or copy-on-write).
    ranges : iterable of (start, stop)
        Byte ranges of ``buf`` about to be used, in file order; touching ranges are merged.
    threads : int, optional
        Default :func:`default_threads`.

    Returns
    -------
    int
        Pieces (of ``PREFETCH_PIECE`` bytes) found not resident and read (0 for a warm file).

    Notes
    -----
    A mapped load faults its pages in one at a time, on whichever thread first touches
    them, with the kernel's read-ahead as the only reads in flight.  Here each thread takes
    ``PREFETCH_PIECE``-byte pieces in file order and, for a piece with pages missing from
    the page cache, asks the kernel to read and map them (``MADV_POPULATE_READ``); a
    resident piece costs a few ``mincore`` calls (16 sampled pages) on the calling thread,
    and a warm file starts no thread.  Large sequential pieces on every thread
    keep the device busy without racing the kernel's read-ahead over the same pages.
    Copies of tensor bytes: 0 (the pages are the page cache's).  The GIL is released in
    each call.  Advice only: an error leaves the pages to be faulted in as usual.
    """
    merged: list[list[int]] = []
    for lo, hi in ranges:
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if sum(hi - lo for lo, hi in merged) < PREFETCH_MIN_BYTES:
        return 0
    from engine.io import _pages  # here: a short-lived tool's small load needs no native reader

    pieces = [(p, min(p + PREFETCH_PIECE, hi)) for lo, hi in merged for p in range(lo, hi, PREFETCH_PIECE)]
    view = memoryview(buf).cast("B")
    try:
        # on the calling thread: a warm file starts no threads
        cold = [p for p in pieces if not _pages.mapping_resident(view, p[0], p[1])]
        if cold:
            lock = threading.Lock()
            todo = iter(cold)

            def work() -> None:
                while True:
                    with lock:
                        piece = next(todo, None)
                    if piece is None:
                        return
                    _pages.populate_mapping(view, piece[0], piece[1])

            run_threads([work] * max(1, min(threads or default_threads(), len(cold))), name="engine-prefetch")
    finally:
        view.release()
    return len(cold)


def populate_mapping(buf, start: int, stop: int) -> int:
    """Map ``buf[start:stop]`` of a file mapping in one call (``MADV_POPULATE_READ``),
    reading the pages the page cache lacks; the GIL is released.

    One call maps a range many times faster than touching it page by page, each touch a
    fault.  Returns ``errno`` or 0: advice only, an error leaves the pages to be faulted in
    as usual.
    """
    from engine.io import _pages

    return _pages.populate_mapping(buf, start, stop)


def check_read(result: tuple, what: str, path: str | None, fd: int) -> None:
    """Turn the ``(errno or -1, offset, missing)`` of a native read loop into a ReadError;
    ``what`` names the read (``"a 4096-byte run"``, ``"the load"``)."""
    err, at, missing = result
    if err == -1:
        raise ReadError(
            f"{_ended(fd, at)} with {missing} bytes of {what} at offset {at} still to read"
            " (truncated or replaced while reading?)",
            reason="ShortRead", path=path, offset=at, size=missing,
        )
    if err:
        raise ReadError(
            f"reading {missing} bytes of {what} at offset {at} failed: {os.strerror(err)}",
            reason="IoError", path=path, offset=at, size=missing,
        )


def populate_write(buf) -> int:
    """Fault in the whole pages of the writable buffer ``buf`` in one system call, GIL
    released (``MADV_POPULATE_WRITE``); its bytes are unchanged.  Returns ``errno`` or 0.
    For fresh memory that a copy the engine cannot split (a socket receive) is about to
    fill: the copy then runs without a page fault per 4 KiB."""
    from engine.io import _pages

    return _pages.populate_write(buf)


def start_writeback(fd: int, offset: int, nbytes: int) -> int:
    """Start writing ``nbytes`` of ``fd``'s dirty pages from ``offset`` to the disk and
    return at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, GIL released), so that a
    file written during a load (a ``cache_dir`` copy) is mostly on the disk by its
    ``fsync``.  Returns ``errno`` or 0: advice only."""
    from engine.io import _pages

    return _pages.start_writeback(fd, offset, nbytes)


#: Bytes of destination per step of :class:`FaultAhead` (the order its threads take them in).
FAULT_STEP_BYTES = 16 << 20


def fault_threads() -> int:
    """Threads that fault a fresh destination in ahead of a load's receives: a quarter of
    the cores, at most 4 (none below 4 cores, where they would take time from the receiving
    threads rather than use idle cores), or ``ENGINE_FAULT_AHEAD`` (0: none)."""
    env = os.environ.get("ENGINE_FAULT_AHEAD", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"ENGINE_FAULT_AHEAD={env!r}: expected a number of threads") from None
    return max(0, min(4, (os.cpu_count() or 2) // 4))


class FaultAhead:
    """Threads that fault in fresh destination memory in the order a load will fill it,
    so that the threads receiving the bytes (a socket's, which the engine cannot split)
    find the pages there: ``MADV_POPULATE_WRITE`` per run of views, no Python per step
    (:func:`engine.io._pages.populate_ranges`).  Whoever reaches a page first faults it in; the
    other finds it present, so the bytes never depend on who wins.

    Parameters
    ----------
    views : iterable of writable memoryview
        The destination, in the order the load fills it.
    threads : int, optional
        Default :func:`fault_threads`; 0 starts none.
    """

    def __init__(self, views, threads: int | None = None) -> None:
        from engine.io import _pages

        self._stop = array.array("i", [0])  # int32: read by the threads between runs
        self._threads: list[threading.Thread] = []
        want = fault_threads() if threads is None else threads
        if want <= 0:  # none (below 4 cores by default): not even a walk over the views
            self._steps: list[list[memoryview]] = []
            return
        steps: list[list[memoryview]] = [[]]
        size = 0
        for v in views:
            if size >= FAULT_STEP_BYTES:
                steps.append([])
                size = 0
            steps[-1].append(v)
            size += len(v)
        if not steps[-1]:
            steps.pop()
        self._steps = steps
        n = min(want, len(steps))
        self._threads = [
            threading.Thread(target=_pages.populate_ranges, args=(steps, i, n, self._stop),
                             name=f"engine-fault-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> int:
        return len(self._threads)

    def wait(self) -> None:
        """Join the threads once they have faulted everything in (no stop)."""
        for t in self._threads:
            t.join()

    def close(self) -> None:
        """Stop (between runs) and join the threads."""
        self._stop[0] = 1
        for t in self._threads:
            t.join()
        self._threads = []

    def __enter__(self) -> FaultAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resident_pages(buf) -> tuple[int, int]:
    """(resident pages, pages) of a range of a file mapping, by ``mincore``; GIL released."""
    from engine.io import _pages

    return _pages.resident_pages(buf)


def split_piece_bytes() -> int:
    """Bytes of the pieces a split copy deals to its threads, in order, each to the first
    free thread (8 MiB): a load of fewer pieces than threads needs no more threads than
    pieces."""
    from engine.io import _split

    return _split.PIECE_BYTES


def split_reader(threads: int, *, stream: bool = False):
    """A native reader whose ``copy(fd, mapping, file_offsets, targets)`` deals each call's
    bytes in pieces to ``threads`` pthreads started once (``engine.io._split.SplitReader``;
    ``mapping`` is None for ``pread`` or a read-only mapping of the file, see
    :func:`copy_source`; with ``"auto"`` each thread learns which of the two is faster over
    the reader's life); it returns ``(errno or -1, offset, missing)`` for
    :func:`check_read`.  ``stream``: copies out of the mapping store past the caches, for
    destinations not read soon (a caller's tensors; not a ring's chunk).  Close it when
    done."""
    from engine.io import _split

    return _split.SplitReader(threads, adaptive=copy_source() == "auto", stream=stream)


def pread_spans(fd: int, dst: memoryview, src, run_bytes: int, base: int, bounce, *,
                path: str | None = None) -> None:
    """:func:`pread_runs` for short runs: one read per dense span, runs gathered from it.

    Consecutive runs whose span (first run's start to last run's end) fits in ``bounce``
    (a writable byte buffer, reused by the caller) are read with one ``pread`` into it and
    copied out to ``dst``.  This reads the bytes between the runs as well; for a column
    block with short rows (a tensor-parallel shard of a row-parallel weight) that is a few
    times more bytes in hundreds of times fewer system calls.  :func:`spans_bytes` says
    how many bytes it reads.

    Raises
    ------
    ReadError
        On an I/O error or the end of the file, naming the offset and the bytes missing.

    Notes
    -----
    Copies of tensor bytes: 2 (page cache to ``bounce``, ``bounce`` to ``dst``); the
    bounce is small enough to stay in the CPU cache.  No GIL in the loop.
    """
    import numpy as np

    from engine.io import _spans

    src = np.ascontiguousarray(src, dtype=np.int64)
    check_read(_spans.pread_spans(fd, np.frombuffer(dst, dtype=np.uint8), src, run_bytes, base,
                                  np.frombuffer(bounce, dtype=np.uint8)), f"a {run_bytes}-byte run", path, fd)


def spans_bytes(src, run_bytes: int, bounce_bytes: int) -> int:
    """Bytes :func:`pread_spans` reads for runs ``src`` of ``run_bytes`` with that bounce size."""
    import numpy as np

    from engine.io import _spans

    return int(_spans.spans_bytes(np.ascontiguousarray(src, dtype=np.int64), run_bytes, bounce_bytes))
