"""A file whose server ignores Range, read as its one whole-file answer.

Private: the stream of :mod:`engine.net.remote_reads`.  A server that ignores Range
(``python -m http.server``) answers a ranged GET with the whole file (200).  The first such
answer of a file (or the header's, handed over by
:meth:`~engine.net.remote_reads.RangeReads.adopt`) becomes that file's
:class:`WholeFileStream`: every later range of the file is served from it, in file order, and
no second whole-file request is made (unless the stream breaks, or a handle reads again bytes
it did not keep); a :class:`~engine.errors.RangeIgnoredWarning` says so once per file.
"""

from __future__ import annotations

import bisect
import http.client
import os
import socket
import tempfile
import threading
import time
import urllib.parse
import warnings
from typing import Any, Protocol

from engine.errors import Cancelled, RangeIgnoredWarning
from engine.net._http import read_error
from engine.net._response import PIECE, STALL_S, check_head, socket_of
from engine.net.remote_file import RemoteFile, public_url
from engine.net.retry import PROGRESS, Failed, Retry, fail
from engine.net.views import limit_views, skip_views

__all__ = ["WholeFileStream"]


class _Client(Protocol):
    """What a stream asks of the client whose file it serves
    (:class:`~engine.net.remote_reads.RangeReads`): its request settings, its stop, its retry
    count (under its lock), and a new GET from an offset (following redirects)."""

    timeout: float
    retry: Retry
    cancel: threading.Event
    keep: bool
    retries: int
    _lock: threading.Lock

    def _open(self, file: RemoteFile, offset: int | None, last: int | None, deadline: float,
              name: str) -> Any: ...


class WholeFileStream:
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

    def __init__(self, reads: _Client, file: RemoteFile, conn: http.client.HTTPConnection,
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
            k = os.preadv(self.spill.fileno(), limit_views(skip_views(views, got), n - got), offset + got)
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
            except Failed as failed:
                self._hang_up()
                done += failed.landed
                if not failed.transient:
                    raise failed.error from None
                tries = 0 if failed.landed >= PROGRESS else tries + 1
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
            whole = check_head(resp, file, self.name, offset, file.size - offset, reads.retry.cap) is None
        except Failed:
            resp.close()
            conn.close()
            raise
        pos = 0 if whole else offset
        self.answers += whole
        self.conn, self.resp, self.pos = conn, resp, pos

    def _skip_to(self, offset: int) -> None:
        """Receive the body up to ``offset`` into the temporary file.  A failure here has
        landed none of the caller's bytes: its :class:`Failed` says 0, whatever the scratch
        buffer received."""
        scratch: memoryview | None = None
        while self.pos < offset:
            if scratch is None:
                scratch = memoryview(bytearray(min(offset - self.pos, 1 << 20)))
            piece = scratch[: min(offset - self.pos, len(scratch))]
            try:
                self._recv([piece], keep=False)
            except Failed as failed:
                failed.landed = 0  # the scratch's bytes, not the views': _receive must not count them
                raise
            self._keep(self.pos - len(piece), [piece])

    def _recv(self, views: list[memoryview], keep: bool | None = None) -> int:
        """Receive the next bytes of the body into ``views``; raises :class:`Failed` (with
        the bytes landed) when the body fails or ends early."""
        resp, want = self.resp, sum(len(v) for v in views)
        assert resp is not None and self.conn is not None
        sock = socket_of(resp)
        landed = 0
        for view in views:
            got = 0
            while got < len(view):
                if sock is not None:
                    sock.settimeout(min(STALL_S, self.reads.timeout))
                try:
                    n = resp.readinto(view[got : got + PIECE])
                except (OSError, http.client.HTTPException) as exc:
                    timed_out = isinstance(exc, (TimeoutError, socket.timeout))
                    raise fail(
                        self.name, self.pos, want - landed - got, "Timeout" if timed_out else "ConnectionError",
                        f"no byte of the body within {self.reads.timeout:g} s" if timed_out
                        else f"the connection failed: {exc}", landed + got) from None
                if not n:
                    raise fail(self.name, self.pos, want - landed - got, "ShortRead",
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
