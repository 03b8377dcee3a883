"""A real HTTP server with Range support for the remote tests, counting what it is asked.

Serves a directory on 127.0.0.1 (ephemeral port).  ``server.modes`` maps a URL path (or
``"*"``) to a misbehaviour, so one server covers the well-behaved and the broken cases:

``ignore-range``   answer 200 with the whole file, whatever the Range
``no-total``       206 with ``Content-Range: bytes a-b/*`` (size unknown)
``no-length``      200 without Content-Length (HTTP/1.0, body until close)
``truncate``       declare the full length, send half, hang up
``416``            always 416 Range Not Satisfiable
``404``            always 404
``slow``           wait (until the test ends) before answering
``delay:S``        wait S seconds before answering each request
``drip``           answer at once, then send the body one byte every 0.25 s
``drip-head``      send the status line and headers one byte every 0.25 s
``redirect:/p``    302 to ``/p`` (``redirect:http://host:port/p`` for another host)
``html``           200 with an HTML error page
``gzip``           200 with the whole file gzip-compressed (Content-Encoding: gzip)

For the bulk reads of a load (:mod:`engine.net.remote_reads`) the server also has:

* ``server.keepalive = True``: HTTP/1.1 with persistent connections (``server.connections``
  counts the connections accepted), so connection pooling is exercised;
* ``server.weak_etags = True``: the ETags are weak (``W/"..."``), which ``If-Match`` never matches;
* ``server.last_modified = True``: a ``Last-Modified`` on every file answer (the file's mtime,
  to the second, as HTTP dates go);
* ``server.etags = True``: an ``ETag`` on every file answer, and ``If-Match`` honoured (a
  mismatch is 412, unless ``server.if_match = False``); ``server.generation += 1`` changes every ETag, as a replaced file would;
* ``server.rate``: bytes per second sent in all, over every connection (a throttled store);
* ``server.faults``: a fault at chosen *data* GETs, those of a ``.safetensors`` file whose
  range starts past its header (numbered from 1 in arrival order, ``server.data_gets``):
  a dict ``{n: kind}`` or a callable ``faults(n, path, first, last) -> kind or None``.
  Kinds: ``reset`` (half the body, then a TCP reset), ``short`` (full length declared, half
  sent, then close), ``slow`` (the head, then a stall of ``server.stall`` seconds
  before the body), ``503``, ``slowdown`` (503 with S3's ``SlowDown`` XML), ``500``, ``403``,
  ``404``, ``change`` (the file's ETag changes before this request is answered), ``grow``
  (``Content-Range`` says the file is one byte longer), ``503-retry`` (503 with
  ``Retry-After: 0``), ``flip`` (the body with one byte flipped: the middle one, moved on by
  one per flip the server made, as damage on the way does not repeat), ``other-range``
  (a well-formed 206 for the range one byte further, or one byte back at the file's end),
  ``gzip`` (the answer compressed although ``identity`` was asked for).  ``server.sent`` records, per data
  GET, ``(n, first, bytes sent)`` of a faulty answer.  With ``server.faults_on = "all"``
  every GET of a file counts (headers, indexes), not only data GETs.
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import io
import os
import re
import shutil
import socket
import struct
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.modes: dict[str, str] = {}
        self.requests: list[dict] = []
        self.aborted = 0  # bodies the client hung up on
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.keepalive = False
        self.connections = 0
        self.etags = False
        self.if_match = True
        self.weak_etags = False  # W/"..." as a CDN may send: If-Match (strong) never matches one
        self.last_modified = False
        self.max_range = 0  # > 0: ranges are answered with at most this many bytes (a capped server)
        self.rate = 0  # > 0: bytes per second the server sends in all, over every connection
        self._sent_at = 0.0  # when the bytes sent so far may all have gone, at ``rate``
        self.generation = 0
        self.faults: dict | object = {}
        self.faults_on = "data"
        self.data_gets = 0
        self.flips = 0
        self.stall = 5.0
        self.sent: list[tuple[int, int, int]] = []
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def base(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}"

    def start(self) -> RangeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        """Quiet about a client that hung up (a reset between requests, an answer cut short):
        the tests make clients do that on purpose, and a traceback among a passing run's dots
        reads as a failure; any other error is printed as the standard library prints it."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.aborted = 0
            self.connections = 0
            self.data_gets = 0
            self.sent.clear()
            self.faults = {}
            self.faults_on = "data"
            self.generation = 0
            self.weak_etags = False
            self.max_range = 0

    def bulk(self) -> RangeServer:
        """:meth:`reset`, then the server the bulk reads of a load expect: keep-alive, ETags
        with ``If-Match`` honoured, a 5 s stall, no mode; returns self (a fixture's value)."""
        self.reset()
        self.modes.clear()
        self.keepalive, self.etags, self.if_match, self.stall = True, True, True, 5.0
        return self

    def etag(self, file: str) -> str:
        st = os.stat(file)
        tag = f'"{st.st_size:x}-{st.st_mtime_ns:x}-{self.generation}"'
        return "W/" + tag if self.weak_etags else tag

    def data_requests(self) -> list[dict]:
        """The data GETs, in arrival order (each with ``n``)."""
        return sorted((r for r in self.requests if r.get("n")), key=lambda r: r["n"])

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]

    def tensor_bytes_asked(self) -> int:
        """Bytes of tensor data asked for so far: of each ranged GET of a ``.safetensors`` file,
        what lies past that file's header."""
        total = 0
        for r in self.requests:
            if not r["range"] or not r["path"].endswith(".safetensors"):
                continue
            with open(os.path.join(self.root, r["path"].lstrip("/")), "rb") as f:
                start = 8 + struct.unpack("<Q", f.read(8))[0]
            a, _, b = r["range"][6:].partition("-")
            total += max(0, int(b) + 1 - max(int(a), start)) if a and b else 0
        return total


class _Handler(BaseHTTPRequestHandler):
    server: RangeServer
    protocol_version = "HTTP/1.0"  # one request per connection, body ends at close

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def setup(self) -> None:
        super().setup()
        self.protocol_version = "HTTP/1.1" if self.server.keepalive else "HTTP/1.0"
        with self.server.lock:
            self.server.connections += 1

    def _fault(self, path: str, file: str, first: int, last: int, record: dict) -> str | None:
        """The fault for this GET if it is a data GET, or any GET of a file with
        ``server.faults_on = "all"`` (see the module doc)."""
        if self.server.faults_on != "all":
            if not path.endswith(".safetensors") or first is None:
                return None
            with open(file, "rb") as f:
                head = f.read(8)
            if len(head) < 8 or first < 8 + struct.unpack("<Q", head)[0]:
                return None
        with self.server.lock:
            self.server.data_gets += 1
            n = self.server.data_gets
        record["n"] = n
        faults = self.server.faults
        return faults(n, path, first, last) if callable(faults) else faults.get(n)  # type: ignore[union-attr]

    def do_HEAD(self) -> None:
        self._record("HEAD")
        self.send_response(405)
        self.end_headers()

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        record = self._record("GET")
        mode = self.server.modes.get(path, self.server.modes.get("*", ""))
        if mode == "slow":
            self.server.release.wait(10)
            return
        if mode.startswith("delay:"):
            self.server.release.wait(float(mode.partition(":")[2]))
        if mode == "drip-head":
            # bounded: at most 400 bytes (100 s), and over as soon as the client hangs up
            head = b"HTTP/1.0 200 OK\r\n" + b"X-Padding: " + b"x" * 300 + b"\r\n\r\n"
            self._drip(io.BytesIO(head), len(head))
            return
        if mode == "404":
            return self._status(404)
        if mode.startswith("redirect:"):
            self.send_response(302)
            self.send_header("Location", mode.partition(":")[2])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode == "html":
            body = b"<!DOCTYPE html><html><body>Sign in to continue</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        file = os.path.join(self.server.root, urllib.parse.unquote(path).lstrip("/"))
        if not os.path.isfile(file):
            return self._status(404)
        size = os.path.getsize(file)
        if mode == "gzip":
            with open(file, "rb") as f:
                body = gzip.compress(f.read())
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if mode == "416":
            return self._status(416, {"Content-Range": f"bytes */{size}"})
        first, last = 0, size - 1
        rng = self.headers.get("Range")
        ranged = rng is not None and mode not in ("ignore-range", "no-length")
        if ranged:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._status(416, {"Content-Range": f"bytes */{size}"})
            if m.group(1):
                first = int(m.group(1))
                last = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                first = max(0, size - int(m.group(2)))
            if first >= size or first > last:
                return self._status(416, {"Content-Range": f"bytes */{size}"})
            if self.server.max_range:  # a server that answers at most this many bytes per range
                last = min(last, first + self.server.max_range - 1)
        fault = self._fault(path, file, first if ranged else None, last, record)
        if fault == "other-range" and ranged:  # a well-formed answer for another range
            shift = 1 if last + 1 < size else -1 if first > 0 else 0
            first, last = first + shift, last + shift
        if fault == "503-retry":
            return self._status(503, {"Retry-After": "0"})
        if fault == "gzip":
            with open(file, "rb") as f:
                f.seek(first)
                body = gzip.compress(f.read(last - first + 1))
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            if ranged:
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.end_headers()
            self.wfile.write(body)
            return
        if fault == "change":
            with self.server.lock:
                self.server.generation += 1
        if fault in ("503", "500", "403", "404"):
            return self._status(int(fault))
        if fault == "slowdown":
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>")
            return self._status(503, body=body)
        etag = self.server.etag(file) if self.server.etags else None
        if_match = self.headers.get("If-Match")
        if etag and if_match and self.server.if_match and (
            if_match.strip() not in ("*", etag) or etag.startswith("W/")  # a weak ETag never matches
        ):
            return self._status(412)
        length = last - first + 1
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Type", "application/octet-stream")
        if mode != "no-length":
            self.send_header("Content-Length", str(length))
        if etag:
            self.send_header("ETag", etag)
        if self.server.last_modified:
            self.send_header("Last-Modified", email.utils.formatdate(os.stat(file).st_mtime, usegmt=True))
        if ranged:
            total = "*" if mode == "no-total" else str(size + (fault == "grow"))
            self.send_header("Content-Range", f"bytes {first}-{last}/{total}")
        trickle = fault == "trickle"  # a hundredth of the body, then the connection closes
        if trickle:
            fault = "short"
        if mode == "no-length" or fault in ("reset", "short", "slow"):
            self.close_connection = True
        self.end_headers()
        send = length // 2 if mode == "truncate" or fault in ("reset", "short") else length
        if trickle:
            send = max(1, length // 100)
        if fault == "slow":
            send = 0
        if fault in ("reset", "short", "slow"):
            with self.server.lock:
                self.server.sent.append((record["n"], first, send))
        if mode == "drip":
            with open(file, "rb") as f:
                f.seek(first)
                self._drip(f, min(send, 400))
            return
        try:
            with open(file, "rb") as f:
                f.seek(first)
                left = send
                flip = -1
                if fault == "flip" and send:  # the body's byte to damage
                    with self.server.lock:
                        flip = (send // 2 + self.server.flips) % send
                        self.server.flips += 1
                while left:
                    chunk = f.read(min(left, 1 << 16))
                    if not chunk:
                        break
                    if 0 <= flip < len(chunk):
                        chunk = chunk[:flip] + bytes([chunk[flip] ^ 0x40]) + chunk[flip + 1:]
                    flip -= len(chunk)
                    self.wfile.write(chunk)
                    self._pace(len(chunk))
                    left -= len(chunk)
            self.wfile.flush()
            if fault == "slow":
                self.server.release.wait(self.server.stall)
            elif fault == "reset":
                # close with SO_LINGER 0: the peer gets a TCP reset, not an orderly end
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
        except (BrokenPipeError, ConnectionResetError):
            with self.server.lock:
                self.server.aborted += 1

    def _pace(self, n: int) -> None:
        """With ``server.rate``, wait until ``n`` more bytes fit the server's rate (one budget
        for every connection: a shared link or a throttled store)."""
        if not self.server.rate:
            return
        with self.server.lock:
            now = time.monotonic()
            self.server._sent_at = max(self.server._sent_at, now) + n / self.server.rate
            wait = self.server._sent_at - now
        if wait > 0:
            self.server.release.wait(wait)

    def _drip(self, source, n: int) -> None:
        """Send ``n`` bytes of ``source`` one at a time, 0.25 s apart; stops when the client
        hangs up or the server stops (every loop here is bounded)."""
        for _ in range(n):
            if self.server.release.wait(0.25):
                return
            try:
                self.wfile.write(source.read(1))
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                with self.server.lock:
                    self.server.aborted += 1
                return

    def _status(self, code: int, headers: dict | None = None, body: bytes = b"") -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if body:
            self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def _record(self, method: str) -> dict:
        record = {
            "method": method,
            "path": urllib.parse.urlsplit(self.path).path,
            "range": self.headers.get("Range"),
            "authorization": self.headers.get("Authorization"),
            "if_match": self.headers.get("If-Match"),
        }
        with self.server.lock:
            self.server.requests.append(record)
        return record


def serve(root: str) -> RangeServer:
    """Start a server on ``root``; call ``.stop()`` when done."""
    return RangeServer(root).start()


@contextlib.contextmanager
def serving(root: str) -> Iterator[RangeServer]:
    """:func:`serve` for a ``with`` block (a module fixture's): stopped at its end."""
    server = serve(root)
    try:
        yield server
    finally:
        server.stop()


def copy_tree(src: str, dst: str) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)
