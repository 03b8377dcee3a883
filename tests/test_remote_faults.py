"""The one HTTP client (engine.net.remote_reads) under faults, through every entry point: a
seeded campaign (tests/fault_campaign.py; scripts/fault_campaign.py runs it longer) and the
faults it draws, each alone: a stall or an answer for another range in any phase, damaged bytes
read again (a tensor's, a header's), a remote ``get_tensor`` that verifies what it received."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fault_campaign  # noqa: E402
from rangeserver import serving  # noqa: E402

import engine  # noqa: E402
import engine.numpy  # noqa: E402
from engine.errors import ChecksumError  # noqa: E402
from engine.net.retry import Retry  # noqa: E402
from engine.urls import remote  # noqa: E402

FAST = Retry(attempts=5, base=0.005, cap=0.02)


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("faults"))
    tensors = fault_campaign.make_checkpoint(root)
    with serving(root) as server:
        yield root, tensors, server


@pytest.fixture
def server(campaign):
    root, tensors, server = campaign
    server.bulk()
    yield server
    server.faults = {}


def _data_start(root: str, shard: str) -> int:
    with open(os.path.join(root, "campaign", shard), "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _shard(root: str) -> str:
    return sorted(f for f in os.listdir(os.path.join(root, "campaign")) if f.startswith("model-"))[0]


class _Once:
    """A faults callable for the server: ``kind`` at the first GET that ``where(path, first)``
    picks, nothing else; ``hit`` holds that GET's path and first byte."""

    def __init__(self, kind: str, where) -> None:
        self.kind, self.where, self.hit = kind, where, []

    def __call__(self, n, path, first, last):
        if not self.hit and self.where(path, first):
            self.hit.append((path, first))
            return self.kind
        return None


def _damaged(root: str) -> str:
    """A copy of the first shard with its first tensor byte flipped, on the server's disk."""
    shard = _shard(root)
    data = bytearray(open(os.path.join(root, "campaign", shard), "rb").read())
    data[_data_start(root, shard)] ^= 0x40
    with open(os.path.join(root, "campaign", "damaged.safetensors"), "wb") as f:
        f.write(data)
    return "damaged.safetensors"


def test_a_seeded_campaign_gives_up_on_nothing_a_retry_mends(campaign, server, tmp_path):
    """32 runs, 4 per entry point (S3 among them), fault rates from 5% to 30%: every run ends with the file's
    bytes or, after a permanent fault, with a named error; none gives up on a transient fault,
    none hangs, none returns wrong bytes or raises outside the engine's errors, and no file
    descriptor is left open."""
    root, tensors, _ = campaign
    got = fault_campaign.run(server, root, tensors, seed=7, runs=32, scratch=str(tmp_path))
    outcomes = got["outcomes"]
    assert set(outcomes) <= {"exact", "permanent"}, got["details"]
    assert outcomes.get("exact", 0) >= 20, outcomes
    assert all(c.get("exact") for c in got["by_entry"].values()), got["by_entry"]
    assert set(fault_campaign.TRANSIENT) <= set(got["injected"]), got["injected"]  # each kind was met
    assert got["fds_left"] == [], got["fds_left"]


def test_a_stall_on_a_header_request_is_tried_again(campaign, server):
    root, tensors, _ = campaign
    shard = _shard(root)
    server.stall = 1.0
    server.faults_on = "all"
    seen: set = set()

    def stall_once(n, path, first, last):
        if path.endswith(shard) and first in (0, 8) and (path, first) not in seen:
            seen.add((path, first))
            return "slow"
        return None

    server.faults = stall_once
    info = remote.read_metadata(server.url(f"campaign/{shard}"), timeout=0.4, retry=FAST)
    assert sorted(info.headers[shard].names) == sorted(engine.read_header(os.path.join(root, "campaign", shard)).names)
    assert seen == {(f"/campaign/{shard}", 0), (f"/campaign/{shard}", 8)}


@pytest.mark.parametrize("kind", ["other-range", "flip"])
def test_an_answer_for_another_range_or_with_a_damaged_byte_is_read_again(campaign, server, kind):
    """A well-formed answer for another range (``BadRange``), or a tensor's bytes that fail
    their checksum, are asked for once more: the load gets the file's bytes."""
    root, tensors, _ = campaign
    shard = _shard(root)
    start = _data_start(root, shard)
    once = _Once(kind, lambda path, first: first is not None and first >= start)
    server.faults = once
    got = engine.numpy.load_file(server.url(f"campaign/{shard}"), retry=FAST, timeout=5.0)
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, tensors[name])
    asked = [r for r in server.data_requests() if int(r["range"][6:].partition("-")[0]) >= start]
    assert once.hit and len(asked) >= 2  # the damaged range, then again


def test_bytes_damaged_on_the_server_itself_fail_after_a_second_read(campaign, server):
    """The same damaged bytes twice: the file's fault, and the error says two reads agreed."""
    root, tensors, _ = campaign
    damaged = _damaged(root)
    with pytest.raises(ChecksumError) as e:
        engine.numpy.load_file(server.url(f"campaign/{damaged}"), retry=FAST, timeout=5.0)
    assert "the same bytes twice" in str(e.value) and "the file itself is damaged" in str(e.value)
    assert e.value.reason == "ChecksumMismatch"


@pytest.mark.parametrize("first", [0, 8], ids=["the length", "the header's own bytes"])
def test_a_damaged_header_is_read_again(campaign, server, first):
    """A flipped byte in the first 8 bytes (an absurd length), or in the header's own bytes (a
    name, a number: what still parses is caught by the header's recorded CRC): read again."""
    root, tensors, _ = campaign
    shard = _shard(root)
    server.faults_on = "all"
    once = _Once("flip", lambda path, f: path.endswith(shard) and f == first)
    server.faults = once
    header = remote.read_header(server.url(f"campaign/{shard}"), retry=FAST, timeout=5.0)
    assert header.names == engine.read_header(os.path.join(root, "campaign", shard)).names and once.hit


def test_urls_get_tensor_verifies_what_it_received(campaign, server):
    """``engine.urls.remote.get_tensor`` checks the tensor's recorded checksum like every other
    load (it returned damaged bytes before), reading it again once on a mismatch."""
    root, tensors, _ = campaign
    shard = _shard(root)
    start = _data_start(root, shard)
    name = engine.read_header(os.path.join(root, "campaign", shard)).names[0]
    once = _Once("flip", lambda path, first: first is not None and first >= start)
    server.faults = once
    got = remote.get_tensor(server.url(f"campaign/{shard}"), name, retry=FAST, timeout=5.0)
    np.testing.assert_array_equal(got, tensors[name])
    assert once.hit
    server.faults = {}
    with pytest.raises(ChecksumError, match="the same bytes twice"):
        remote.get_tensor(server.url(f"campaign/{_damaged(root)}"), name, retry=FAST, timeout=5.0)


def test_a_header_damaged_on_the_servers_disk_fails_after_two_reads_agree(campaign, server):
    root, tensors, _ = campaign
    shard = _shard(root)
    bad = os.path.join(root, "campaign", "renamed.safetensors")
    data = bytearray(open(os.path.join(root, "campaign", shard), "rb").read())
    name = engine.read_header(os.path.join(root, "campaign", shard)).names[0]
    data[data.index(f'"{name}"'.encode()) + 1] ^= 0x01
    with open(bad, "wb") as f:
        f.write(data)
    with pytest.raises(ChecksumError, match="the same bytes twice") as e:
        remote.read_header(server.url("campaign/renamed.safetensors"), retry=FAST, timeout=5.0)
    assert e.value.reason == "HeaderChecksumMismatch"


def test_a_tensor_damaged_in_a_whole_file_answer_is_read_again_from_the_server(campaign, server):
    """A server that ignores Range: the tensor's bytes come from the file's one stream, and what
    the stream kept is not asked again: the read again goes to the server."""
    root, tensors, _ = campaign
    shard = _shard(root)
    server.modes["*"] = "ignore-range"
    server.faults_on = "all"
    try:
        once = _Once("flip", lambda path, first: path.endswith(shard))
        server.faults = once
        with pytest.warns(engine.RangeIgnoredWarning), \
                engine.safe_open(server.url(f"campaign/{shard}"), framework="np", retry=FAST, timeout=5.0) as f:
            for name in f.keys():
                np.testing.assert_array_equal(f.get_tensor(name), tensors[name])
        assert once.hit
    finally:
        server.modes.clear()


def test_a_tensor_read_again_still_leaves_a_complete_local_copy(campaign, server, tmp_path):
    """With ``cache_dir``, the bytes read again replace the damaged ones in the copy: the copy is
    complete, and the next load reads it without a byte from the server."""
    root, tensors, _ = campaign
    shard = _shard(root)
    start = _data_start(root, shard)
    once = _Once("flip", lambda path, first: first is not None and first >= start)
    server.faults = once
    url = server.url(f"campaign/{shard}")
    got = engine.numpy.load_file(url, retry=FAST, timeout=5.0, cache_dir=str(tmp_path))
    assert once.hit and all(np.array_equal(got[n], tensors[n]) for n in got)
    server.faults = {}
    server.requests.clear()
    again = engine.numpy.load_file(url, retry=FAST, timeout=5.0, cache_dir=str(tmp_path))
    assert all(np.array_equal(again[n], tensors[n]) for n in again)
    assert not [r for r in server.requests if r["range"] and int(r["range"][6:].partition("-")[0]) >= start]
