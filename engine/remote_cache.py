"""Local copies of remote files, written in the same pass as a load: ``cache_dir=``.

``engine.torch.load_file(url, cache_dir=d)`` (and ``engine.stream``, ``engine.load_into``,
``engine.safe_open``) keeps a copy of every file of the URL it receives in full, and a
later load of the same URL reads the copies instead of the server, as long as the server
still has the same version of each file.

* **The version** of a file is its ETag and its size, as the header's requests see them;
  so every load still asks the server for the headers (two small ranged GETs per file) and
  a file that changed on the server is never served from the copy.  A server that sends no
  ETag, or only a weak one (``W/"..."``, which does not promise the same bytes), gets no
  copy: nothing could tell its versions apart.
* **Layout**: ``<d>/<url key>/<version key>/<file name>``: the url key is the first 32 hex
  digits of the SHA-256 of the file's URL (without any ``user:password@``), the version key
  16 of the ETag's and the size.  So the same file under two URLs is two copies, a new
  version lands beside the old one (which is then removed), and nothing the server sends
  becomes a path but the file name, taken from the URL and stripped to a plain name.
* **Written as it lands**: the header bytes come from the header's requests, and each
  request's body is written with ``pwritev`` from where it was received (the tensor, or a
  device load's pinned slot) right after it lands: no second request and no second copy in
  memory, one write into the page cache, whose write-back to the disk is started at once
  (``sync_file_range``) so that it overlaps the rest of the load.  A file is complete when every byte of its data
  region landed (a selection of some tensors writes no copy of a file whose other tensors it
  skipped).
* **Atomic and durable**: a copy is an unnamed file (``O_TMPFILE``, see
  :mod:`engine._atomic`) until the load has succeeded; it is then ``fsync``-ed, linked under
  its name, and the directory synced.  A load that fails, is stopped early, or is killed
  leaves no file behind; a file under a version's name is complete and on disk.
* **A copy that cannot be written** (a full disk, an I/O error) is dropped with a
  :class:`~engine.errors.CacheWriteWarning`; the load goes on (the copy is a saving, the
  tensors are the job).  A directory that cannot be created or written at all is a
  :class:`~engine.errors.WriteError` before any request.
* **Concurrent loads** of the same URL into the same directory each write their own copy and
  link it in place; complete copies of one version are the same bytes, whichever lands last.

Copies of tensor bytes: a first load, one more than the plain load (the write into the page
cache); a load served from copies, those of a local load (:mod:`engine.loader`).
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Sequence

from . import _io
from ._atomic import AtomicFile, sync_dir, umask
from .errors import CacheWriteWarning, WriteError
from .header import Header
from .remote_reads import public_url

__all__ = ["version_path", "Copies"]

_NAME = re.compile(r"[^A-Za-z0-9._-]")


def _file_name(url: str) -> str:
    """The file's name from its URL, as a plain name (no separators, no leading dot)."""
    base = posixpath.basename(urllib.parse.unquote(urllib.parse.urlsplit(url).path)) or "file"
    base = _NAME.sub("_", base).lstrip(".") or "file"
    return base[:200]


def version_path(cache_dir: str, url: str, etag: str | None, size: int) -> str | None:
    """Where the copy of ``url`` at version (``etag``, ``size``) lives under ``cache_dir``;
    ``None`` when the version cannot be told (no ETag, or a weak one)."""
    if not etag or etag.startswith("W/"):
        return None
    shown = public_url(url)
    url_key = hashlib.sha256(shown.encode()).hexdigest()[:32]
    version = hashlib.sha256(f"{etag}\0{size}".encode()).hexdigest()[:16]
    return os.path.join(os.fspath(cache_dir), url_key, f"{version}-{size}", _file_name(shown))


class _Copy:
    """One file being copied: its unnamed file, the header written, the data bytes landed."""

    def __init__(self, dest: str, raw_header: bytes, header: Header) -> None:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        self.dest = dest
        self.want = header.data_size
        self.data_start = header.data_start
        self.size = header.file_size
        self.file = AtomicFile(dest, 0o644 & ~umask())
        self.landed = 0
        self.failed = False
        self.lock = threading.Lock()
        fd = self.file.fd
        assert fd is not None
        os.ftruncate(fd, self.size)  # a file of its final size: data past the header lands in place
        os.pwrite(fd, raw_header, 0)

    def write(self, offset: int, views: Sequence[memoryview]) -> None:
        fd = self.file.fd
        assert fd is not None
        total = sum(len(v) for v in views)
        done = 0
        while done < total:  # pwritev may write fewer bytes than asked (a signal, a quota)
            n = os.pwritev(fd, _tail(views, done), offset + done)
            if n <= 0:
                raise OSError("pwritev wrote nothing")
            done += n
        _io.start_writeback(fd, offset, total)  # the disk writes it while the load goes on
        with self.lock:
            self.landed += total

    def complete(self) -> bool:
        return self.landed == self.want and not self.failed


class Copies:
    """The local copies of one load's files (see the module doc).

    :meth:`open` decides per file: a complete copy of the version the server has is opened
    and its descriptor returned (the load reads it as a local file); else, where the file
    can be copied, a writer is set up and :meth:`wrap` wraps the file's ranged reads so that
    each body is also written.  :meth:`commit` after the load has succeeded names the
    complete copies; :meth:`close` discards the rest and closes the descriptors.
    """

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.cache_dir = os.fspath(cache_dir)
        self._copies: list[_Copy] = []
        self._fds: list[int] = []
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
        except OSError as exc:
            raise WriteError(f"cannot create the cache directory: {exc.strerror}", path=self.cache_dir,
                             reason="CacheDirectory") from None
        if not os.access(self.cache_dir, os.W_OK | os.X_OK):
            raise WriteError("the cache directory is not writable", path=self.cache_dir, reason="CacheDirectory")

    @property
    def served(self) -> int:
        """Files of this load read from their copies."""
        return len(self._fds)

    def open(self, url: str, etag: str | None, header: Header) -> tuple[int, str] | None:
        """``(descriptor, path)`` of a complete copy of this version of ``url``, or None."""
        path = version_path(self.cache_dir, url, etag, header.file_size)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        if os.fstat(fd).st_size != header.file_size:  # not one of ours: never read it
            os.close(fd)
            return None
        self._fds.append(fd)
        return fd, path

    def wrap(self, url: str, etag: str | None, header: Header, raw_header: bytes | None,
             ranges: Callable[[int, Sequence[memoryview]], None]) -> Callable[[int, Sequence[memoryview]], None]:
        """``ranges`` that also writes each body it received into the copy of ``url``
        (``ranges`` itself where no copy can be made)."""
        path = version_path(self.cache_dir, url, etag, header.file_size)
        if path is None or raw_header is None or len(raw_header) != header.data_start:
            return ranges
        try:
            copy = _Copy(path, raw_header, header)
        except OSError as exc:
            raise WriteError(f"cannot write a copy into the cache: {exc.strerror or exc}", path=path,
                             reason="CacheWrite") from None
        self._copies.append(copy)

        def read(offset: int, views: Sequence[memoryview]) -> None:
            ranges(offset, views)
            if copy.failed:
                return
            try:
                copy.write(offset, views)
            except OSError as exc:  # the copy is lost, the load is not: the tensors are whole
                with copy.lock:
                    first, copy.failed = not copy.failed, True
                if first:
                    warnings.warn(CacheWriteWarning(
                        f"{copy.dest}: no local copy of {public_url(url)}: {exc.strerror or exc}"), stacklevel=2)

        return read

    def commit(self) -> list[str]:
        """Make every complete copy durable and give it its name; returns their paths.
        Older versions of the same files are removed."""
        named = []
        for copy in self._copies:
            if not copy.complete():
                continue
            fd = copy.file.fd
            assert fd is not None
            try:
                os.fsync(fd)
                copy.file.commit()
                sync_dir(os.path.dirname(copy.dest))
                sync_dir(os.path.dirname(os.path.dirname(copy.dest)))
            except OSError as exc:
                raise WriteError(f"cannot name the copy: {exc.strerror or exc}", path=copy.dest,
                                 reason="CacheWrite") from None
            named.append(copy.dest)
            _remove_other_versions(copy.dest)
        self._copies = [c for c in self._copies if c.file.fd is not None]
        return named

    def close(self) -> None:
        """Discard copies not committed and close the copies read."""
        for copy in self._copies:
            copy.file.discard()
        self._copies = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _remove_other_versions(dest: str) -> None:
    version_dir = os.path.dirname(dest)
    url_dir = os.path.dirname(version_dir)
    keep = os.path.basename(version_dir)
    for entry in os.listdir(url_dir):
        if entry == keep:
            continue
        old = os.path.join(url_dir, entry)
        try:
            for name in os.listdir(old):
                if not name.startswith("."):  # a hidden name is a live writer's temporary
                    os.unlink(os.path.join(old, name))
            os.rmdir(old)
        except OSError:  # another process's copy being written there, or gone: leave it
            pass


def _tail(views: Sequence[memoryview], n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out
