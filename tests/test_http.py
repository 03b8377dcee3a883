"""engine.net._http: HTTP's parts under the one client (engine.net.remote_reads; its behaviour
against servers is in test_remote.py and test_remote_reads.py): Content-Range parsing, proxies
from the environment, the watchdog."""

from __future__ import annotations

import os
import sys
import time

import pytest

from engine.errors import ReadError
from engine.net._http import content_range
from engine.net.remote_reads import RangeReads
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bytes 0-7/100", (0, 7, 100)),
        ("bytes */100", (None, None, 100)),
        ("bytes 8-15/*", (8, 15, None)),
        ("items 0-1/2", (None, None, None)),
        ("bytes x-y/z", (None, None, None)),
        (None, (None, None, None)),
    ],
)
def test_content_range(value, expected):
    assert content_range(value) == expected


@pytest.fixture
def server(tmp_path):
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 4)
    s = serve(str(tmp_path))
    yield s
    s.stop()


def test_requests_go_through_the_environments_proxy(server, monkeypatch):
    # the test server answers a proxy-style request (absolute URL) for its own files
    monkeypatch.setenv("http_proxy", server.base)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with RangeReads(timeout=5.0) as reads:
        first = reads.first("http://files.example.invalid/f.bin")
        assert first.file.size == 1024 and first.prefix == bytes(range(8))
        got = bytearray(8)
        reads.read(first.file, 4, [memoryview(got)])
        assert got == bytes(range(4, 12))
    assert server.paths() == ["/f.bin", "/f.bin"]


def test_loopback_never_uses_a_proxy(server, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    with RangeReads(timeout=5.0) as reads:
        assert reads.document(server.url("f.bin"), 4096, "the file") == bytes(range(256)) * 4


def test_each_request_has_its_own_deadline_and_a_stall_is_tried_again(server):
    """``timeout`` is each request's: a server that stalls past it is asked again, as every
    transient fault is, and the last try names the timeout."""
    server.modes["/f.bin"] = "slow"
    t0 = time.monotonic()
    with RangeReads(timeout=0.3, retry=Retry(attempts=3, base=0.01, cap=0.02)) as reads, \
            pytest.raises(ReadError) as e:
        reads.first(server.url("f.bin"))
    assert e.value.reason == "Timeout" and "after 3 tries" in str(e.value)
    assert len(server.requests) == 3 and time.monotonic() - t0 < 3


def _socket_pair():
    import socket

    return socket.socketpair()


def test_watchdog_wakes_a_blocked_read_at_its_deadline():
    from engine.net._http import Watchdog

    a, b = _socket_pair()
    try:
        dog = Watchdog(time.monotonic() + 0.2)
        dog.watch(a)
        t0 = time.monotonic()
        assert a.recv(10) == b""  # shut down: the read ends instead of blocking for ever
        assert 0.15 <= time.monotonic() - t0 < 5
        assert dog.fired
    finally:
        a.close()
        b.close()


def test_watchdogs_share_one_thread_and_a_cancelled_one_never_fires():
    import threading

    from engine.net._http import Watchdog

    pairs = [_socket_pair() for _ in range(3)]
    try:
        late = Watchdog(time.monotonic() + 30)
        cancelled = Watchdog(time.monotonic() + 0.1)
        cancelled.watch(pairs[0][0])
        cancelled.cancel()
        # an earlier deadline than the one the timer sleeps towards wakes it
        early = Watchdog(time.monotonic() + 0.2)
        early.watch(pairs[1][0])
        pairs[1][0].settimeout(10)
        assert pairs[1][0].recv(10) == b""
        assert early.fired and not late.fired and not cancelled.fired
        pairs[0][1].sendall(b"x")
        assert pairs[0][0].recv(10) == b"x"  # the cancelled one's socket still works
        many = [Watchdog(time.monotonic() + 60) for _ in range(50)]
        for dog in many:
            dog.cancel()
        late.cancel()
        assert sum(t.name == "engine-watchdog" for t in threading.enumerate()) == 1
    finally:
        for x, y in pairs:
            x.close()
            y.close()
