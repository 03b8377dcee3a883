"""HTTP's parts that every request of :mod:`engine.net.remote_reads` (the one client) uses.

Private.  Built on :mod:`http.client` (standard library) rather than :mod:`urllib.request`,
so that the client owns each connection and its socket:

* connections through the environment's proxies (``http_proxy``, ``https_proxy``,
  ``no_proxy``), as urllib reads them; never for loopback addresses (:func:`connection`);
* redirects followed by hand (:func:`redirect`: ``Authorization`` and ``Cookie`` dropped when
  a redirect leaves the host);
* a :class:`Watchdog` that shuts a socket down when its request's deadline passes, so that a
  server that sends one byte at a time cannot stretch a request;
* the engine's errors for answers (:func:`status_error`, :func:`connect_error`,
  :func:`read_error`) and ``Content-Range`` parsing.
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
from collections.abc import Mapping
from typing import Any

from engine import __version__
from engine.errors import HeaderError, ReadError, RemoteFileNotFoundError, SafetensorError

__all__ = ["RemoteFileNotFoundError", "read_error", "content_range", "connection", "status_error",
           "error_code", "header_code", "error_body", "connect_error", "unreachable", "redirect", "REDIRECTS", "Watchdog",
           "USER_AGENT"]

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


def header_code(resp: http.client.HTTPResponse) -> str:
    """The error code an answer names in a header: Azure's ``x-ms-error-code``
    (``ServerBusy``, ``AuthenticationFailed`` ...) or the Hub's ``X-Error-Code``
    (``GatedRepo``, ``RepoNotFound`` ...), or ``""``."""
    for name in ("x-ms-error-code", "X-Error-Code"):
        value = (resp.getheader(name) or "").strip()
        if re.fullmatch(r"[A-Za-z0-9.]{1,64}", value):
            return value
    return ""


def error_body(resp: http.client.HTTPResponse, limit: int = 65536) -> bytes:
    """A short error body (nothing when it is long or unreadable)."""
    try:
        return resp.read(limit) if resp.length is not None and resp.length <= limit else b""
    except (OSError, http.client.HTTPException):
        return b""


_HTTP_HINT = ("a private or gated file needs credentials, e.g. headers={'Authorization': 'Bearer <token>'} over "
              "HTTP, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3://")
#: what gives each object store the credentials of a private file (the README's table)
_CREDENTIALS = {
    "s3": "a private bucket needs credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role",
    "gs": "a private bucket needs credentials: GOOGLE_OAUTH_ACCESS_TOKEN (e.g. `gcloud auth print-access-token`), "
          "GOOGLE_APPLICATION_CREDENTIALS, or `gcloud auth application-default login`",
    "hf": "a gated or private repo needs a token with access to it: set HF_TOKEN, or run `huggingface-cli login`",
    "az": "a private container needs credentials: AZURE_STORAGE_SAS_TOKEN, AZURE_STORAGE_ACCOUNT and "
          "AZURE_STORAGE_KEY, AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_TOKEN",
}


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
        err = read_error(f"access denied (HTTP {code} {text}); {_CREDENTIALS.get(url.partition('://')[0], _HTTP_HINT)}",
                         url, "AccessDenied")
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
