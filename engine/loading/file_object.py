"""``engine._safe_open_handle``: the reference's handle over a file object the caller opened
(a real file through a duplicate of its descriptor, anything else read into anonymous memory).

Apart from :mod:`engine.loading.file_handle`, whose handle it is, so that a first open by path
loads none of it.
"""

from __future__ import annotations

import io
import os
from typing import Any

from engine.format.header import MAX_HEADER_SIZE
from engine.loading.file_handle import safe_open

__all__ = ["_safe_open_handle"]


class _safe_open_handle(safe_open):  # noqa: N801 - the reference's spelling
    """:class:`safe_open` over an open file object instead of a path (the reference's API).

    Parameters
    ----------
    f : file object
        A file opened by the caller: a real file (anything with a working ``fileno()``) is
        read through a duplicate of its descriptor; any other readable object (an fsspec
        file, ``io.BytesIO``) is read once, from its start, into anonymous memory.
    framework, device, backend, max_header_size
        As for :class:`safe_open`.

    Notes
    -----
    The caller's file object is neither moved nor closed when it has a descriptor.  Copies
    of tensor bytes: as :class:`safe_open` for real files; two more for other objects (their
    bytes read into memory, then written to an anonymous in-memory file), with a peak of
    twice the file's size.
    """

    def __init__(
        self,
        f,
        framework: str,  # required, as by the reference
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        max_header_size: int = MAX_HEADER_SIZE,
    ) -> None:
        name = getattr(f, "name", None)
        path = os.fspath(name) if isinstance(name, (str, os.PathLike)) else repr(f)
        self._setup(path, _handle_fd(f), framework, device, backend, max_header_size)


def _handle_fd(f) -> int:
    """A descriptor of our own for the file object ``f`` (see :class:`_safe_open_handle`)."""
    try:
        return os.dup(f.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    try:
        f.seek(0)
    except (AttributeError, OSError, ValueError):
        pass
    data = f.read()
    if isinstance(data, str):
        from engine.errors import SafetensorError

        raise SafetensorError("the file object was opened in text mode and has no descriptor; open it with 'rb'",
                              reason="InvalidFile")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("safetensors", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - not Linux
        import tempfile  # here, not at the top: a first open would pay for its import

        tmp = tempfile.TemporaryFile()
        fd = os.dup(tmp.fileno())
        tmp.close()
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        raise
    return fd
