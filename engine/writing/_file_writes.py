"""Bytes into a file at their offsets: positioned writes (``pwrite``, ``pwritev``) resumed after
partial writes, a write of nothing taken as a full disk, and the background ``fdatasync`` that
overlaps a large file's flush with its writes.  The writer (:mod:`engine.writing.writer`)
decides what goes where; this is how it gets there.
"""

from __future__ import annotations

import errno
import os
import threading

from engine.base._files import IOV_MAX

__all__ = ["WRITEV_MAX", "BackgroundSync", "write_all", "write_at", "writev_all", "writev_at"]


if hasattr(os, "pwrite"):

    def write_at(fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

else:  # pragma: no cover - Windows

    def write_at(fd: int, data: memoryview, offset: int) -> int:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.write(fd, data)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = write_at(fd, data, offset)
        if written <= 0:  # a full disk can show as a zero-length write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        data = data[written:]
        offset += written


#: buffers per ``pwritev``: one where there is none (Windows, macOS before 11)
WRITEV_MAX = IOV_MAX if hasattr(os, "pwritev") else 1


def writev_at(fd: int, views: list[memoryview], offset: int) -> int:
    return os.pwritev(fd, views, offset)


def writev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` of ``views`` (back to back in the file from ``offset``), partial writes resumed."""
    views = list(views)
    while views:
        written = writev_at(fd, views, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


class BackgroundSync:
    """Runs ``fdatasync`` on a thread while the writer goes on filling the page cache.

    Writing and flushing then overlap: a save costs about the longer of the two instead of
    their sum.  ``os.fdatasync`` releases the GIL.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.wake = threading.Event()
        self.pending = False
        self.closing = False
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, name="engine-fsync", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            # a flush asked for before close() still runs: what was kicked is flushed
            if self.pending:
                self.pending = False
                try:
                    os.fdatasync(self.fd)
                except OSError as exc:  # reported by close(), which commit() calls
                    self.error = exc
                    return
            if self.closing:
                return

    def kick(self) -> None:
        self.pending = True
        self.wake.set()

    def close(self) -> OSError | None:
        self.closing = True
        self.wake.set()
        self.thread.join()
        return self.error
