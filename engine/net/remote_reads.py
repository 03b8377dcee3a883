"""Every HTTP(S) request of the engine: keep-alive connections, deadlines and retries.

One client (:class:`RangeReads`) for every request a remote file needs, whatever the entry
point: the first request of a file (:meth:`RangeReads.first`: its size, version and first
bytes), its header and every tensor range (:meth:`RangeReads.read`), whole small documents (an
index, an S3 listing: :meth:`RangeReads.document`).  One rule for faults, one meaning of
``timeout`` (each request's), the same retries in every phase.

The remote counterpart of :mod:`engine.io.reader`: the pipeline's workers call a file's
:meth:`RangeReads.reader` with a file offset and the destination views of one planned
request, and the bytes go from the socket straight into them (``recv_into`` on the
connection, GIL released): no growing ``bytes``, no staging buffer on the host.

* **Connections**: one keep-alive HTTP/1.1 connection per worker thread and host, opened on
  first use and reused for every later range; so at most ``connections`` (the load's worker
  count) per host.  The environment's proxies apply as in :mod:`engine.net._http`.
* **Deadlines**: each request (connecting, the answer, the whole body) must finish within
  ``timeout`` seconds; a server that trickles bytes cannot stretch it: every socket wait
  is limited to the time left, and a watchdog shuts the socket down when the deadline
  passes during the body.
* **Retries**: a transient failure (connection refused or reset, a timeout, a body that
  ends early, HTTP 408/425/429/500/502/503/504 (after ``Retry-After`` where the server
  sends one, up to the retry's cap), S3's ``SlowDown``, a ``Content-Range`` that does not
  answer the request) is retried with capped exponential backoff and full jitter, for the
  bytes of the request not yet landed, up to ``Retry.attempts`` tries; anything else (403,
  404, a file whose size or ETag changed, a 416, a body compressed although ``identity`` was
  asked for) fails at once.  A file's first request is the call's first contact with the
  server: a refused connection or a name that does not resolve fails it at once (no server
  answered; the bulk reads retry a refusal, a server restarting).  Every request after the header carries ``If-Match`` with the ETag
  seen when the header was read, so a file replaced during the load is a ``FileChanged``
  error, never a mix of two files.
* **Servers that ignore Range** (``python -m http.server``) answer a ranged GET with the
  whole file (200).  The first such answer of a file (or the header's, handed over by
  :meth:`RangeReads.adopt`) becomes that file's one stream: every later range of the file is
  served from it, in file order, and no second whole-file request is made (unless the
  stream breaks, or a handle reads again bytes it did not keep); a
  :class:`~engine.errors.RangeIgnoredWarning` says so once per file.
* **Errors** name the URL (without any user:password part), the byte range and the reason;
  no request header, so no credential, appears in one.
"""

from __future__ import annotations

import bisect
import functools
import http.client
import os
import random
import re
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from engine.errors import Cancelled, RangeIgnoredWarning, SafetensorError
from engine.net._http import (
    REDIRECTS,
    USER_AGENT,
    Watchdog,
    connect_error,
    connection,
    content_range,
    error_body,
    error_code,
    read_error,
    redirect,
    status_error,
)

__all__ = ["RangeReads", "RemoteFile", "Retry", "DEFAULT_CONNECTIONS", "DEFAULT_TIMEOUT", "public_url", "read_runs",
           "skip_views", "transient"]

#: Connections (and worker threads) per load: two per core, between 4 and 16.  Each
#: connection's receive takes CPU, so on a 2-core VM 4 beat 8 and 16 on loopback
#: (``scripts/bench_remote.py --sweep``, BENCHMARKS.md); a far-away server (S3) needs many
#: streams in flight, which machines with more cores get.  ``connections=`` sets it.
DEFAULT_CONNECTIONS = max(4, min(16, 2 * (os.cpu_count() or 2)))
#: Seconds allowed for each request: connecting, the answer and the whole body.
DEFAULT_TIMEOUT = 60.0
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_TRANSIENT_S3 = frozenset({"SlowDown", "InternalError", "RequestTimeout", "ServiceUnavailable", "Throttling"})
_TRANSIENT_REASONS = frozenset({"ConnectionError", "Timeout", "ShortRead", "BadRange"})
_STALL_S = 30.0  # longest single socket wait, so a deadline check comes round often
_ERROR_BODY = 65536
_PROGRESS = 1 << 20  # bytes a failed try must land to count as progress
_PIECE = 4 << 20  # bytes per receive call, so the deadline is checked between them


class Retry(NamedTuple):
    """How transient failures are retried: ``attempts`` tries per range (the first
    included); before try ``k`` a sleep drawn uniformly from ``[0, min(cap, base * 2**k)]``
    seconds (full jitter)."""

    attempts: int = 6
    base: float = 0.1
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * (2.0 ** attempt)))


class RemoteFile(NamedTuple):
    """A remote file as its header request saw it: where it ended up after redirects, its
    size, its ETag (``None`` where the server sends none), the URL to name in errors, and
    the headers to send there (``None``: the load's own; a redirect to another host has
    dropped the credentials from them)."""

    url: str
    size: int
    etag: str | None = None
    name: str | None = None
    headers: Mapping[str, str] | None = None


class First(NamedTuple):
    """What a file's first request (:meth:`RangeReads.first`) learned: the file (its size
    and version, the URL as asked for: the reads go where it was redirected), its first
    ``min(8, size)`` bytes, and the answer's ``Content-Type``, ``Last-Modified`` and
    ``Date`` (``None`` where the server sent none)."""

    file: RemoteFile
    prefix: bytes
    content_type: str | None
    last_modified: str | None
    date: str | None


def transient(err: SafetensorError) -> bool:
    """Whether a request that failed with ``err`` may succeed when tried again: the
    connection failed or the body ended early, a timeout, an answer for another range, or
    an HTTP status of a busy or failing server (408, 425, 429, 500, 502, 503, 504; S3's
    ``SlowDown`` is a 503)."""
    return err.reason in _TRANSIENT_REASONS or getattr(err, "status", None) in _TRANSIENT_STATUS


def public_url(url: str) -> str:
    """``url`` without a ``user:password@`` part (for messages)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - a malformed host or port raises here
    except ValueError:  # malformed: cut whatever stands before an @ in the authority
        return re.sub(r"//[^/@]*@", "//", url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


class _Failed(Exception):
    """A try that failed after ``landed`` bytes; ``error`` is what the caller would see;
    ``after``: seconds the server asked to wait before the next try (``Retry-After``)."""

    def __init__(self, error: SafetensorError, landed: int, transient: bool, after: float = 0.0) -> None:
        super().__init__(str(error))
        self.error = error
        self.landed = landed
        self.transient = transient
        self.after = after


def _retry_after(resp: http.client.HTTPResponse, cap: float) -> float:
    """The seconds of a ``Retry-After: N`` header (a date is read as no wait), at most ``cap``."""
    value = (resp.getheader("Retry-After") or "").strip()
    return min(float(value), cap) if value.isdigit() else 0.0


class _Streamed(Exception):
    """A ranged GET was answered with the whole file: :meth:`RangeReads.adopt` made the
    answer the file's stream, which serves the request instead."""


def _socket_of(resp: http.client.HTTPResponse) -> socket.socket | None:
    """The socket an answer reads its body from.  Its connection lets go of it (``sock`` is
    None) once the server says it will close, as ``http.server`` and every answer to a
    ``Connection: close`` request do; the answer still reads from it."""
    return getattr(getattr(resp.fp, "raw", None), "_sock", None)


class _Stream:
    """The one whole-file answer (200) of a file whose server ignores Range, serving every
    range of the file that the load asks for.

    Requests come from several threads in any order, the body in file order: the lowest
    waiting request goes next.  The body up to its offset goes into a temporary file (a
    slower thread asks for those bytes a moment later, or nobody does: a selection), its
    own bytes straight into its views; with ``RangeReads.keep`` those too go into the
    temporary file, so that a handle can read a tensor again.  A request for bytes the
    stream has passed and not kept, or a stream that broke, opens a new answer from that
    offset (``Range: bytes=N-``: what a server that ignores it sends again whole).

    Each receive waits at most the load's ``timeout`` (30 s at a time); the stream as a
    whole is as long as the file, so no deadline bounds it.

    Copies of tensor bytes: 1 (socket to the views); a range passed before it was asked
    for, 3 (socket to a buffer, to the temporary file's pages, to the views).
    """

    def __init__(self, reads: RangeReads, file: RemoteFile, conn: http.client.HTTPConnection,
                 resp: http.client.HTTPResponse, pos: int) -> None:
        self.reads = reads
        self.file = file
        self.name = file.name or public_url(file.url)
        self.conn: http.client.HTTPConnection | None = conn
        self.resp: http.client.HTTPResponse | None = resp
        self.server = resp.getheader("Server") or ""
        self.pos = pos  # file offset of the next byte of the body
        self.cond = threading.Condition()
        self.busy = False  # a thread is receiving from the body
        self.waiting: list[int] = []  # offsets of the requests waiting for the body
        self.spill: Any = None  # the temporary file, written at the file's own offsets
        self.kept: list[tuple[int, int]] = []  # [start, end) ranges in it, ascending, merged
        self.warned = False
        #: whole-file answers this stream has received (1 unless it broke or went back)
        self.answers = 1

    # -- the requests' side ----------------------------------------------------------------

    def read(self, offset: int, views: list[memoryview], quiet: bool = False) -> None:
        want = sum(len(v) for v in views)
        done = 0
        with self.cond:
            if not quiet:  # a header's read says nothing: only a load's do
                self._warn()
            self.waiting.append(offset)
            try:
                while True:
                    done += self._from_kept(offset + done, skip_views(views, done))
                    if done >= want:
                        return
                    if not self.busy and min(self.waiting) == offset:
                        self.busy = True
                        break
                    if self.reads.cancel.is_set():
                        raise Cancelled("the load was stopped", reason="Cancelled", path=self.name)
                    self.cond.wait(0.25)
            finally:
                self.waiting.remove(offset)
        try:
            self._receive(offset + done, skip_views(views, done))
        finally:
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def _warn(self) -> None:
        if self.warned:
            return
        self.warned = True
        host = urllib.parse.urlsplit(self.file.url).netloc.rpartition("@")[2]
        server = f"the server at {host}" + (f" ({self.server})" if self.server else "")
        warnings.warn(RangeIgnoredWarning(
            f"{server} ignores Range requests: it answered a ranged GET of {self.name} with the whole "
            f"file (HTTP 200), so that file is read as one stream of {self.file.size:,} bytes over one "
            "connection instead of parallel ranges, and the bytes passed before they are asked for are "
            "kept in a temporary file; a server that honours Range (nginx, S3) loads it in parallel"),
            stacklevel=4)

    def drop_kept(self, offset: int, n: int) -> None:
        """Forget the kept bytes ``[offset, offset + n)``: a request for them goes to the server."""
        with self.cond:
            out: list[tuple[int, int]] = []
            for a, b in self.kept:
                if b <= offset or a >= offset + n:
                    out.append((a, b))
                    continue
                if a < offset:
                    out.append((a, offset))
                if b > offset + n:
                    out.append((offset + n, b))
            self.kept = out

    def _from_kept(self, offset: int, views: list[memoryview]) -> int:
        """Fill ``views`` from the temporary file as far as it holds the bytes from ``offset``."""
        i = bisect.bisect_right(self.kept, (offset, 1 << 62)) - 1
        if i < 0 or self.kept[i][1] <= offset:
            return 0
        n = min(self.kept[i][1] - offset, sum(len(v) for v in views))
        got = 0
        while got < n:
            k = os.preadv(self.spill.fileno(), _limit(skip_views(views, got), n - got), offset + got)
            if k <= 0:
                raise read_error(f"the temporary copy of bytes from {offset} ended early", self.name, "ShortRead")
            got += k
        return n

    # -- the owner's side (one thread at a time, the lock not held) -------------------------

    def _receive(self, offset: int, views: list[memoryview]) -> None:
        want = sum(len(v) for v in views)
        retry = self.reads.retry
        done = tries = 0
        while done < want:
            try:
                if self.resp is None or offset + done < self.pos:
                    self._reopen(offset + done)
                self._skip_to(offset + done)
                done += self._recv(skip_views(views, done))
            except _Failed as failed:
                self._hang_up()
                done += failed.landed
                if not failed.transient:
                    raise failed.error from None
                tries = 0 if failed.landed >= _PROGRESS else tries + 1
                if tries >= retry.attempts:
                    raise failed.error from None
                with self.reads._lock:
                    self.reads.retries += 1
                if self.reads.cancel.wait(retry.delay(tries)):
                    raise failed.error from None

    def _reopen(self, offset: int) -> None:
        """A new answer from ``offset`` (a server that ignores Range sends the whole file)."""
        self._hang_up()
        reads, file = self.reads, self.file
        deadline = time.monotonic() + reads.timeout
        conn, _, resp, watchdog = reads._open(file, offset, None, deadline, self.name)
        watchdog.cancel()  # a stream is as long as its file: each receive is limited instead
        try:
            # the checks of a ranged answer's head (status, ETag, encoding, Content-Range or
            # Content-Length), as for every range
            whole = reads._check_head(resp, file, self.name, offset, file.size - offset) is None
        except _Failed:
            resp.close()
            conn.close()
            raise
        pos = 0 if whole else offset
        self.answers += whole
        self.conn, self.resp, self.pos = conn, resp, pos

    def _skip_to(self, offset: int) -> None:
        """Receive the body up to ``offset`` into the temporary file.  A failure here has
        landed none of the caller's bytes: its :class:`_Failed` says 0, whatever the scratch
        buffer received."""
        scratch: memoryview | None = None
        while self.pos < offset:
            if scratch is None:
                scratch = memoryview(bytearray(min(offset - self.pos, 1 << 20)))
            piece = scratch[: min(offset - self.pos, len(scratch))]
            try:
                self._recv([piece], keep=False)
            except _Failed as failed:
                failed.landed = 0  # the scratch's bytes, not the views': _receive must not count them
                raise
            self._keep(self.pos - len(piece), [piece])

    def _recv(self, views: list[memoryview], keep: bool | None = None) -> int:
        """Receive the next bytes of the body into ``views``; raises :class:`_Failed` (with
        the bytes landed) when the body fails or ends early."""
        resp, want = self.resp, sum(len(v) for v in views)
        assert resp is not None and self.conn is not None
        sock = _socket_of(resp)
        landed = 0
        for view in views:
            got = 0
            while got < len(view):
                if sock is not None:
                    sock.settimeout(min(_STALL_S, self.reads.timeout))
                try:
                    n = resp.readinto(view[got : got + _PIECE])
                except (OSError, http.client.HTTPException) as exc:
                    timed_out = isinstance(exc, (TimeoutError, socket.timeout))
                    raise self.reads._fail(
                        self.name, self.pos, want - landed - got, "Timeout" if timed_out else "ConnectionError",
                        f"no byte of the body within {self.reads.timeout:g} s" if timed_out
                        else f"the connection failed: {exc}", landed + got) from None
                if not n:
                    raise self.reads._fail(self.name, self.pos, want - landed - got, "ShortRead",
                                           "the body ended early (truncated)", landed + got)
                got += n
                self.pos += n
            landed += got
        if self.reads.keep if keep is None else keep:
            self._keep(self.pos - landed, views)
        return landed

    def _keep(self, offset: int, views: list[memoryview]) -> None:
        """Write bytes that landed at ``offset`` into the temporary file (a full disk only
        loses them: a later request for them opens a new answer)."""
        try:
            if self.spill is None:
                self.spill = tempfile.TemporaryFile(prefix="engine-range-")
            n = sum(len(v) for v in views)
            done = 0
            while done < n:
                k = os.pwritev(self.spill.fileno(), skip_views(views, done), offset + done)
                if k <= 0:
                    return
                done += k
        except OSError:
            return
        with self.cond:
            kept = self.kept
            i = bisect.bisect_left(kept, (offset, 0))
            kept.insert(i, (offset, offset + n))
            merged: list[tuple[int, int]] = []
            for a, b in kept:
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            self.kept = merged
            self.cond.notify_all()  # a request waiting for these bytes reads them now

    def _hang_up(self) -> None:
        if self.resp is not None:
            self.resp.close()
        if self.conn is not None:
            self.conn.close()
        self.resp = self.conn = None

    def close(self) -> None:
        self._hang_up()
        if self.spill is not None:
            self.spill.close()
            self.spill = None


def _limit(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views`` (back to back)."""
    out = []
    for v in views:
        if n <= 0:
            break
        out.append(v[:n])
        n -= len(out[-1])
    return out



class RangeReads:
    """The ranged reads of one load, shared by its worker threads.

    Parameters
    ----------
    connections : int
        Worker threads the caller runs, and so keep-alive connections per host.
    timeout : float
        Seconds for each request.
    retry : Retry
    headers : mapping, optional
        Sent with every request (``Authorization`` is dropped on a redirect to another host).
    sign : callable, optional
        ``sign(url) -> headers`` for each request (S3's SigV4, see :mod:`engine.net._s3`).
    cancel : threading.Event, optional
        Stops waiting between tries.
    max_redirects : int
    """

    def __init__(self, *, connections: int = DEFAULT_CONNECTIONS, timeout: float = DEFAULT_TIMEOUT,
                 retry: Retry | None = None, headers: Mapping[str, str] | None = None,
                 sign: Callable[[str], Mapping[str, str]] | None = None, cancel: threading.Event | None = None,
                 max_redirects: int = 5) -> None:
        self.connections = max(1, int(connections))
        self.timeout = float(timeout)
        self.retry = retry or Retry()
        self.headers = dict(headers or {})
        self.sign = sign
        self.cancel = cancel or threading.Event()
        self.max_redirects = max_redirects
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._moved: dict[str, tuple[str, Mapping[str, str]]] = {}  # file URL -> (where it ended, headers)
        #: the whole-file answers of servers that ignore Range, by file URL (see _Stream)
        self._streams: dict[str, _Stream] = {}
        #: keep every byte a whole-file stream passes, not only those passed before they are
        #: asked for (a handle, which may read a tensor twice, sets it)
        self.keep = False
        #: counters, for tests and benchmarks
        self.requests = 0
        self.retries = 0
        #: what each URL's last answer said it was (``Content-Type``), and where its last
        #: redirect led: how a folder's URL without its slash is recognised
        self.content_types: dict[str, str | None] = {}
        self.moved: dict[str, str] = {}

    # -- connections ------------------------------------------------------------------

    def _connection(self, url: str, deadline: float) -> tuple[http.client.HTTPConnection, str, dict, bool]:
        """An idle keep-alive connection to ``url``'s host, or a new one: ``(connection,
        request target, extra headers, reused)``."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise _Failed(read_error(f"cannot request {public_url(url)!r}: not an http(s) URL", public_url(url),
                                     "InvalidURL"), 0, False)
        timeout = max(0.001, min(_STALL_S, deadline - time.monotonic()))
        try:
            conn, target, extra = connection(parts, timeout)  # the target and proxy headers for this path
        except ValueError as exc:
            raise _Failed(read_error(f"invalid URL: {exc}", public_url(url), "InvalidURL"), 0, False) from None
        key = (parts.scheme.lower(), parts.netloc)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), target, extra, True
        return conn, target, extra, False

    def _release(self, url: str, conn: http.client.HTTPConnection) -> None:
        """Give a connection whose last answer was read to its end back to the pool."""
        parts = urllib.parse.urlsplit(url)
        with self._lock:
            self._idle.setdefault((parts.scheme.lower(), parts.netloc), []).append(conn)

    def __enter__(self) -> RangeReads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the idle connections (a connection in use is closed by its request) and
        the whole-file streams."""
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.close()
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    # -- reads ------------------------------------------------------------------------

    def first(self, url: str, *, name: str | None = None, not_found: type | None = None,
              headers: Mapping[str, str] | None = None) -> First:
        """A file's first request: a ranged GET of bytes 0-7, which says the file's size
        (``Content-Range``) and version (``ETag``), retried as every request is.  Where the
        server ignores Range (a 200 with the whole file), the answer becomes the file's one
        stream (:meth:`adopt`): the header and tensors are read on from it, with no second
        whole-file request.  ``not_found``: the error class of a 404 (default
        :class:`~engine.errors.RemoteFileNotFoundError`).

        Raises :class:`~engine.errors.ReadError` (``UnknownSize`` where the server says no
        size; ``BadRange``; the status of an error answer),
        :class:`~engine.errors.HeaderError` for a file of fewer than 8 bytes.
        """
        name = name or public_url(url)
        probe = RemoteFile(url, -1, None, name, headers)
        return self._again(name, lambda: self._first(probe, not_found), contact=True)

    def document(self, url: str, limit: int, what: str, *, name: str | None = None,
                 not_found: type | None = None) -> bytes:
        """A whole small document (an index, an S3 listing page) of at most ``limit`` bytes,
        decompressed where the server compressed it anyway (within the limit); retried as
        every request is."""
        name = name or public_url(url)
        return self._again(name, lambda: self._document(url, name, limit, what, not_found), contact=True)

    def _again(self, name: str, fn: Callable[[], Any], contact: bool = False) -> Any:
        """``fn()`` (one whole try of a request that lands nothing until it succeeds), tried
        again after a transient failure as :meth:`read` does; with ``contact`` (a call's
        first requests), a server that could not be reached at all fails at once."""
        tries = 0
        while True:
            try:
                return fn()
            except _Failed as failed:
                if not failed.transient or (contact and getattr(failed.error, "unreachable", False)):
                    raise failed.error from None
                tries += 1
                self._wait_to_retry(failed, tries)

    def _wait_to_retry(self, failed: _Failed, tries: int) -> None:
        """After the ``tries``-th transient failure of a request: its error when the tries ran
        out (saying how many) or the load stopped meanwhile, else the backoff (or the server's
        ``Retry-After``, up to the cap) waited out."""
        err = failed.error
        if tries >= self.retry.attempts:
            err.message = f"{err.message} (after {tries} tries)"
            err.args = (err.message,)
            raise err from None
        with self._lock:
            self.retries += 1
        if self.cancel.wait(max(self.retry.delay(tries), failed.after)):
            raise err from None

    def _first(self, probe: RemoteFile, not_found: type | None) -> First:
        name = probe.name or public_url(probe.url)
        deadline = time.monotonic() + self.timeout
        conn, sock, resp, watchdog = self._open(probe, 0, 7, deadline, name)
        try:
            with self._lock:
                self.content_types[probe.url] = resp.getheader("Content-Type")
            if resp.status not in (200, 206):
                raise self._status(resp, name, 0, 8, not_found)
            self._identity(resp, name, 0, 8)
            if resp.status == 206:
                first, last, total = content_range(resp.getheader("Content-Range"))
                what = "Content-Range total"
            else:
                length = resp.getheader("Content-Length")
                first, last = 0, None
                total = int(length) if length is not None and length.strip().isdigit() else None
                what = "Content-Length"
            if total is None:
                _discard(resp)
                raise _Failed(read_error(
                    f"the server did not say how large the file is (no {what}); the size is needed to check "
                    "the header against the data region", name, "UnknownSize"), 0, False)
            if resp.status == 206 and (first != 0 or last is None or last < min(7, total - 1)):
                _discard(resp)
                raise self._fail(name, 0, 8, "BadRange", f"asked for bytes 0-7, the server sent {first}-{last}", 0)
            file = RemoteFile(probe.url, total, resp.getheader("ETag"), name, probe.headers)
            prefix = bytearray(min(8, total))
            if prefix:
                self._receive(resp, sock, name, 0, [memoryview(prefix)], deadline, len(prefix))
            found = First(file, bytes(prefix), resp.getheader("Content-Type"), resp.getheader("Last-Modified"),
                          resp.getheader("Date"))
        except _Failed:
            watchdog.cancel()
            conn.close()
            raise
        watchdog.cancel()
        if resp.status == 200:  # the whole file: its one stream from here on (see _Stream)
            self.forget(probe.url)  # an earlier answer of the same URL (its first request again)
            self.adopt(file, conn, resp, len(found.prefix))
        else:
            self._finish(probe.url, conn, resp)
        return found

    def _document(self, url: str, name: str, limit: int, what: str, not_found: type | None) -> bytes:
        deadline = time.monotonic() + self.timeout
        conn, sock, resp, watchdog = self._open(RemoteFile(url, -1, None, name), None, None, deadline, name)
        try:
            with self._lock:
                self.content_types[url] = resp.getheader("Content-Type")
            if resp.status not in (200, 206):
                raise self._status(resp, name, 0, 0, not_found)
            length = resp.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                raise _Failed(read_error(f"{what} is {int(length)} bytes, more than the limit of {limit}", name,
                                         "TooLarge"), 0, False)
            parts, got = [], 0
            while True:
                self._arm(sock, deadline, name, 0, limit, got)
                try:
                    chunk = resp.read1(1 << 20) if not resp.isclosed() else b""
                except http.client.IncompleteRead as exc:
                    raise self._fail(name, 0, limit, "ShortRead",
                                     f"the body ended after {got + len(exc.partial or b'')} bytes (truncated)", 0) \
                        from None
                except (OSError, http.client.HTTPException) as exc:
                    timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline
                    raise self._fail(name, 0, limit, "Timeout" if timed_out else "ConnectionError",
                                     "the request's deadline passed while receiving the body" if timed_out
                                     else f"the connection failed: {exc}", 0) from None
                if not chunk:
                    break
                got += len(chunk)
                if got > limit:
                    raise _Failed(read_error(f"{what} is larger than the limit of {limit} bytes", name, "TooLarge"),
                                  0, False)
                parts.append(chunk)
            data = b"".join(parts)
            if length is not None and length.strip().isdigit() and len(data) != int(length):
                raise self._fail(name, 0, limit, "ShortRead",
                                 f"the body ended after {len(data)} of {int(length)} bytes (truncated)", 0)
        except _Failed:
            watchdog.cancel()
            conn.close()
            raise
        watchdog.cancel()
        self._finish(url, conn, resp)
        encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            # a small document may come compressed despite the request: bounded, so that it
            # cannot inflate past the limit
            try:
                data = zlib.decompressobj(wbits=15 if encoding == "deflate" else 47).decompress(data, limit + 1)
            except zlib.error as exc:
                raise read_error(f"cannot decompress the {encoding} body: {exc}", name, "HTTPError") from None
            if len(data) > limit:
                raise read_error(f"{what} is larger than the limit of {limit} bytes", name, "TooLarge")
        elif encoding != "identity":
            raise read_error(f"the server compressed the body (Content-Encoding: {encoding}) although it was asked "
                             "for identity", name, "HTTPError")
        return data

    def forget(self, url: str) -> None:
        """Hang up on the whole-file stream of ``url``, if it has one (a file its caller will
        not read on: read from a local copy instead)."""
        with self._lock:
            stream = self._streams.pop(url, None)
        if stream is not None:
            stream.close()

    def reader(self, file: RemoteFile) -> Callable[[int, Sequence[memoryview]], None]:
        """``read(offset, views)``: fill ``views``, back to back, from ``file`` at ``offset``;
        its ``fresh`` attribute reads from the server whatever a whole-file stream kept (bytes
        read again after a failed checksum)."""
        read = functools.partial(self.read, file)
        read.fresh = functools.partial(self.read, file, fresh=True)  # type: ignore[attr-defined]
        return read

    def read(self, file: RemoteFile, offset: int, views: Sequence[memoryview], *, quiet: bool = False,
             fresh: bool = False) -> None:
        """Fill ``views`` (back to back) with the bytes of ``file`` from ``offset``, retrying
        transient failures for the bytes not yet landed.  ``quiet``: a file whose server
        ignores Range is read on from its stream without the warning (a header's read);
        ``fresh``: from the server, not from the bytes such a stream kept (a read again).

        Copies of tensor bytes: 1 (socket to ``views``).
        """
        views = [v for v in views if len(v)]
        want = sum(len(v) for v in views)
        if not want:
            return
        if offset + want > file.size:
            raise read_error(
                f"bytes {offset}-{offset + want - 1} lie past the end of the file ({file.size} bytes)",
                file.name or public_url(file.url), "ShortRead", offset=offset, size=want,
            )
        done, tries = 0, 0
        while True:
            stream = self._streams.get(file.url)
            if stream is not None:  # a server that ignores Range: this file's one answer
                if fresh:
                    stream.drop_kept(offset + done, want - done)
                stream.read(offset + done, skip_views(views, done), quiet)
                return
            try:
                # a whole answer may be shorter than asked (a server that caps its ranges):
                # the rest is asked for at once, with no backoff and no try counted
                done += self._get(file, offset + done, skip_views(views, done))
                if done >= want:
                    return
                continue
            except _Streamed:  # the answer was the whole file: it is now the file's stream
                continue
            except _Failed as failed:
                # a try that landed a MiB (or half of what was left) starts the count again; a
                # server that sends a little and then fails every time still runs out of tries
                progressed = failed.landed >= min(_PROGRESS, (want - done) // 2 or 1)
                done += failed.landed
                if not failed.transient:
                    raise failed.error from None
                tries = 0 if progressed else tries + 1
                self._wait_to_retry(failed, tries)

    def _get(self, file: RemoteFile, offset: int, views: list[memoryview]) -> int:
        """One try: a ranged GET of ``views``' bytes at ``offset``; returns the bytes landed
        (fewer than asked when the server answers a shorter range), raises :class:`_Failed`,
        or :class:`_Streamed` when the answer was the whole file (now the file's stream)."""
        want = sum(len(v) for v in views)
        name = file.name or public_url(file.url)
        deadline = time.monotonic() + self.timeout
        # every socket wait is limited to the time left, but a read that a trickling server
        # answers a byte at a time could still outlast the deadline: the watchdog shuts the
        # socket down when it passes, which wakes the read
        conn, sock, resp, watchdog = self._open(file, offset, offset + want - 1, deadline, name)
        try:
            landed = self._body(resp, sock, file, name, offset, views, deadline)
        except _Failed:
            conn.close()
            raise
        except _Streamed:
            watchdog.cancel()
            self.adopt(file, conn, resp, 0)
            raise
        finally:
            watchdog.cancel()
        self._finish(file.url, conn, resp)
        return landed

    def _open(self, file: RemoteFile, offset: int | None, last: int | None, deadline: float, name: str):
        """Send a GET of bytes ``offset..last`` (to the end when ``last`` is None; the whole
        document, no Range, when ``offset`` is None), following redirects: ``(connection,
        socket, response, watchdog)`` with the answer's head read (see :meth:`_send`)."""
        want = 0 if offset is None else (file.size - offset if last is None else last - offset + 1)
        with self._lock:
            url, headers = self._moved.get(file.url, (file.url, file.headers if file.headers is not None
                                                      else self.headers))
            self.requests += 1
        for _ in range(self.max_redirects + 1):
            req = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **headers}
            if offset is not None:
                req["Range"] = f"bytes={offset}-{'' if last is None else last}"
            if self.sign is not None:
                req.update(self.sign(url))
            if file.etag and not file.etag.startswith("W/"):
                # If-Match compares strongly: a weak ETag (a CDN's, say) would never match;
                # the answer's ETag is still compared below
                req["If-Match"] = file.etag
            conn, sock, resp, watchdog = self._send(url, req, deadline, name, offset or 0, want)
            if resp.status not in REDIRECTS:
                return conn, sock, resp, watchdog
            location = resp.getheader("Location")
            watchdog.cancel()
            self._finish(url, conn, resp)
            try:
                url, headers = redirect(name, url, headers, location)
            except SafetensorError as err:
                raise _Failed(err, 0, False) from None
            with self._lock:
                self._moved[file.url] = (url, headers)
                self.moved[file.url] = url
        raise _Failed(read_error(f"more than {self.max_redirects} redirects", name, "TooManyRedirects"), 0, False)

    def adopt(self, file: RemoteFile, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
              pos: int) -> None:
        """Make ``resp``, a whole-file answer (200) of ``file`` read up to the file offset
        ``pos``, the stream every later range of the file is served from (the header's
        request hands its answer over so; a bulk read's 200 likewise).  A file that already
        has its stream keeps it, and ``resp`` is hung up on."""
        with self._lock:
            if file.url not in self._streams:
                self._streams[file.url] = _Stream(self, file, conn, resp, pos)
                return
        resp.close()
        conn.close()

    def _send(self, url: str, req: dict, deadline: float, name: str, offset: int, want: int):
        """Send the request and read the answer's head: ``(connection, socket, response,
        watchdog)``; the watchdog (cancelled by the caller once the body is read) shuts the
        socket down at the deadline from the connection on, so that a server that sends its
        head a byte at a time cannot stretch the request either.  A keep-alive connection the
        server has closed meanwhile is replaced once at no cost."""
        for _ in range(2):
            conn, target, extra, reused = self._connection(url, deadline)
            watchdog = Watchdog(deadline)
            try:
                timeout = max(0.001, min(_STALL_S, deadline - time.monotonic()))
                conn.timeout = timeout
                if conn.sock is None:
                    conn.connect()
                conn.sock.settimeout(timeout)
                watchdog.watch(conn.sock)
                conn.request("GET", target, headers={**req, **extra})
                sock = conn.sock  # the response owns it once the server says it will close
                return conn, sock, conn.getresponse(), watchdog
            except (OSError, http.client.HTTPException) as exc:
                watchdog.cancel()
                conn.close()
                timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline \
                    or watchdog.fired
                if reused and not timed_out:
                    continue
                if isinstance(exc, ssl.SSLCertVerificationError):  # trying again cannot help
                    err = connect_error(exc, name)
                    raise _Failed(err, 0, False) from None
                what = "no answer within the request's deadline" if timed_out else f"the connection failed: {exc}"
                failed = self._fail(name, offset, want, "Timeout" if timed_out else "ConnectionError", what, 0)
                # nothing listens there, or the name does not resolve (see RangeReads.first)
                failed.error.unreachable = isinstance(exc, (ConnectionRefusedError, socket.gaierror))  # type: ignore[attr-defined]
                raise failed from None
        raise AssertionError("unreachable")

    def _finish(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """Pool the connection when its answer was read to its end, else hang up."""
        if not resp.isclosed():
            _discard(resp)
        # read to its end: http.client counts the body down to 0 (a body closed early is not)
        if resp.isclosed() and resp.length == 0 and not resp.will_close and conn.sock is not None:
            self._release(url, conn)
        else:
            conn.close()

    def _check_head(self, resp: http.client.HTTPResponse, file: RemoteFile, name: str, offset: int,
                    want: int) -> int | None:
        """Check the head of an answer to a GET of ``want`` bytes from ``offset``: the bytes
        a 206 sends, or None for a 200 (the whole file, a server that ignores Range); raises
        :class:`_Failed` for an error status, another version of the file, a compressed body
        or a range other than the one asked for."""
        if resp.status not in (200, 206):
            raise self._status(resp, name, offset, want)
        etag = resp.getheader("ETag")
        if file.etag and etag and etag != file.etag:
            _discard(resp)
            raise self._fail(name, offset, want, "FileChanged",
                             f"the file changed since its header was read (ETag {file.etag}, now {etag})",
                             0, transient=False)
        self._identity(resp, name, offset, want)
        if resp.status == 206:
            first, lastb, total = content_range(resp.getheader("Content-Range"))
            if total is not None and total != file.size:
                _discard(resp)
                raise self._fail(name, offset, want, "FileChanged",
                                 f"the file changed since its header was read ({file.size} bytes, now {total})",
                                 0, transient=False)
            if first != offset or lastb is None or lastb < first:
                _discard(resp)
                raise self._fail(name, offset, want, "BadRange",
                                 f"asked for bytes {offset}-{offset + want - 1}, the server sent {first}-{lastb}", 0)
            return min(want, lastb - first + 1)
        # 200: the whole file from byte 0
        length = resp.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) != file.size:
            _discard(resp)
            raise self._fail(name, offset, want, "FileChanged",
                             f"the file changed since its header was read ({file.size} bytes, now {length})",
                             0, transient=False)
        return None

    def _status(self, resp: http.client.HTTPResponse, name: str, offset: int, want: int,
                not_found: type | None = None) -> _Failed:
        """The failure of an error answer (its body read when short, for S3's code): transient
        for a busy or failing server, after its ``Retry-After``."""
        detail = error_code(error_body(resp))
        err = status_error(name, resp, offset, not_found, detail=detail)
        if want:
            err.message = f"bytes {offset}-{offset + want - 1}: {err.message}"
            err.args = (err.message,)
            err.offset, err.size = offset, want  # type: ignore[attr-defined]
        transient = resp.status in _TRANSIENT_STATUS or detail in _TRANSIENT_S3
        return _Failed(err, 0, transient, _retry_after(resp, self.retry.cap) if transient else 0.0)

    def _identity(self, resp: http.client.HTTPResponse, name: str, offset: int, want: int) -> None:
        """Byte ranges mean nothing in a compressed body: one sent against ``Accept-Encoding:
        identity`` fails (a server that does so does it every time)."""
        encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            _discard(resp)
            raise self._fail(name, offset, want, "HTTPError",
                             f"the server compressed the body (Content-Encoding: {encoding}) although it was asked "
                             "for identity; byte ranges cannot be read from it", 0, transient=False)

    def _body(self, resp: http.client.HTTPResponse, sock, file: RemoteFile, name: str, offset: int,
              views: list[memoryview], deadline: float) -> int:
        want = sum(len(v) for v in views)
        send = self._check_head(resp, file, name, offset, want)
        if send is None:  # 200: the whole file from byte 0, a server that ignores Range
            raise _Streamed()
        return self._receive(resp, sock, name, offset, views, deadline, send)

    def _receive(self, resp: http.client.HTTPResponse, sock, name: str, offset: int, views: list[memoryview],
                 deadline: float, send: int) -> int:
        """Receive the first ``send`` bytes of the body into ``views``: the bytes landed, or
        :class:`_Failed` with them."""
        want = sum(len(v) for v in views)
        landed = 0
        for view in views:
            if landed >= send:
                break
            view = view[: send - landed]
            got = 0
            while got < len(view):
                self._arm(sock, deadline, name, offset, want, landed + got)
                try:
                    n = resp.readinto(view[got : got + _PIECE])
                except http.client.IncompleteRead as exc:
                    n = len(exc.partial or b"")
                    view[got : got + n] = exc.partial or b""
                    got += n
                    raise self._fail(name, offset, want, "ShortRead",
                                     f"the body ended after {landed + got} of {send} bytes", landed + got) from None
                except (OSError, http.client.HTTPException) as exc:
                    timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline
                    raise self._fail(name, offset, want, "Timeout" if timed_out else "ConnectionError",
                                     "the request's deadline passed while receiving the body" if timed_out
                                     else f"the connection failed after {landed + got} of {send} bytes: {exc}",
                                     landed + got) from None
                if not n:
                    if time.monotonic() >= deadline:  # the watchdog shut the socket down
                        raise self._fail(name, offset, want, "Timeout",
                                         "the request's deadline passed while receiving the body", landed + got)
                    raise self._fail(name, offset, want, "ShortRead",
                                     f"the body ended after {landed + got} of {send} bytes (truncated)", landed + got)
                got += n
            landed += got
        return landed

    def _arm(self, sock, deadline: float, name: str, offset: int, want: int, landed: int) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._fail(name, offset, want, "Timeout",
                             "the request's deadline passed while receiving the body", landed)
        if sock is not None:
            sock.settimeout(min(_STALL_S, remaining))

    def _fail(self, name: str, offset: int, want: int, reason: str, what: str, landed: int,
              transient: bool | None = None) -> _Failed:
        err = read_error(f"bytes {offset}-{offset + want - 1}: {what}", name, reason, offset=offset, size=want)
        return _Failed(err, landed, reason in _TRANSIENT_REASONS if transient is None else transient)


def skip_views(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """``views`` (back to back) without their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _discard(resp: http.client.HTTPResponse) -> None:
    """Finish a response the caller does not want: read a short body, else hang up."""
    try:
        if resp.length is not None and resp.length <= _ERROR_BODY:
            resp.read()
        else:
            resp.close()
    except (OSError, http.client.HTTPException):
        resp.close()


def read_runs(read: Callable[[int, Sequence[memoryview]], None], dst: memoryview, src, run_bytes: int, base: int,
              *, max_gap: int = 1 << 20, max_span: int = 64 << 20) -> int:
    """Fill ``dst`` with runs of ``run_bytes`` at file offsets ``base + src[i]`` (back to
    back in ``dst``) through ``read(offset, views)``, one request per group of neighbouring
    runs: runs whose gaps are at most ``max_gap`` and whose span is at most ``max_span``
    share a request, the gap bytes received into a scratch buffer and dropped (a column
    block of a matrix is one request, not one per row).  Returns the requests made.

    Copies of tensor bytes: 1 (socket to ``dst``; only the gaps go to the scratch buffer).
    """
    offsets = [int(x) for x in src]
    n = len(offsets)
    scratch: memoryview | None = None
    requests = i = 0
    while i < n:
        start = offsets[i]
        j = i + 1
        while (j < n and 0 <= offsets[j] - (offsets[j - 1] + run_bytes) <= max_gap
               and offsets[j] + run_bytes - start <= max_span):
            j += 1
        views: list[memoryview] = []
        for k in range(i, j):
            views.append(dst[k * run_bytes : (k + 1) * run_bytes])
            if k + 1 < j:
                gap = offsets[k + 1] - (offsets[k] + run_bytes)
                if gap:
                    if scratch is None:
                        scratch = memoryview(bytearray(max_gap))
                    views.append(scratch[:gap])
        read(base + start, views)
        requests += 1
        i = j
    return requests
