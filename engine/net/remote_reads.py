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
  passes during the body (:mod:`engine.net._response`: one answer's head and body).
* **Retries** (:mod:`engine.net.retry`): a transient failure (connection refused or reset, a
  timeout, a body that ends early, HTTP 408/425/429/500/502/503/504 (after ``Retry-After`` where the server
  sends one, up to the retry's cap), S3's ``SlowDown``, a ``Content-Range`` that does not
  answer the request) is retried with capped exponential backoff and full jitter, for the
  bytes of the request not yet landed, up to ``Retry.attempts`` tries; anything else (403,
  404, a file whose size or ETag changed, a 416, a body compressed although ``identity`` was
  asked for) fails at once, except a refusal (401, 403, 410) of a file that was redirected:
  a presigned URL (the Hub's CDN, S3's) expires, so the file's own URL is asked again where
  it leads (:meth:`RangeReads._renew`).  A file's first request is the call's first contact with the
  server: a refused connection or a name that does not resolve fails it at once (no server
  answered; the bulk reads retry a refusal, a server restarting).  Every request after the header carries ``If-Match`` with the ETag
  seen when the header was read, so a file replaced during the load is a ``FileChanged``
  error, never a mix of two files.
* **Servers that ignore Range** (``python -m http.server``) answer a ranged GET with the
  whole file (200).  The first such answer of a file (or the header's, handed over by
  :meth:`RangeReads.adopt`) becomes that file's one stream: every later range of the file is
  served from it, in file order, and no second whole-file request is made (unless the
  stream breaks, or a handle reads again bytes it did not keep); a
  :class:`~engine.errors.RangeIgnoredWarning` says so once per file
  (:mod:`engine.net._whole_file`).
* **Errors** name the URL (without any user:password part), the byte range and the reason;
  no request header, so no credential, appears in one.
"""

from __future__ import annotations

import functools
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from engine.errors import SafetensorError
from engine.net._http import (
    REDIRECTS,
    USER_AGENT,
    Watchdog,
    connect_error,
    connection,
    content_range,
    read_error,
    redirect,
)
from engine.net._response import STALL_S, arm, check_head, check_identity, discard, receive, status_failure
from engine.net._whole_file import WholeFileStream
from engine.net.remote_file import RemoteFile, public_url
from engine.net.retry import PROGRESS, Failed, Retry, fail
from engine.net.views import skip_views

__all__ = ["RangeReads", "First", "DEFAULT_CONNECTIONS", "DEFAULT_TIMEOUT"]

#: Connections (and worker threads) per load: two per core, between 4 and 16.  Each
#: connection's receive takes CPU, so on a 2-core VM 4 beat 8 and 16 on loopback
#: (``scripts/bench_remote.py --sweep``); a far-away server (S3) needs many
#: streams in flight, which machines with more cores get.  ``connections=`` sets it.
DEFAULT_CONNECTIONS = max(4, min(16, 2 * (os.cpu_count() or 2)))
#: Seconds allowed for each request: connecting, the answer and the whole body.
DEFAULT_TIMEOUT = 60.0


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


class _Streamed(Exception):
    """A ranged GET was answered with the whole file: :meth:`RangeReads.adopt` made the
    answer the file's stream, which serves the request instead."""


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
        ``sign(url, request_headers) -> headers`` for each request, added last (S3's SigV4,
        :mod:`engine.net._s3`; a bearer token for GCS, :mod:`engine.net._gcs`; Azure's
        SharedKey, which signs ``Range`` and ``If-Match`` too, :mod:`engine.net._azure`).
    cancel : threading.Event, optional
        Stops waiting between tries.
    max_redirects : int
    """

    def __init__(self, *, connections: int = DEFAULT_CONNECTIONS, timeout: float = DEFAULT_TIMEOUT,
                 retry: Retry | None = None, headers: Mapping[str, str] | None = None,
                 sign: Callable[[str, Mapping[str, str]], Mapping[str, str]] | None = None, cancel: threading.Event | None = None,
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
        self._renewed: dict[str, float] = {}  # file URL -> when its redirect was last asked for again
        #: the whole-file answers of servers that ignore Range, by file URL (see WholeFileStream)
        self._streams: dict[str, WholeFileStream] = {}
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
            raise Failed(read_error(f"cannot request {public_url(url)!r}: not an http(s) URL", public_url(url),
                                     "InvalidURL"), 0, False)
        timeout = max(0.001, min(STALL_S, deadline - time.monotonic()))
        try:
            conn, target, extra = connection(parts, timeout)  # the target and proxy headers for this path
        except ValueError as exc:
            raise Failed(read_error(f"invalid URL: {exc}", public_url(url), "InvalidURL"), 0, False) from None
        key = (parts.scheme.lower(), parts.netloc)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), target, extra, True
        conn.engine_pool_key = key  # type: ignore[attr-defined]
        return conn, target, extra, False

    def _release(self, url: str, conn: http.client.HTTPConnection) -> None:
        """Give a connection whose last answer was read to its end back to the pool of the
        host it is connected to (after a redirect to another host, not ``url``'s)."""
        parts = urllib.parse.urlsplit(url)
        key = getattr(conn, "engine_pool_key", (parts.scheme.lower(), parts.netloc))
        with self._lock:
            self._idle.setdefault(key, []).append(conn)

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
            except Failed as failed:
                if not failed.transient or (contact and getattr(failed.error, "unreachable", False)):
                    raise failed.error from None
                tries += 1
                self._wait_to_retry(failed, tries)

    def _wait_to_retry(self, failed: Failed, tries: int) -> None:
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
                raise status_failure(resp, name, 0, 8, self.retry.cap, not_found)
            check_identity(resp, name, 0, 8)
            if resp.status == 206:
                first, last, total = content_range(resp.getheader("Content-Range"))
                what = "Content-Range total"
            else:
                length = resp.getheader("Content-Length")
                first, last = 0, None
                total = int(length) if length is not None and length.strip().isdigit() else None
                what = "Content-Length"
            if total is None:
                discard(resp)
                raise Failed(read_error(
                    f"the server did not say how large the file is (no {what}); the size is needed to check "
                    "the header against the data region", name, "UnknownSize"), 0, False)
            if resp.status == 206 and (first != 0 or last is None or last < min(7, total - 1)):
                discard(resp)
                raise fail(name, 0, 8, "BadRange", f"asked for bytes 0-7, the server sent {first}-{last}", 0)
            file = RemoteFile(probe.url, total, resp.getheader("ETag"), name, probe.headers)
            prefix = bytearray(min(8, total))
            if prefix:
                receive(resp, sock, name, 0, [memoryview(prefix)], deadline, len(prefix))
            found = First(file, bytes(prefix), resp.getheader("Content-Type"), resp.getheader("Last-Modified"),
                          resp.getheader("Date"))
        except Failed:
            watchdog.cancel()
            conn.close()
            raise
        watchdog.cancel()
        if resp.status == 200:  # the whole file: its one stream from here on (see WholeFileStream)
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
                raise status_failure(resp, name, 0, 0, self.retry.cap, not_found)
            length = resp.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > limit:
                raise Failed(read_error(f"{what} is {int(length)} bytes, more than the limit of {limit}", name,
                                         "TooLarge"), 0, False)
            parts, got = [], 0
            while True:
                arm(sock, deadline, name, 0, limit, got)
                try:
                    chunk = resp.read1(1 << 20) if not resp.isclosed() else b""
                except http.client.IncompleteRead as exc:
                    raise fail(name, 0, limit, "ShortRead",
                               f"the body ended after {got + len(exc.partial or b'')} bytes (truncated)", 0) \
                        from None
                except (OSError, http.client.HTTPException) as exc:
                    timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline
                    raise fail(name, 0, limit, "Timeout" if timed_out else "ConnectionError",
                               "the request's deadline passed while receiving the body" if timed_out
                               else f"the connection failed: {exc}", 0) from None
                if not chunk:
                    break
                got += len(chunk)
                if got > limit:
                    raise Failed(read_error(f"{what} is larger than the limit of {limit} bytes", name, "TooLarge"),
                                  0, False)
                parts.append(chunk)
            data = b"".join(parts)
            if length is not None and length.strip().isdigit() and len(data) != int(length):
                raise fail(name, 0, limit, "ShortRead",
                           f"the body ended after {len(data)} of {int(length)} bytes (truncated)", 0)
        except Failed:
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
            except Failed as failed:
                # a try that landed a MiB (or half of what was left) starts the count again; a
                # server that sends a little and then fails every time still runs out of tries
                progressed = failed.landed >= min(PROGRESS, (want - done) // 2 or 1)
                done += failed.landed
                if not failed.transient and not self._renew(file, failed):
                    raise failed.error from None
                tries = 0 if progressed else tries + 1
                self._wait_to_retry(failed, tries)

    def _renew(self, file: RemoteFile, failed: Failed) -> bool:
        """Whether a refusal (401, 403, 410) of a file that was redirected is tried again from
        the file's own URL: a redirect to a presigned URL (the Hub's CDN, S3's) expires, and the
        file's URL redirects anew.  The redirect is forgotten at most once a minute per file (the
        requests of other threads that fail meanwhile go to the new one); the tries are counted
        as a transient failure's."""
        if getattr(failed.error, "status", None) not in (401, 403, 410):
            return False
        now = time.monotonic()
        with self._lock:
            moved = self._moved.get(file.url)
            if moved is not None and moved[0] != file.url and now - self._renewed.get(file.url, -1e9) >= 60.0:
                del self._moved[file.url]
                self._renewed[file.url] = now
            elif now - self._renewed.get(file.url, -1e9) >= 60.0:
                return False  # not redirected, or asked again over a minute ago: the refusal stands
        return True

    def _get(self, file: RemoteFile, offset: int, views: list[memoryview]) -> int:
        """One try: a ranged GET of ``views``' bytes at ``offset``; returns the bytes landed
        (fewer than asked when the server answers a shorter range), raises :class:`Failed`,
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
        except Failed:
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
            if file.etag and not file.etag.startswith("W/"):
                # If-Match compares strongly: a weak ETag (a CDN's, say) would never match;
                # the answer's ETag is still compared below
                req["If-Match"] = file.etag
            if self.sign is not None:  # last: a signature may cover Range and If-Match (Azure's)
                req.update(self.sign(url, req))
            conn, sock, resp, watchdog = self._send(url, req, deadline, name, offset or 0, want)
            if resp.status not in REDIRECTS:
                return conn, sock, resp, watchdog
            location = resp.getheader("Location")
            watchdog.cancel()
            self._finish(url, conn, resp)
            try:
                url, headers = redirect(name, url, headers, location)
            except SafetensorError as err:
                raise Failed(err, 0, False) from None
            with self._lock:
                self._moved[file.url] = (url, headers)
                self.moved[file.url] = url
        raise Failed(read_error(f"more than {self.max_redirects} redirects", name, "TooManyRedirects"), 0, False)

    def adopt(self, file: RemoteFile, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
              pos: int) -> None:
        """Make ``resp``, a whole-file answer (200) of ``file`` read up to the file offset
        ``pos``, the stream every later range of the file is served from (the header's
        request hands its answer over so; a bulk read's 200 likewise).  A file that already
        has its stream keeps it, and ``resp`` is hung up on."""
        with self._lock:
            if file.url not in self._streams:
                self._streams[file.url] = WholeFileStream(self, file, conn, resp, pos)
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
                timeout = max(0.001, min(STALL_S, deadline - time.monotonic()))
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
                    raise Failed(err, 0, False) from None
                what = "no answer within the request's deadline" if timed_out else f"the connection failed: {exc}"
                failed = fail(name, offset, want, "Timeout" if timed_out else "ConnectionError", what, 0)
                # nothing listens there, or the name does not resolve (see RangeReads.first)
                failed.error.unreachable = isinstance(exc, (ConnectionRefusedError, socket.gaierror))  # type: ignore[attr-defined]
                raise failed from None
        raise AssertionError("unreachable")

    def _finish(self, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        """Pool the connection when its answer was read to its end, else hang up."""
        if not resp.isclosed():
            discard(resp)
        # read to its end: http.client counts the body down to 0 (a body closed early is not)
        if resp.isclosed() and resp.length == 0 and not resp.will_close and conn.sock is not None:
            self._release(url, conn)
        else:
            conn.close()

    def _body(self, resp: http.client.HTTPResponse, sock, file: RemoteFile, name: str, offset: int,
              views: list[memoryview], deadline: float) -> int:
        want = sum(len(v) for v in views)
        send = check_head(resp, file, name, offset, want, self.retry.cap)
        if send is None:  # 200: the whole file from byte 0, a server that ignores Range
            raise _Streamed()
        return receive(resp, sock, name, offset, views, deadline, send)

