"""Opening files for reading without the ways an open can hang or mislead.

Private: shared by :mod:`engine.header`, :mod:`engine.file_handle` and :mod:`engine.checkpoint`
(and :data:`IOV_MAX` by the reader and the writer).
A FIFO named like a checkpoint would block ``open()`` until a writer appears, and reading a
character device never ends; so the file is opened with ``O_NONBLOCK`` (which regular
files ignore), checked with ``fstat`` and refused unless it is a regular file.  A symlink
loop becomes a :class:`~engine.errors.ReadError` (still an ``OSError`` with ``errno``
``ELOOP``) that names the path.
"""

from __future__ import annotations

import errno
import os
import stat

from .errors import ReadError

__all__ = ["open_regular", "file_size", "IOV_MAX"]

#: Most buffers one ``preadv`` or ``pwritev`` call takes (the reader's and the writer's batches).
IOV_MAX = 1024
try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX")) or IOV_MAX
except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
    pass

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


#: Below this many bytes a mapped load is left to the kernel's own read-ahead (no prefetch
#: threads, and no need for the reader's module at all).
PREFETCH_MIN_BYTES = 16 << 20


def is_url(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``, a scheme of two letters or more) rather
    than a local path (a Windows drive letter is not a scheme)."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def open_regular(path: str) -> int:
    """Open ``path`` read-only and return the descriptor; refuse anything but a regular file.

    Raises
    ------
    ReadError
        ``reason="NotRegularFile"`` for a FIFO, device or socket (``errno`` ``EINVAL``);
        ``reason="SymlinkLoop"`` for a loop of symbolic links (``errno`` ``ELOOP``).
    OSError
        As ``os.open`` raises it otherwise (``FileNotFoundError``, ``PermissionError``,
        ``IsADirectoryError`` when reading a directory).
    """
    try:
        fd = os.open(path, _FLAGS | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            err = ReadError(
                "too many levels of symbolic links (a symlink loop?)", reason="SymlinkLoop", path=path
            )
            err.errno, err.strerror = exc.errno, exc.strerror
            raise err from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            err = ReadError(
                f"the path is {what}, not a regular file; refusing to read it", reason="NotRegularFile", path=path
            )
            err.errno, err.strerror = errno.EINVAL, os.strerror(errno.EINVAL)
            raise err
        if _NONBLOCK:
            # back to blocking reads: O_NONBLOCK has no effect on a regular file on Linux, but
            # some file systems (FUSE, network) might honour it
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_size(fd: int) -> int | None:
    """The file's size now, for messages; ``None`` when ``fstat`` fails."""
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None
