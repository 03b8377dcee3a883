"""Local copies of remote files, written in the same pass as a load: ``cache_dir=``.

``engine.torch.load_file(url, cache_dir=d)`` (and ``engine.numpy.load_file``,
``engine.stream``, ``engine.load_into``) keeps a copy in ``d`` of every file of the URL it
receives in full, and a later load of the same URL reads the copies instead of the
server's bytes, as long as the server still has the same version of each file.
``engine.safe_open(url, cache_dir=d)`` first downloads every file that has no current copy
into ``d``, then reads the copies.

* **The version** of a file is what the header's requests (two small ranged GETs per file,
  made by every load, cached or not) see: a strong ``ETag`` and the size; where the server
  sends no strong ETag, its ``Last-Modified`` and the size (and the weak ETag, if any).  A
  file whose version changed is never read from its copy: it is loaded from the server and
  its new copy replaces the old one.  A server that sends neither a strong ETag nor
  ``Last-Modified`` gets no copy (nothing could tell its versions apart), nor does a protocol
  read through fsspec (no raw header bytes); each such file is a
  :class:`~engine.errors.CacheWriteWarning`.  ``Last-Modified``
  has a resolution of one second, as nginx's ETags (made of the file's mtime and size) do:
  a file rewritten under the same size within the same second is, for both, the same
  version.  So a copy told apart by ``Last-Modified`` alone (no strong ETag) records when
  the server answered its header (its ``Date``), and is read only when that is later than
  the ``Last-Modified``: a copy made within the second its file last changed may miss a
  later change in that second, so the next load reads the server's bytes again (and makes
  a copy it can trust).  The copy's own header bytes must also equal those the server just
  sent.
* **Layout**: flat, one pair of files per version of a file::

      <d>/<url key>-<version key>-<name>        the file, byte for byte as served
      <d>/<url key>-<version key>-<name>.json   {"url", "size", "etag", "last_modified", "fetched"}

  The url key is the first 32 hex digits of the SHA-256 of the file's URL without any
  ``user:password@`` (:func:`~engine.net.remote_file.public_url`); the version key 16 of the
  version's.  ``<name>`` is the URL's last path segment reduced to ``[A-Za-z0-9._-]`` with
  no leading dot: nothing the server or the URL holds can reach outside ``d``.  The JSON
  sidecar, named only once its file is on the disk, records the URL without its query (a
  presigned URL's query is a credential; such URLs, re-signed, are new keys each time) and
  must match for the copy to be read.  Request headers (``Authorization``) are never stored.
* **Written as it lands** (loads): the header bytes come from the header's requests, and
  each request's body is written with ``pwritev`` from where it was received (the tensor,
  or a device load's page-locked chunk of the ring) right after it lands: no second request, no second copy
  in memory, one write into the page cache, whose write-back to the disk starts at once
  (``sync_file_range``) so that it overlaps the rest of the load.  A file is copied only when
  every byte of its data region landed in this load (its bytes are counted and the union of
  the ranges received must be the whole region): a selection (``names=``, ``patterns=``,
  ...) that skips any tensor of a file writes no copy of that file.
* **safe_open** downloads each file whose copy is missing or stale with the same ranged
  reads, ``connections`` at a time across all files, each body received straight into a
  shared writable mapping of the new file (one copy: socket to page cache; space reserved
  first with ``posix_fallocate``, so that a full disk is an error, never a ``SIGBUS``), or,
  where the file cannot be mapped, into a buffer of ``chunk_bytes`` then ``pwrite`` (two).
* **Atomic and durable**: a copy is an unnamed file (``O_TMPFILE`` in ``d``, see
  :mod:`engine.base._atomic`) until the load has succeeded; it is then ``fsync``-ed, linked under
  its name and ``d`` synced, then its sidecar likewise.  A load that fails, is stopped
  early or is killed leaves nothing in ``d`` (where the file system has no ``O_TMPFILE``, a
  killed writer leaves a hidden ``.<name>.<pid>.<random>.tmp``, removed by the next write of
  that file).  A name in ``d`` is a complete file, on the disk.
* **Concurrent loads** of the same URL into the same directory each write their own copy
  and link it into place (an existing name is replaced by a rename); complete copies of one
  version are the same bytes, whichever lands last.
* **Errors**: a cache directory that cannot be created, or that is not writable while some
  file has to be copied, is a :class:`~engine.errors.WriteError` before any tensor byte is
  requested (a misconfigured cache would otherwise re-download the model on every start,
  silently); a read-only directory whose copies are all current is simply read.  A copy
  that fails while it is written (a full disk, an I/O error) is dropped with a
  :class:`~engine.errors.CacheWriteWarning` and the load goes on: the tensors are the job.

Copies of tensor bytes: a first load, one more than the plain load (the write into the page
cache); a load served from copies, those of a local owned load (:mod:`engine.loading.loader`:
``pread`` into the tensors); ``safe_open``'s download one (two where the file cannot be
mapped), then one per ``get_tensor`` (``pread``).
"""

from __future__ import annotations

import email.utils
import errno
import functools
import hashlib
import json
import mmap
import os
import re
import stat
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.base._atomic import AtomicFile, remove_stale, sync_dir, umask
from engine.base._threads import run_threads
from engine.errors import CacheWriteWarning, WriteError
from engine.format.header import Header
from engine.io.reader import start_writeback
from engine.net.remote_file import public_url
from engine.net.views import skip_views

__all__ = ["identity", "entry_path", "Copies"]

Ranges = Callable[[int, Sequence[memoryview]], None]

_NAME = re.compile(r"[^A-Za-z0-9._-]")
_SIDECAR = ".json"
_SIDECAR_LIMIT = 1 << 16


def identity(etag: str | None, last_modified: str | None, size: int) -> dict[str, Any] | None:
    """What tells this version of a file apart from others (see the module doc), or None
    when the server sent nothing that does."""
    if etag and not etag.startswith("W/"):
        return {"etag": etag, "size": size}
    if last_modified:
        return {"last_modified": last_modified, "etag": etag, "size": size}
    return None


def trusted(ident: dict[str, Any], fetched: str | None) -> bool:
    """Whether a copy of version ``ident`` made when the server's clock said ``fetched`` can
    be read: always for a strong ETag; for ``Last-Modified`` (one-second resolution), only
    when the header's answer came in a later second than the one it names (a change later
    in that same second would keep the same ``Last-Modified``)."""
    if "last_modified" not in ident:
        return True
    try:
        made = email.utils.parsedate_to_datetime(fetched or "")
        changed = email.utils.parsedate_to_datetime(ident["last_modified"])
        return made > changed
    except (TypeError, ValueError):  # a copy from before this check, or a date no one can read
        return False


def _stored_url(url: str) -> str:
    """The URL as the sidecar records it: no ``user:password@``, no query, no fragment."""
    parts = urllib.parse.urlsplit(public_url(url))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _file_name(url: str) -> str:
    """The last path segment of ``url`` as a plain name (no separator, no leading dot)."""
    segment = urllib.parse.unquote(urllib.parse.urlsplit(url).path).rstrip("/").rpartition("/")[2]
    return (_NAME.sub("_", segment).lstrip(".") or "file")[:190]


def _url_key(url: str) -> str:
    return hashlib.sha256(public_url(url).encode()).hexdigest()[:32]


def entry_path(cache_dir: str | os.PathLike, url: str, etag: str | None, last_modified: str | None,
               size: int) -> str | None:
    """Where the copy of ``url`` at this version lives in ``cache_dir`` (its sidecar: the
    same path plus ``.json``); None when the version cannot be told (no copy is made)."""
    ident = identity(etag, last_modified, size)
    if ident is None:
        return None
    version = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(os.fspath(cache_dir), f"{_url_key(url)}-{version}-{_file_name(public_url(url))}")


def _pwrite_all(fd: int, views: Sequence[memoryview], offset: int) -> None:
    total = sum(len(v) for v in views)
    done = 0
    while done < total:  # pwritev may write fewer bytes than asked (a signal, a quota)
        n = os.pwritev(fd, skip_views(views, done), offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


class _Copy:
    """One file being copied: its unnamed file (header written, full size) and the data
    ranges landed so far."""

    def __init__(self, dest: str, url: str, ident: dict[str, Any], raw_header: bytes, header: Header,
                 date: str | None = None) -> None:
        self.dest = dest
        self.url = url
        self.ident = ident
        self.date = date  # the Date of the header's answer (see trusted())
        self.data_start = header.data_start
        self.size = header.file_size
        self.spans: list[tuple[int, int]] = []
        self.landed = 0
        self.failed = False
        self.lock = threading.Lock()
        self.file = AtomicFile(dest, 0o644 & ~umask())
        try:
            fd = self.fd
            os.ftruncate(fd, self.size)  # the final size: each body lands at its own offset
            _pwrite_all(fd, [memoryview(raw_header)], 0)
        except BaseException:
            self.file.discard()
            raise

    @property
    def fd(self) -> int:
        fd = self.file.fd
        assert fd is not None
        return fd

    def landed_at(self, offset: int, nbytes: int) -> None:
        """``nbytes`` from ``offset`` are in the file: start their write-back, count them."""
        start_writeback(self.fd, offset, nbytes)  # the disk writes them while the load goes on
        with self.lock:
            self.spans.append((offset, nbytes))
            self.landed += nbytes

    def write(self, offset: int, views: Sequence[memoryview], again: bool = False) -> None:
        """Write bytes that landed at ``offset``; ``again``: bytes read again after a failed
        checksum, over the damaged ones already counted (written, not counted twice)."""
        _pwrite_all(self.fd, views, offset)
        if again:
            start_writeback(self.fd, offset, sum(len(v) for v in views))
        else:
            self.landed_at(offset, sum(len(v) for v in views))

    def drop(self, exc: OSError) -> None:
        """The copy cannot be written: warn once, write no more of it."""
        with self.lock:
            first, self.failed = not self.failed, True
        if first:
            warnings.warn(CacheWriteWarning(
                f"{self.dest}: no local copy of {public_url(self.url)}: {exc.strerror or exc}"), stacklevel=3)

    def complete(self) -> bool:
        """Every byte of the data region landed, once: the byte count is the region's size
        and the ranges received cover it without a gap."""
        with self.lock:
            if self.failed or self.landed != self.size - self.data_start:
                return False
            spans = sorted(self.spans)
        end = self.data_start
        for offset, n in spans:
            if offset > end:
                return False
            end = max(end, offset + n)
        return end == self.size

    def sidecar(self) -> bytes:
        return json.dumps({"url": _stored_url(self.url), **self.ident, "fetched": self.date}, sort_keys=True,
                          indent=1).encode()


class Copies:
    """The local copies of one load's files (see the module doc).

    :meth:`open` decides per file: a complete copy of the version the server has is opened
    and its descriptor returned (the load reads it as a local file).  Otherwise :meth:`wrap`
    wraps the file's ranged reads so that each body is also written into a new copy, or
    :meth:`fetch` downloads whole files into new copies.  :meth:`commit` after the load has
    succeeded names the complete copies; :meth:`close` discards the rest and closes the
    descriptors.

    Parameters
    ----------
    cache_dir : str or path
        Created if missing.

    Raises
    ------
    WriteError
        The directory cannot be created (``reason`` ``"CacheDirectory"``).
    """

    def __init__(self, cache_dir: str | os.PathLike) -> None:
        self.cache_dir = os.fspath(cache_dir)
        self._copies: list[_Copy] = []
        self._fds: list[int] = []
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
        except OSError as exc:
            raise WriteError(f"cannot create the cache directory: {exc.strerror or exc}", path=self.cache_dir,
                             reason="CacheDirectory") from None
        self.writable = os.access(self.cache_dir, os.W_OK | os.X_OK)

    def open(self, url: str, etag: str | None, last_modified: str | None, header: Header,
             raw_header: bytes | None, *, date: str | None = None, fresh: bool = False) -> tuple[int, str] | None:
        """``(descriptor, path)`` of a complete copy of this version of ``url``, or None.

        The copy must have the file's size, a sidecar naming this URL and version, and, where
        the header's bytes are known, the same first ``8 + N`` bytes; one told apart by
        ``Last-Modified`` alone must have been made after the second it names (see the module
        doc; ``fresh``: the copy this load has just downloaded, read whatever it says).
        ``date``: the ``Date`` of this load's header answer, recorded in a new copy.
        """
        path = entry_path(self.cache_dir, url, etag, last_modified, header.file_size)
        if path is None:
            return None
        fd = _open_entry(path)
        if fd < 0:
            return None
        try:
            st = os.fstat(fd)
            ok = stat.S_ISREG(st.st_mode) and st.st_size == header.file_size and self._sidecar_matches(
                path, url, etag, last_modified, header.file_size, fresh)
            if ok and raw_header is not None:
                ok = os.pread(fd, len(raw_header), 0) == raw_header
        except OSError:
            ok = False
        if not ok:  # not a copy this load can trust: the server's bytes are read instead
            os.close(fd)
            return None
        self._fds.append(fd)
        return fd, path

    @staticmethod
    def _sidecar_matches(path: str, url: str, etag: str | None, last_modified: str | None, size: int,
                         fresh: bool = False) -> bool:
        fd = _open_entry(path + _SIDECAR)
        if fd < 0:
            return False
        try:
            stored = json.loads(os.read(fd, _SIDECAR_LIMIT))
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        ident = identity(etag, last_modified, size)
        return isinstance(stored, dict) and stored.get("url") == _stored_url(url) and ident is not None and all(
            stored.get(k) == v for k, v in ident.items()) and (fresh or trusted(ident, stored.get("fetched")))

    def _start(self, url: str, etag: str | None, last_modified: str | None, header: Header,
               raw_header: bytes | None, date: str | None = None) -> _Copy | None:
        """A new copy of ``url``; None, with a warning, where the version cannot be told, the
        header's bytes are unknown, or the disk refuses it."""
        path = entry_path(self.cache_dir, url, etag, last_modified, header.file_size)
        ident = identity(etag, last_modified, header.file_size)
        if path is None or ident is None or raw_header is None or len(raw_header) != header.data_start:
            # said, not silent: a cache_dir that never fills would cost a download per start
            why = ("its header's bytes are not known (a protocol read through fsspec)" if raw_header is None
                   else "the server sends neither a strong ETag nor Last-Modified, so its versions cannot be "
                   "told apart")
            warnings.warn(CacheWriteWarning(f"no local copy of {public_url(url)}: {why}"), stacklevel=3)
            return None
        if not self.writable:
            raise WriteError("the cache directory is not writable", path=self.cache_dir, reason="CacheDirectory")
        try:
            copy = _Copy(path, url, ident, raw_header, header, date)
        except OSError as exc:
            warnings.warn(CacheWriteWarning(f"{path}: no local copy of {public_url(url)}: {exc.strerror or exc}"),
                          stacklevel=3)
            return None
        self._copies.append(copy)
        return copy

    def wrap(self, url: str, etag: str | None, last_modified: str | None, header: Header,
             raw_header: bytes | None, ranges: Ranges, *, date: str | None = None) -> Ranges:
        """``ranges`` that also writes each body it received into a new copy of ``url``
        (``ranges`` itself where no copy can be made); ``date`` as :meth:`open` takes it."""
        copy = self._start(url, etag, last_modified, header, raw_header, date)
        if copy is None:
            return ranges

        def read(offset: int, views: Sequence[memoryview], again: bool = False) -> None:
            (getattr(ranges, "fresh", ranges) if again else ranges)(offset, views)
            if copy.failed:
                return
            try:
                copy.write(offset, views, again)
            except OSError as exc:  # the copy is lost, the load is not: the tensors are whole
                copy.drop(exc)

        def keep(offset: int, views: Sequence[memoryview], again: bool = False) -> None:
            """Write bytes that landed some other way (another rank of a group load read them;
            ``again``: read again after a failed checksum, not counted twice)."""
            if copy.failed:
                return
            try:
                copy.write(offset, views, again)
            except OSError as exc:
                copy.drop(exc)

        read.fresh = functools.partial(read, again=True)  # type: ignore[attr-defined]
        read.keep = keep  # type: ignore[attr-defined]
        return read

    def fetch(self, files: Sequence[tuple[str, str | None, str | None, Header, bytes | None, Ranges]], *,
              threads: int, chunk_bytes: int, cancel: threading.Event | None = None,
              dates: Mapping[str, str | None] | None = None) -> list[tuple[int, str] | None]:
        """Download whole files into new copies, name them, and open them.

        ``files`` holds ``(url, etag, last_modified, header, raw_header, ranges)``; requests of
        ``chunk_bytes`` run ``threads`` at a time across all files.  Returns, per file, what
        :meth:`open` returns for its new copy, or None where none could be made.  A failed
        request stops the others (``cancel`` is set) and is raised; no copy is named then.
        ``dates``: url -> ``date`` as :meth:`open` takes it.
        """
        dates = dates or {}
        started: list[tuple[int, _Copy, Ranges, Any]] = []
        for k, (url, etag, modified, header, raw, ranges) in enumerate(files):
            copy = self._start(url, etag, modified, header, raw, dates.get(url))
            if copy is not None:
                started.append((k, copy, ranges, _mapping(copy)))
        tasks = iter([(copy, ranges, target, offset, min(chunk_bytes, copy.size - offset))
                      for _, copy, ranges, target in started
                      for offset in range(copy.data_start, copy.size, chunk_bytes)])
        lock = threading.Lock()
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                with lock:
                    task = next(tasks, None)
                if task is None:
                    return
                copy, ranges, target, offset, n = task
                if copy.failed:
                    continue
                if target is not None:  # received straight into the file's pages
                    with target[offset : offset + n] as view:
                        ranges(offset, [view])
                    copy.landed_at(offset, n)
                    continue
                view = memoryview(bytearray(n))
                ranges(offset, [view])
                try:
                    copy.write(offset, [view])
                except OSError as exc:
                    copy.drop(exc)

        def failed() -> None:
            stop.set()
            if cancel is not None:
                cancel.set()  # ends the other requests' waits between tries

        try:
            run_threads([worker] * max(1, threads), name="engine-cache", on_error=failed)
        finally:
            for _, _, _, target in started:
                _unmap(target)
        done = set(self.commit())
        out: list[tuple[int, str] | None] = [None] * len(files)
        for k, copy, _, _ in started:
            if copy.dest in done:
                url, etag, modified, header, raw, _ = files[k]
                # just downloaded: this load reads it whatever its Last-Modified says
                out[k] = self.open(url, etag, modified, header, raw, date=dates.get(url), fresh=True)
        return out

    def commit(self) -> list[str]:
        """Make every complete copy durable and give it its name, then its sidecar; returns
        their paths.  Older versions of the same files are removed.  A copy that cannot be
        named is dropped with a :class:`~engine.errors.CacheWriteWarning`."""
        ready = []
        for copy in self._copies:
            if copy.file.fd is None or not copy.complete():
                continue
            try:
                os.fsync(copy.fd)  # the bytes on the disk before the name points at them
                copy.file.commit()
            except OSError as exc:
                copy.drop(exc)
                continue
            ready.append(copy)
        if not ready:
            return []
        named = []
        try:
            sync_dir(self.cache_dir)
        except OSError as exc:
            for copy in ready:
                _unlink(copy.dest)
                copy.drop(exc)
            return []
        for copy in ready:
            try:
                side = AtomicFile(copy.dest + _SIDECAR, 0o644 & ~umask())
                try:
                    assert side.fd is not None
                    _pwrite_all(side.fd, [memoryview(copy.sidecar())], 0)
                    os.fsync(side.fd)
                    side.commit()
                except BaseException:
                    side.discard()
                    raise
            except OSError as exc:
                _unlink(copy.dest)  # never read without its sidecar anyway
                copy.drop(exc)
                continue
            named.append(copy.dest)
        try:
            sync_dir(self.cache_dir)
        except OSError as exc:
            warnings.warn(CacheWriteWarning(f"{self.cache_dir}: cannot sync the directory: {exc.strerror or exc}"),
                          stacklevel=2)
        for path in named:
            _remove_other_versions(path)
        return named

    def close(self) -> None:
        """Discard the copies not named and close the copies read."""
        for copy in self._copies:
            copy.file.discard()
        self._copies = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _open_entry(path: str) -> int:
    """A descriptor of the file at ``path`` for reading, or -1.  Never follows a symbolic
    link and never waits (a FIFO put there): only what the engine wrote is a copy."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def _mapping(copy: _Copy) -> memoryview | None:
    """A writable shared mapping of the copy's file, its space reserved; None where the file
    cannot be mapped (the bodies are then written from a buffer)."""
    if copy.size == copy.data_start:
        return None
    try:
        # reserved first: a full disk is this error, never a SIGBUS in a write to the mapping
        os.posix_fallocate(copy.fd, 0, copy.size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            copy.drop(exc)
        return None
    try:
        return memoryview(mmap.mmap(copy.fd, copy.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
    except (OSError, ValueError):  # a file opened write-only, a file system without shared mappings
        return None


def _unmap(view: memoryview | None) -> None:
    if view is None:
        return
    base = view.obj
    view.release()
    try:
        base.close()  # type: ignore[attr-defined]
    except BufferError:  # a view of it still alive somewhere: unmapped when it goes
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove_other_versions(path: str) -> None:
    """Remove the other versions of the file ``path`` is a version of (and their dead
    writers' temporaries); never another process's live temporary."""
    directory, keep = os.path.split(path)
    url_key = keep.partition("-")[0]
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        if entry.startswith("."):
            if entry.startswith(f".{url_key}-") and entry.endswith(".tmp"):
                # .<base>.<pid>.<random>.tmp of a writer without O_TMPFILE: gone if it died
                base = entry[1:].rsplit(".", 3)[0]
                if base not in (keep, keep + _SIDECAR):
                    remove_stale(directory, base)
            continue
        if entry.startswith(f"{url_key}-") and entry not in (keep, keep + _SIDECAR):
            _unlink(os.path.join(directory, entry))
