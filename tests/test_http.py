"""engine._http: the GET client under engine.remote (its behaviour against servers is in
test_remote.py): Content-Range parsing, proxies from the environment, the watchdog."""

from __future__ import annotations

import os
import sys
import time

import pytest

from engine._http import Client, content_range
from engine.errors import ReadError

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
    client = Client({}, 5.0, 0)
    with client.open("http://files.example.invalid/f.bin", 4, 11) as r:
        assert r.partial and (r.first, r.last, r.total) == (4, 11, 1024)
        assert r.read_exact(8) == bytes(range(4, 12))
    assert server.paths() == ["/f.bin"]


def test_loopback_never_uses_a_proxy(server, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    with Client({}, 5.0, 0).open(server.url("f.bin")) as r:
        assert r.read_all(4096, "the file") == bytes(range(256)) * 4


def test_the_deadline_starts_with_the_client(server):
    client = Client({}, 0.3, 0)
    time.sleep(0.35)
    with pytest.raises(ReadError) as e:
        client.open(server.url("f.bin"))
    assert e.value.reason == "Timeout" and e.value.phase == "connect"
    assert server.requests == []
