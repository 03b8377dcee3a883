"""One answer to a ranged GET: its head checked against the file, its body received into views.

Private: the answer's side of :mod:`engine.net.remote_reads` (the client sends the request
and retries) and of :mod:`engine.net._whole_file`.  The head of an answer must be the file
whose header was read (status, ETag, size), uncompressed, and for the range asked
(``Content-Range``) (:func:`check_head`); the body goes from the socket straight into the
destination views (``readinto``, GIL released), each wait limited to the request's time left
(:func:`receive`).  Every failure is a :class:`~engine.net.retry.Failed` that says how many
bytes landed and whether trying again may help.
"""

from __future__ import annotations

import http.client
import socket
import time

from engine.net._http import content_range, error_body, error_code, header_code, status_error
from engine.net.remote_file import RemoteFile
from engine.net.retry import Failed, fail, retry_after, transient_answer

__all__ = ["PIECE", "STALL_S", "arm", "check_head", "check_identity", "discard", "receive", "socket_of",
           "status_failure"]

STALL_S = 30.0  # longest single socket wait, so a deadline check comes round often
PIECE = 4 << 20  # bytes per receive call, so the deadline is checked between them
_ERROR_BODY = 65536


def socket_of(resp: http.client.HTTPResponse) -> socket.socket | None:
    """The socket an answer reads its body from.  Its connection lets go of it (``sock`` is
    None) once the server says it will close, as ``http.server`` and every answer to a
    ``Connection: close`` request do; the answer still reads from it."""
    return getattr(getattr(resp.fp, "raw", None), "_sock", None)


def discard(resp: http.client.HTTPResponse) -> None:
    """Finish a response the caller does not want: read a short body, else hang up."""
    try:
        if resp.length is not None and resp.length <= _ERROR_BODY:
            resp.read()
        else:
            resp.close()
    except (OSError, http.client.HTTPException):
        resp.close()


def check_head(resp: http.client.HTTPResponse, file: RemoteFile, name: str, offset: int, want: int,
               cap: float) -> int | None:
    """Check the head of an answer to a GET of ``want`` bytes from ``offset``: the bytes
    a 206 sends, or None for a 200 (the whole file, a server that ignores Range); raises
    :class:`~engine.net.retry.Failed` for an error status (after its ``Retry-After``, up to
    ``cap``), another version of the file, a compressed body or a range other than the one
    asked for."""
    if resp.status not in (200, 206):
        raise status_failure(resp, name, offset, want, cap)
    etag = resp.getheader("ETag")
    if file.etag and etag and etag != file.etag:
        discard(resp)
        raise fail(name, offset, want, "FileChanged",
                   f"the file changed since its header was read (ETag {file.etag}, now {etag})",
                   0, transient=False)
    check_identity(resp, name, offset, want)
    if resp.status == 206:
        first, lastb, total = content_range(resp.getheader("Content-Range"))
        if total is not None and total != file.size:
            discard(resp)
            raise fail(name, offset, want, "FileChanged",
                       f"the file changed since its header was read ({file.size} bytes, now {total})",
                       0, transient=False)
        if first != offset or lastb is None or lastb < first:
            discard(resp)
            raise fail(name, offset, want, "BadRange",
                       f"asked for bytes {offset}-{offset + want - 1}, the server sent {first}-{lastb}", 0)
        return min(want, lastb - first + 1)
    # 200: the whole file from byte 0
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) != file.size:
        discard(resp)
        raise fail(name, offset, want, "FileChanged",
                   f"the file changed since its header was read ({file.size} bytes, now {length})",
                   0, transient=False)
    return None


def status_failure(resp: http.client.HTTPResponse, name: str, offset: int, want: int, cap: float,
                   not_found: type | None = None) -> Failed:
    """The failure of an error answer (its body read when short, for S3's code): transient
    for a busy or failing server, after its ``Retry-After`` (at most ``cap``)."""
    # S3 and GCS name the error in an XML body; Azure also in a header, the Hub only there
    detail = error_code(error_body(resp)) or header_code(resp)
    err = status_error(name, resp, offset, not_found, detail=detail)
    if want:
        err.message = f"bytes {offset}-{offset + want - 1}: {err.message}"
        err.args = (err.message,)
        err.offset, err.size = offset, want  # type: ignore[attr-defined]
    transient = transient_answer(resp.status, detail)
    return Failed(err, 0, transient, retry_after(resp, cap) if transient else 0.0)


def check_identity(resp: http.client.HTTPResponse, name: str, offset: int, want: int) -> None:
    """Byte ranges mean nothing in a compressed body: one sent against ``Accept-Encoding:
    identity`` fails (a server that does so does it every time)."""
    encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        discard(resp)
        raise fail(name, offset, want, "HTTPError",
                   f"the server compressed the body (Content-Encoding: {encoding}) although it was asked "
                   "for identity; byte ranges cannot be read from it", 0, transient=False)


def receive(resp: http.client.HTTPResponse, sock, name: str, offset: int, views: list[memoryview],
            deadline: float, send: int) -> int:
    """Receive the first ``send`` bytes of the body into ``views``: the bytes landed, or
    :class:`~engine.net.retry.Failed` with them."""
    want = sum(len(v) for v in views)
    landed = 0
    for view in views:
        if landed >= send:
            break
        view = view[: send - landed]
        got = 0
        while got < len(view):
            arm(sock, deadline, name, offset, want, landed + got)
            try:
                n = resp.readinto(view[got : got + PIECE])
            except http.client.IncompleteRead as exc:
                n = len(exc.partial or b"")
                view[got : got + n] = exc.partial or b""
                got += n
                raise fail(name, offset, want, "ShortRead",
                           f"the body ended after {landed + got} of {send} bytes", landed + got) from None
            except (OSError, http.client.HTTPException) as exc:
                timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline
                raise fail(name, offset, want, "Timeout" if timed_out else "ConnectionError",
                           "the request's deadline passed while receiving the body" if timed_out
                           else f"the connection failed after {landed + got} of {send} bytes: {exc}",
                           landed + got) from None
            if not n:
                if time.monotonic() >= deadline:  # the watchdog shut the socket down
                    raise fail(name, offset, want, "Timeout",
                               "the request's deadline passed while receiving the body", landed + got)
                raise fail(name, offset, want, "ShortRead",
                           f"the body ended after {landed + got} of {send} bytes (truncated)", landed + got)
            got += n
        landed += got
    return landed


def arm(sock, deadline: float, name: str, offset: int, want: int, landed: int) -> None:
    """Limit the socket's next wait to the request's time left (at most :data:`STALL_S`);
    a deadline already passed fails the try with the ``landed`` bytes."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise fail(name, offset, want, "Timeout",
                   "the request's deadline passed while receiving the body", landed)
    if sock is not None:
        sock.settimeout(min(STALL_S, remaining))
