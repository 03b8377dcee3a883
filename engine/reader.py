"""Positional reads of tensor bytes into caller-owned memory.

Reads go through ``os.preadv``, which releases the GIL: neighbouring destinations that are
contiguous in the file are filled by one system call (scatter into several buffers), large
ones are split into chunks that a small thread pool reads in parallel.  Nothing here maps
the file, so a file truncated underneath gives a :class:`~engine.errors.ReadError`, never
a SIGBUS.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

from .errors import ReadError

__all__ = ["DEFAULT_CHUNK_BYTES", "default_threads", "pread_into", "read_requests"]

#: Bytes per read request; large enough to amortise the system call, small enough to
#: spread one big tensor over several threads.
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
_IOV_MAX = 1024
try:
    _IOV_MAX = int(os.sysconf("SC_IOV_MAX")) or _IOV_MAX
except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
    pass
# below this, a thread pool costs more than it saves
_PARALLEL_MIN_BYTES = 32 * 1024 * 1024


def default_threads() -> int:
    """Reader threads when the caller does not say: one per core, between 2 and 8."""
    return max(2, min(8, os.cpu_count() or 2))


def pread_into(fd: int, offset: int, views: Sequence[memoryview], *, path: Optional[str] = None) -> None:
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
                f"file ended after {offset + done} bytes while reading {total} bytes at offset {offset}"
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


def _groups(requests: Iterable[tuple[int, memoryview]], chunk_bytes: int):
    """Coalesce file-contiguous requests into groups of at most ``chunk_bytes`` bytes."""
    group: list[memoryview] = []
    start = end = size = 0
    for offset, view in requests:
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        pos = 0
        while pos < view.nbytes:
            if group and (offset + pos != end or size >= chunk_bytes or len(group) >= _IOV_MAX):
                yield start, group, size
                group, size = [], 0
            if not group:
                start = offset + pos
            piece = view[pos : pos + chunk_bytes - size]
            group.append(piece)
            size += piece.nbytes
            pos += piece.nbytes
            end = offset + pos
    if group:
        yield start, group, size


def read_requests(
    fd: int,
    requests: Iterable[tuple[int, memoryview]],
    *,
    path: Optional[str] = None,
    threads: Optional[int] = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Fill every ``(file_offset, destination)`` request; returns the bytes read.

    Requests should come in file order so that neighbours coalesce into one ``preadv``.
    Groups run on ``threads`` threads when there is enough to read to pay for them.

    Notes
    -----
    Copies of tensor bytes: 1 (page cache to destination).  Extra memory: none; the
    destinations are the caller's.
    """
    groups = list(_groups(requests, chunk_bytes))
    total = sum(g[2] for g in groups)
    threads = default_threads() if threads is None else max(1, int(threads))
    if threads == 1 or len(groups) == 1 or total < _PARALLEL_MIN_BYTES:
        for start, views, _ in groups:
            pread_into(fd, start, views, path=path)
        return total
    with ThreadPoolExecutor(max_workers=min(threads, len(groups)), thread_name_prefix="engine-read") as pool:
        futures = [pool.submit(pread_into, fd, start, views, path=path) for start, views, _ in groups]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return total
