"""A small HTTP(S) GET client: byte ranges, exact request counts, one deadline per call.

Private: the transport of :mod:`engine.urls.remote`.  Built on :mod:`http.client` (standard
library) rather than :mod:`urllib.request`, so that the client owns each connection and its
socket:

* one request per connection, no ``HEAD``, no read-ahead; redirects followed by hand (a
  bounded number; ``Authorization`` and ``Cookie`` dropped when a redirect leaves the host);
* the environment's proxies (``http_proxy``, ``https_proxy``, ``no_proxy``), as urllib
  reads them; never for loopback addresses;
* a **deadline**: a :class:`Client` is made for one call and ``timeout`` bounds all of it:
  connecting, waiting for each answer and reading each body.  Every socket wait is limited
  to the time left, and a watchdog shuts the socket down when the deadline passes, so a
  server that sends one byte at a time cannot stretch the call.  The error says in which
  phase the time ran out (``.phase``: ``"connect"``, ``"request"``, ``"body"``).
  Name resolution (DNS) is the one wait not bounded: the system resolver cannot be
  interrupted.

Public surface: :class:`Client` (``open``), :class:`Response` (``readinto``, ``read_exact``,
``skip``, ``read_all``, ``close``), :class:`RemoteFileNotFoundError`, :func:`read_error`.
"""

from __future__ import annotations

import base64
import heapq
import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Mapping
from typing import Any

from engine import __version__
from engine.errors import HeaderError, ReadError, RemoteFileNotFoundError, SafetensorError

__all__ = ["Client", "Response", "RemoteFileNotFoundError", "read_error", "content_range", "connection", "status_error",
           "error_code", "error_body", "connect_error", "unreachable", "redirect", "REDIRECTS", "Watchdog",
           "USER_AGENT"]

_CHUNK = 1 << 20
REDIRECTS = (301, 302, 303, 307, 308)
USER_AGENT = f"safetensors-engine/{__version__}"
_SSL_CONTEXT: ssl.SSLContext | None = None


def read_error(message: str, url: str, reason: str, **kw) -> ReadError:
    """A :class:`~engine.errors.ReadError` about ``url``."""
    return ReadError(message, reason=reason, path=url, **kw)


def content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``(first, last, total)`` from ``bytes a-b/T`` or ``bytes */T``; ``None`` where unknown."""
    if not value:
        return None, None, None
    unit, _, spec = value.strip().partition(" ")
    if unit.lower() != "bytes":
        return None, None, None
    span, _, total_s = spec.strip().partition("/")
    total = int(total_s) if total_s.strip().isdigit() else None
    first = last = None
    if "-" in span:
        a, _, b = span.partition("-")
        if a.strip().isdigit() and b.strip().isdigit():
            first, last = int(a), int(b)
    return first, last, total


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _proxy(scheme: str, host: str) -> urllib.parse.SplitResult | None:
    """The environment's proxy for ``scheme://host``, as urllib would choose it."""
    if _is_loopback(host):
        return None
    url = urllib.request.getproxies().get(scheme)
    if not url or urllib.request.proxy_bypass(host):
        return None
    if "://" not in url:
        url = "http://" + url
    return urllib.parse.urlsplit(url)


def _context() -> ssl.SSLContext:
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        _SSL_CONTEXT = ssl.create_default_context()
    return _SSL_CONTEXT


def connection(parts: urllib.parse.SplitResult, timeout: float) -> tuple[http.client.HTTPConnection, str, dict]:
    """An unconnected connection for the http(s) URL ``parts``, through the environment's
    proxy where one applies: ``(connection, request target, extra headers)``.

    Raises ``ValueError`` for a port that is not a number.
    """
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    host = parts.hostname or ""
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    extra: dict[str, str] = {}
    proxy = _proxy(scheme, host)
    conn: http.client.HTTPConnection
    if proxy is not None and proxy.hostname:
        auth = {}
        if proxy.username is not None:
            token = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
            auth["Proxy-Authorization"] = "Basic " + base64.b64encode(token.encode()).decode("ascii")
        proxy_port = proxy.port or 80
        if scheme == "https":
            conn = http.client.HTTPSConnection(proxy.hostname, proxy_port, timeout=timeout, context=_context())
            conn.set_tunnel(host, port, headers=auth)
        else:
            conn = http.client.HTTPConnection(proxy.hostname, proxy_port, timeout=timeout)
            target = urllib.parse.urlunsplit((scheme, parts.netloc, parts.path or "/", parts.query, ""))
            extra = auth
    elif scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    return conn, target, extra


class Watchdog:
    """Shuts a connection's socket down when the deadline passes, waking any blocked read.

    Every watchdog of the process shares one timer thread (a heap of deadlines), so a
    request costs a heap push, not a thread start.
    """

    _heap: list = []
    _cond = threading.Condition()
    _thread: threading.Thread | None = None
    _count = 0

    def __init__(self, deadline: float) -> None:
        self.fired = False
        self.cancelled = False
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        cls = Watchdog
        with cls._cond:
            cls._count += 1
            if len(cls._heap) > 4096:  # requests end long before their deadlines: drop theirs
                cls._heap[:] = [e for e in cls._heap if not e[2].cancelled]
                heapq.heapify(cls._heap)
            heapq.heappush(cls._heap, (deadline, cls._count, self))
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._run, name="engine-watchdog", daemon=True)
                cls._thread.start()
            elif cls._heap[0][2] is self:  # earlier than what the thread sleeps towards
                cls._cond.notify()

    @classmethod
    def _run(cls) -> None:
        with cls._cond:
            while True:
                while cls._heap and cls._heap[0][2].cancelled:
                    heapq.heappop(cls._heap)
                if not cls._heap:
                    cls._cond.wait()
                    continue
                left = cls._heap[0][0] - time.monotonic()
                if left > 0:
                    cls._cond.wait(left)
                    continue
                _, _, dog = heapq.heappop(cls._heap)
                dog._fire()

    def watch(self, sock: socket.socket | None) -> None:
        with self._lock:
            self.sock = sock
            if self.fired:
                self._shutdown()

    def _fire(self) -> None:
        with self._lock:
            if self.cancelled:
                return
            self.fired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self.sock is not None:
            try:
                # the plain socket's shutdown, also under TLS: it only wakes the reader
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        """The request is over: the timer never fires for it (its heap entry goes when it
        reaches the top)."""
        with self._lock:
            self.cancelled = True
            self.sock = None


class Response:
    """One answered GET: status 206 (ranged) or 200 (the whole body from byte 0).

    Attributes
    ----------
    status : int
    partial : bool
        True for 206.
    first, last, total : int or None
        From ``Content-Range`` (206) or ``0, None, Content-Length`` (200).
    content_type : str or None
    etag, last_modified : str or None
        ``ETag`` and ``Last-Modified`` (what tells versions of the file apart).
    length : int or None
        ``Content-Length``.
    """

    def __init__(self, client: Client, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 watchdog: Watchdog, url: str) -> None:
        self._client = client
        self._conn = conn
        self._resp = resp
        self._watchdog = watchdog
        self.url = url  # as the caller named it, for messages
        self.status = resp.status
        self.partial = resp.status == 206
        self.content_type = resp.headers.get("Content-Type")
        self.etag = resp.headers.get("ETag")
        self.last_modified = resp.headers.get("Last-Modified")
        self.date = resp.headers.get("Date")  # when the server answered, by its clock
        self.encoding = (resp.headers.get("Content-Encoding") or "identity").strip().lower()
        length = resp.headers.get("Content-Length")
        self.length = int(length) if length and length.strip().isdigit() else None
        if self.partial:
            self.first, self.last, self.total = content_range(resp.headers.get("Content-Range"))
        else:
            self.first, self.last, self.total = 0, None, self.length
        self.pos = self.first or 0  # file offset of the next byte of the body
        self._kept = False

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, *, force: bool = False) -> None:
        """Hang up: the rest of a 200 body is never read (a body :meth:`keep_open` kept
        stays open until ``close(force=True)``)."""
        self._watchdog.cancel()
        if self._kept and not force:
            return
        self._resp.close()
        self._conn.close()

    def keep_open(self) -> None:
        """Keep a whole-file answer, read up to :attr:`pos`, open beyond its ``with`` block
        for a later read of the same file (no second whole-file request); the watchdog
        stops, each wait is still limited to the call's time left."""
        self._watchdog.cancel()
        self._kept = True

    def detach(self) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The connection and the answer, for a new owner that reads and closes them."""
        self.keep_open()
        return self._conn, self._resp

    def _arm(self) -> None:
        """Limit the next socket wait to the time left of the call."""
        remaining = self._client.deadline - time.monotonic()
        if remaining <= 0 or self._watchdog.fired:
            raise self._client.timeout_error(self.url, "body")
        sock = self._conn.sock
        if sock is not None:
            sock.settimeout(remaining)

    def _failed(self, exc: BaseException, got: int, want: int) -> ReadError:
        if self._watchdog.fired or isinstance(exc, (TimeoutError, socket.timeout)):
            return self._client.timeout_error(self.url, "body")
        return read_error(
            f"the connection failed after {got} of {want} bytes at offset {self.pos}: {exc}",
            self.url, "ConnectionError", offset=self.pos, size=want,
        )

    def check_identity(self) -> None:
        """Byte ranges are only meaningful in an uncompressed body."""
        if self.encoding != "identity":
            raise read_error(
                f"the server compressed the body (Content-Encoding: {self.encoding}) although it was asked "
                "for identity; byte ranges cannot be read from it",
                self.url,
                "HTTPError",
            )

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the body; a body that ends early is an error.

        Copies: one, from the socket into ``view`` (through the response's buffer only for
        what it had already received).
        """
        self.check_identity()
        got, want = 0, len(view)
        while got < want:
            self._arm()
            try:
                n = self._resp.readinto(view[got : min(want, got + _CHUNK)])
            except http.client.IncompleteRead as exc:
                if self._watchdog.fired:
                    raise self._client.timeout_error(self.url, "body") from None
                n = len(exc.partial) if exc.partial else 0
                view[got : got + n] = exc.partial or b""
                got += n
                n = 0
            except (OSError, http.client.HTTPException) as exc:
                raise self._failed(exc, got, want) from None
            if not n:
                if self._watchdog.fired:
                    raise self._client.timeout_error(self.url, "body")
                raise read_error(
                    f"the body ended after {got} of {want} bytes at offset {self.pos} (truncated)",
                    self.url, "ShortRead", offset=self.pos, size=want,
                )
            got += n
        self.pos += want

    def read_exact(self, n: int) -> bytearray:
        """The next ``n`` bytes of the body (read once into the returned buffer)."""
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return buf

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes (a server that ignored Range sends them before the ones wanted)."""
        scratch = memoryview(bytearray(min(n, _CHUNK) or 1))
        while n:
            step = min(n, len(scratch))
            self.readinto(scratch[:step])
            n -= step

    def read_all(self, limit: int, what: str) -> bytes:
        """The whole body, refusing more than ``limit`` bytes (after decompression too)."""
        if self.length is not None and self.length > limit:
            raise read_error(f"{what} is {self.length} bytes, more than the limit of {limit}", self.url, "TooLarge")
        parts, got = [], 0
        while True:
            self._arm()
            try:
                chunk = self._resp.read1(_CHUNK)
            except http.client.IncompleteRead as exc:
                if self._watchdog.fired:
                    raise self._client.timeout_error(self.url, "body") from None
                raise read_error(
                    f"the body ended after {got + len(exc.partial or b'')} bytes (truncated)", self.url, "ShortRead"
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                if self._watchdog.fired or isinstance(exc, (TimeoutError, socket.timeout)):
                    raise self._client.timeout_error(self.url, "body") from None
                raise read_error(f"the connection failed: {exc}", self.url, "ConnectionError") from None
            if not chunk:
                if self._watchdog.fired:
                    raise self._client.timeout_error(self.url, "body")
                break
            got += len(chunk)
            if got > limit:
                raise read_error(f"{what} is larger than the limit of {limit} bytes", self.url, "TooLarge")
            parts.append(chunk)
        data = b"".join(parts)
        if self.length is not None and len(data) != self.length:
            raise read_error(
                f"the body ended after {len(data)} of {self.length} bytes (truncated)", self.url, "ShortRead"
            )
        if self.encoding in ("gzip", "x-gzip", "deflate"):
            # a whole small document (the index) may come compressed despite the request
            try:
                # bounded: a small compressed body must not inflate past the limit
                wbits = 15 if self.encoding == "deflate" else 47
                data = zlib.decompressobj(wbits=wbits).decompress(data, limit + 1)
            except zlib.error as exc:
                raise read_error(f"cannot decompress the {self.encoding} body: {exc}", self.url, "HTTPError") from None
            if len(data) > limit:
                raise read_error(f"{what} is larger than the limit of {limit} bytes", self.url, "TooLarge")
        elif self.encoding != "identity":
            self.check_identity()
        return data


_PHASES = {
    "connect": "connecting to the server",
    "request": "waiting for the server to answer",
    "body": "receiving the body",
}


class Client:
    """GET requests for one call, all within ``timeout`` seconds from the client's creation.

    Parameters
    ----------
    headers : mapping of str to str, optional
        Sent with every request (dropped on a redirect to another host if credentials).
    timeout : float
        Seconds for the whole call: every connection, request and body.
    max_redirects : int
        Redirects followed per request.
    sign : callable, optional
        ``sign(url) -> headers`` added to each request (S3's SigV4 signature).
    """

    def __init__(self, headers: Mapping[str, str] | None, timeout: float, max_redirects: int,
                 sign=None) -> None:
        self.headers = dict(headers or {})
        self.sign = sign  # sign(url) -> headers for each request (S3's SigV4)
        self.timeout = float(timeout)
        self.deadline = time.monotonic() + self.timeout
        self.max_redirects = max_redirects
        # where each URL ended up after redirects, so a file's second request goes straight there
        self.resolved: dict[str, tuple[str, dict[str, str]]] = {}
        # where each URL's last redirect led, whatever the answer there (a folder's URL
        # without its slash is redirected to it), and each answered URL's Content-Type
        self.moved: dict[str, str] = {}
        self.content_types: dict[str, str | None] = {}
        self.lock = threading.Lock()

    def timeout_error(self, url: str, phase: str) -> ReadError:
        """The ``Timeout`` error for ``phase``; ``.phase`` carries it."""
        err = read_error(
            f"the call's timeout of {self.timeout:g} s ran out while {_PHASES[phase]} (timeout, phase: {phase})",
            url,
            "Timeout",
        )
        err.phase = phase  # type: ignore[attr-defined]
        return err

    def open(self, url: str, first: int | None = None, last: int | None = None, *, not_found=None) -> Response:
        """GET ``url`` (bytes ``first..last`` inclusive when given), following redirects."""
        with self.lock:
            current, headers = self.resolved.get(url, (url, self.headers))
        for _ in range(self.max_redirects + 1):
            req_headers = {
                "User-Agent": USER_AGENT, "Accept-Encoding": "identity", "Connection": "close", **headers
            }
            if self.sign is not None:
                req_headers.update(self.sign(current))
            if first is not None:
                req_headers["Range"] = f"bytes={first}-{last}"
            conn, resp, watchdog = self._request(url, current, req_headers)
            if resp.status in REDIRECTS:
                location = resp.headers.get("Location")
                watchdog.cancel()
                resp.close()
                conn.close()
                current, headers = redirect(url, current, headers, location)
                with self.lock:
                    self.moved[url] = current
                continue
            if resp.status not in (200, 206):
                watchdog.cancel()
                try:
                    raise status_error(url, resp, first, not_found, error_code(error_body(resp)))
                finally:
                    resp.close()
                    conn.close()
            with self.lock:
                self.resolved[url] = (current, headers)
                self.content_types[url] = resp.headers.get("Content-Type")
            return Response(self, conn, resp, watchdog, url)
        raise read_error(
            f"more than {self.max_redirects} redirects (a redirect loop?); last location {current}",
            url,
            "TooManyRedirects",
        )

    def _request(self, url: str, current: str, headers: dict[str, str]):
        parts = urllib.parse.urlsplit(current)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise read_error(f"cannot request {current!r}: not an http(s) URL", url, "InvalidURL")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.timeout_error(url, "connect")
        try:
            conn, target, extra = connection(parts, remaining)
        except ValueError as exc:
            raise read_error(f"invalid URL {current!r}: {exc}", url, "InvalidURL") from None
        headers = {**headers, **extra}
        watchdog = Watchdog(self.deadline)
        phase = "connect"
        try:
            conn.connect()
            watchdog.watch(conn.sock)
            phase = "request"
            conn.request("GET", target, headers=headers)
            resp = conn.getresponse()
        except BaseException as exc:
            watchdog.cancel()
            conn.close()
            if isinstance(exc, (OSError, http.client.HTTPException, ValueError)):
                if watchdog.fired or isinstance(exc, (TimeoutError, socket.timeout)) or (
                    self.deadline - time.monotonic() <= 0
                ):
                    raise self.timeout_error(url, phase) from None
                raise connect_error(exc, url) from None
            raise
        return conn, resp, watchdog



def redirect(url: str, current: str, headers: Mapping[str, str], location: str | None) -> tuple[str, dict]:
    """Where a redirect from ``current`` leads, and the headers to send there: credentials
    (``Authorization``, ``Cookie``) are for the host they were given for, as requests does.
    ``url`` names the request in errors."""
    if not location:
        raise read_error("a redirect without a Location header", url, "HTTPError")
    target = urllib.parse.urljoin(current, location)
    parts = urllib.parse.urlsplit(target)
    if parts.scheme not in ("http", "https"):
        raise read_error(f"a redirect to {target!r}, which is not http(s)", url, "HTTPError")
    if parts.netloc != urllib.parse.urlsplit(current).netloc:
        headers = {k: v for k, v in headers.items() if k.lower() not in ("authorization", "cookie")}
    return target, dict(headers)


def connect_error(exc: BaseException, url: str) -> ReadError:
    """The error for a connection that could not be made or used.  A certificate that does
    not verify is ``reason="CertificateError"`` (trying again cannot help; ``SSL_CERT_FILE``
    or the system's trust store decides), anything else ``"ConnectionError"``."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return read_error(f"the server's TLS certificate does not verify: {exc}", url, "CertificateError")
    err = read_error(f"cannot reach the server: {exc}", url, "ConnectionError")
    # nothing listens there, or the name does not resolve: see unreachable()
    err.unreachable = isinstance(exc, (ConnectionRefusedError, socket.gaierror))  # type: ignore[attr-defined]
    if isinstance(exc, OSError) and exc.errno is not None:
        err.errno = exc.errno
    return err


def unreachable(err: BaseException) -> bool:
    """Whether ``err`` says that no server could be reached at all: the connection was
    refused or the host name does not resolve.  At the first request of a call that is the
    answer, and trying again only makes the user wait for it (a server that answered once
    and then refuses is restarting: the bulk reads retry that)."""
    return bool(getattr(err, "unreachable", False))


def error_code(body: bytes) -> str:
    """The ``<Code>`` of an S3-style XML error body (``SlowDown``, ``NoSuchKey``,
    ``SignatureDoesNotMatch`` ...), or ``""``.  Only the code: the body of some errors
    echoes the string that was signed and the access key id."""
    m = re.search(rb"<Code>([A-Za-z0-9.]{1,64})</Code>", body[:65536])
    return m.group(1).decode("ascii") if m else ""


def error_body(resp: http.client.HTTPResponse, limit: int = 65536) -> bytes:
    """A short error body (nothing when it is long or unreadable)."""
    try:
        return resp.read(limit) if resp.length is not None and resp.length <= limit else b""
    except (OSError, http.client.HTTPException):
        return b""


def status_error(url: str, resp: http.client.HTTPResponse, first=None, not_found=None, detail: str = "") -> SafetensorError:
    """The engine's error for an answer that is neither 200/206 nor a redirect; ``.status``
    holds the code.  ``detail`` (an S3 error code, say) is added to the message; no request
    header (and so no credential) ever is."""
    code, text = resp.status, resp.reason
    if detail:
        text = f"{text}: {detail}"
    err: Any
    if code in (404, 410):
        cls = not_found or RemoteFileNotFoundError
        err = cls(f"not found (HTTP {code} {text})", path=url)
    elif code in (401, 403):
        err = read_error(
            f"access denied (HTTP {code} {text}); a private or gated file needs credentials, e.g. "
            "headers={'Authorization': 'Bearer <token>'} over HTTP, or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY for s3://",
            url,
            "AccessDenied",
        )
    elif code == 412:
        err = read_error(
            f"the file changed since the load began (HTTP 412 {text}: its ETag no longer matches)", url, "FileChanged"
        )
    elif code == 416:
        _, _, total = content_range(resp.headers.get("Content-Range"))
        if first == 0 and total is not None and total < 8:
            err = HeaderError(
                f"the file holds {total} bytes, fewer than the 8-byte header length",
                reason="HeaderTooSmall",
                path=url,
            )
        else:
            size = f" (the file holds {total} bytes)" if total is not None else ""
            err = read_error(f"range not satisfiable (HTTP 416){size}", url, "RangeNotSatisfiable")
    else:
        err = read_error(f"HTTP {code} {text}", url, "HTTPError")
    err.status = code
    return err
