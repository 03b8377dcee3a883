"""engine.net.remote_reads against a real HTTP server on localhost (tests/rangeserver.py) that
keeps connections alive, sends ETags and fails chosen requests on purpose, and against the
standard library's http.server, which ignores Range."""

from __future__ import annotations

import os
import struct
import sys
import threading
import time
import traceback
import warnings

import numpy as np
import pytest

from engine.errors import RangeIgnoredWarning, ReadError, RemoteFileNotFoundError
from engine.net.remote_file import RemoteFile, public_url
from engine.net.remote_reads import RangeReads
from engine.net.retry import Retry
from engine.numpy import save_file

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve, serving  # noqa: E402
from servers import StdlibHTTP  # noqa: E402

FAST = Retry(attempts=3, base=0.001, cap=0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    rng = np.random.default_rng(7)
    path = root / "model.safetensors"
    save_file({"w": rng.integers(0, 256, 1 << 20, dtype=np.uint8)}, str(path))
    data = path.read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    server = serve(str(root))
    yield server, data, start
    server.stop()


@pytest.fixture
def server(served):
    srv = served[0]
    srv.reset()
    srv.keepalive, srv.etags, srv.if_match, srv.stall = True, True, True, 5.0
    yield srv
    srv.faults = {}
    srv.release.set()  # end any stall this test left behind
    srv.release.clear()


def remote(server, data) -> RemoteFile:
    return RemoteFile(server.url("model.safetensors"), len(data), server.etag(os.path.join(server.root,
                                                                                         "model.safetensors")))


def read(reads: RangeReads, file: RemoteFile, offset: int, size: int, pieces: int = 1) -> bytes:
    """Read ``size`` bytes at ``offset`` into ``pieces`` separate views; return them joined."""
    cuts = [size * i // pieces for i in range(pieces + 1)]
    bufs = [bytearray(b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    reads.read(file, offset, [memoryview(b) for b in bufs])
    return b"".join(bufs)


def text(err: BaseException) -> str:
    """Everything a user could see of an error: message, repr, args and the traceback."""
    return "\n".join([str(err), repr(err), repr(err.args), "".join(traceback.format_exception(err))])


# -- byte-exact reads and connections -------------------------------------------------------------
@pytest.mark.parametrize("keepalive", [True, False])
def test_reads_land_byte_exact_in_the_views(served, server, keepalive):
    _, data, start = served
    server.keepalive = keepalive
    file = remote(server, data)
    reads = RangeReads(connections=1, retry=FAST)
    spans = [(start, 1000, 1), (start + 5, 65536 + 3, 3), (len(data) - 777, 777, 2), (0, 8, 1), (start, 12345, 5)]
    try:
        for offset, size, pieces in spans:
            assert read(reads, file, offset, size, pieces) == data[offset : offset + size]
        bufs = [bytearray(0), bytearray(10), bytearray(0), bytearray(6)]  # empty views are skipped
        reads.read(file, start, [memoryview(b) for b in bufs])
        assert b"".join(bufs) == data[start : start + 16]
    finally:
        reads.close()
    assert reads.requests == len(spans) + 1 and reads.retries == 0
    # one thread: a single keep-alive connection serves every request; without keep-alive
    # each closed connection is dropped, never reused
    assert server.connections == (1 if keepalive else len(spans) + 1)
    assert all(r["if_match"] == file.etag for r in server.requests)


def test_connections_are_reused_across_worker_threads(served, server):
    _, data, start = served
    file = remote(server, data)
    reads = RangeReads(connections=4, retry=FAST)
    size = (len(data) - start) // 40
    out = bytearray(40 * size)

    def work(i):
        for k in range(i, 40, 4):
            reads.read(file, start + k * size, [memoryview(out)[k * size : (k + 1) * size]])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reads.close()
    assert bytes(out) == data[start : start + 40 * size]
    assert reads.requests == 40 and len(server.requests) == 40
    assert server.connections <= 4  # at most one per worker thread, not one per request


def test_a_read_past_the_end_fails_before_any_request(served, server):
    _, data, _ = served
    with pytest.raises(ReadError) as err:
        read(RangeReads(), remote(server, data), len(data) - 10, 20)
    assert err.value.reason == "ShortRead" and "past the end" in str(err.value)
    assert server.requests == []


# -- retries ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["short", "reset"])
def test_a_body_cut_short_is_retried_for_the_missing_bytes_only(served, server, kind):
    _, data, start = served
    server.faults = {1: kind}
    file = remote(server, data)
    reads = RangeReads(retry=FAST)
    offset, size = start + 100, 300_000
    assert read(reads, file, offset, size, pieces=3) == data[offset : offset + size]
    reads.close()
    assert reads.retries == 1
    first, retry = server.data_requests()
    (n, at, sent), = server.sent
    assert n == 1 and at == offset and first["range"] == f"bytes={offset}-{offset + size - 1}"
    resumed = int(retry["range"][6:].split("-")[0])
    assert retry["range"].endswith(f"-{offset + size - 1}")
    if kind == "short":  # an orderly end: every byte sent had landed
        assert resumed == offset + sent
    else:  # a reset may drop what the kernel held, never ask again for what landed
        assert offset <= resumed <= offset + sent


@pytest.mark.parametrize("kind", ["503", "slowdown", "500"])
def test_transient_statuses_are_retried(served, server, kind):
    _, data, start = served
    server.faults = {1: kind, 2: kind}
    reads = RangeReads(retry=FAST)
    assert read(reads, remote(server, data), start, 5000) == data[start : start + 5000]
    reads.close()
    got = server.data_requests()
    assert reads.retries == 2 and len(got) == 3
    assert {r["range"] for r in got} == {f"bytes={start}-{start + 4999}"}


def test_retries_exhausted_say_how_many_tries(served, server):
    _, data, start = served
    server.faults = lambda n, path, first, last: "slowdown"
    url = server.url("model.safetensors")
    with pytest.raises(ReadError) as err:
        read(RangeReads(retry=FAST), remote(server, data), start, 100)
    assert "after 3 tries" in str(err.value) and "SlowDown" in str(err.value)
    assert url in str(err.value) and f"bytes {start}-{start + 99}" in str(err.value)
    assert len(server.data_requests()) == 3


def test_a_stalled_body_times_out_within_the_deadline(served, server):
    _, data, start = served
    server.faults = lambda n, path, first, last: "slow"
    timeout = 0.3
    reads = RangeReads(timeout=timeout, retry=Retry(attempts=2, base=0.001, cap=0.01))
    began = time.monotonic()
    with pytest.raises(ReadError) as err:
        read(reads, remote(server, data), start, 50_000)
    took = time.monotonic() - began
    assert err.value.reason == "Timeout" and "after 2 tries" in str(err.value)
    assert took < 10 * 2 * timeout  # generous: the stall itself is server.stall = 5 s
    assert len(server.data_requests()) == 2


def test_one_stalled_request_is_retried(served, server):
    _, data, start = served
    server.faults = {1: "slow"}
    reads = RangeReads(timeout=0.3, retry=FAST)
    assert read(reads, remote(server, data), start, 50_000) == data[start : start + 50_000]
    assert reads.retries == 1


# -- permanent failures ----------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "cls", "reason"), [
    ("403", ReadError, "AccessDenied"),
    ("404", RemoteFileNotFoundError, "NotFound"),
    ("change", ReadError, "FileChanged"),  # the ETag moved: If-Match answers 412
    ("grow", ReadError, "FileChanged"),  # Content-Range says another size
])
def test_permanent_failures_fail_at_once_naming_url_and_range(served, server, kind, cls, reason):
    _, data, start = served
    server.faults = {1: kind}
    file = remote(server, data)
    reads = RangeReads(retry=Retry(attempts=6, base=0.001))
    with pytest.raises(cls) as err:
        read(reads, file, start + 10, 4000)
    message = str(err.value)
    assert err.value.reason == reason
    assert server.url("model.safetensors") in message and f"bytes {start + 10}-{start + 4009}" in message
    assert len(server.data_requests()) == 1 and reads.retries == 0


def test_a_changed_file_is_caught_by_its_etag_where_if_match_is_ignored(served, server):
    """A server that ignores If-Match answers 206 with the new ETag: that is checked too."""
    _, data, start = served
    server.if_match = False
    server.faults = {1: "change"}
    with pytest.raises(ReadError) as err:
        read(RangeReads(retry=FAST), remote(server, data), start, 100)
    assert err.value.reason == "FileChanged" and "ETag" in str(err.value)
    assert len(server.data_requests()) == 1


def test_a_weak_etag_is_never_sent_in_if_match_but_still_compared(served, server):
    """If-Match compares strongly, so a weak ETag would fail every request with 412: it is
    left out of the request, and the answer's ETag still tells a replaced file."""
    _, data, start = served
    server.weak_etags = True
    file = remote(server, data)
    assert file.etag.startswith("W/")
    assert read(RangeReads(retry=FAST), file, start, 5000, pieces=3) == data[start : start + 5000]
    assert all(r["if_match"] is None for r in server.data_requests())
    server.faults = {len(server.data_requests()) + 1: "change"}
    with pytest.raises(ReadError) as err:
        read(RangeReads(retry=FAST), file, start, 100)
    assert err.value.reason == "FileChanged"


def test_a_server_that_fails_every_body_early_runs_out_of_tries(served, server):
    """Each answer sends a hundredth of what is asked, then hangs up: every try lands bytes,
    but less than a MiB or half of what is left counts as no progress, so the tries run out
    instead of creeping forward a hundredth at a time."""
    _, data, start = served
    server.faults = lambda *request: "trickle"
    reads = RangeReads(retry=Retry(attempts=3, base=0.001, cap=0.002))
    with pytest.raises(ReadError) as err:
        read(reads, remote(server, data), start, 400_000)
    assert "after 3 tries" in str(err.value) and err.value.reason == "ShortRead"
    assert len(server.data_requests()) == 3


def test_a_server_that_caps_its_ranges_is_asked_for_the_rest_at_once(served, server):
    """206 answers shorter than asked are not failures: the rest is requested right away,
    with no backoff and no try counted."""
    _, data, start = served
    server.max_range = 16_384
    reads = RangeReads(retry=Retry(attempts=2, base=10.0, cap=10.0))  # any backoff would take seconds
    assert read(reads, remote(server, data), start, 100_000, pieces=3) == data[start : start + 100_000]
    assert len(server.data_requests()) == 7 and reads.retries == 0


def test_a_body_dripped_a_byte_at_a_time_still_ends_at_the_deadline(served, server):
    """Each byte arrives well within the socket's wait limit, so only the request's
    deadline (the watchdog) can end the read: 4000 bytes at 4 per second would take 1000 s."""
    _, data, start = served
    server.modes["/model.safetensors"] = "drip"
    reads = RangeReads(timeout=1.0, retry=Retry(attempts=1, base=0.001, cap=0.001))
    began = time.monotonic()
    try:
        with pytest.raises(ReadError) as err:
            read(reads, remote(server, data), start, 4000)
    finally:
        del server.modes["/model.safetensors"]  # the server is shared by the module's tests
    assert err.value.reason == "Timeout" and time.monotonic() - began < 10


# -- URLs and credentials in messages --------------------------------------------------------------
def test_public_url_strips_user_and_password():
    assert public_url("https://alice:s3cr3t@example.com:8443/a/b?x=1#f") == "https://example.com:8443/a/b?x=1#f"
    assert public_url("https://alice@example.com/m") == "https://example.com/m"
    assert public_url("https://example.com/m") == "https://example.com/m"
    assert public_url("http://alice:pw@[::1]:8080/m") == "http://[::1]:8080/m"  # brackets kept
    assert public_url("http://alice:pw@[fe80::1]/m") == "http://[fe80::1]/m"


def test_errors_name_the_url_without_its_password(served, server):
    _, data, start = served
    server.faults = {1: "403"}
    url = server.url("model.safetensors").replace("http://", "http://alice:pa55w0rd@")
    with pytest.raises(ReadError) as err:
        read(RangeReads(retry=FAST), RemoteFile(url, len(data)), start, 100)
    assert "pa55w0rd" not in text(err.value) and server.url("model.safetensors") in str(err.value)


def test_retry_delay_is_full_jitter_within_its_cap():
    retry = Retry(attempts=6, base=0.1, cap=2.0)
    for attempt in range(8):
        bound = min(retry.cap, retry.base * 2**attempt)
        samples = [retry.delay(attempt) for _ in range(300)]
        assert all(0.0 <= d <= bound for d in samples)
        assert max(samples) > bound / 2  # jitter spans the range (chance of failing: 2**-300)


@pytest.mark.parametrize("kind", ["403", "404", "short", "slowdown"])
def test_credentials_never_appear_in_errors(served, server, monkeypatch, kind):
    pytest.importorskip("botocore", reason="S3 signing needs botocore (the s3 extra)")
    from engine.net._s3 import S3Config

    _, data, start = served
    secret, key_id, token = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY", "AKIAIOSFODNN7EXAMPLE", "hf_TOKENVALUE12345"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull + "-none")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull + "-none")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.base)
    config = S3Config()
    assert config.signed and secret not in repr(config) and key_id not in repr(config)
    server.faults = lambda n, path, first, last: kind
    reads = RangeReads(retry=Retry(attempts=2, base=0.001), headers={"Authorization": f"Bearer {token}"},
                       sign=config.headers)
    with pytest.raises(ReadError) as err:
        read(reads, remote(server, data), start, 1000)
    seen = text(err.value)
    assert all(s not in seen for s in (secret, key_id, token)), seen
    auth = [r["authorization"] for r in server.requests]
    assert auth and all(a and key_id in a for a in auth)  # the signature was sent, and only there


# -- read_runs: neighbouring runs share a request --------------------------------------------------
def test_read_runs_groups_neighbours_and_drops_the_gaps():
    from engine.net.views import read_runs

    data = bytes(range(256)) * 64
    calls = []

    def fake_read(offset, views):
        calls.append((offset, [len(v) for v in views]))
        pos = offset
        for v in views:
            v[:] = data[pos : pos + len(v)]
            pos += len(v)

    src = [0, 100, 200, 5000, 5010]  # runs of 10: three close, then a far pair
    dst = bytearray(50)
    n = read_runs(fake_read, memoryview(dst), src, 10, 7, max_gap=1000)
    assert bytes(dst) == b"".join(data[7 + s : 7 + s + 10] for s in src)
    assert n == 2 and [c[0] for c in calls] == [7, 5007]
    assert calls[0][1] == [10, 90, 10, 90, 10] and calls[1][1] == [10, 10]
    # a span limit splits a group; no gap at all is one view per run, no scratch
    calls.clear()
    read_runs(fake_read, memoryview(bytearray(50)), src, 10, 7, max_gap=1000, max_span=150)
    assert [c[0] for c in calls] == [7, 207, 5007]


# -- servers that ignore Range: one whole-file answer per file ------------------------------------
def test_a_whole_file_answer_serves_every_range_of_the_file_in_any_order(served, server):
    """The first 200 becomes the file's stream: threads asking in any order get their bytes
    from it (those passed before they were asked for from the temporary file), with no
    second whole-file request."""
    _, data, start = served
    server.modes["*"] = "ignore-range"
    file = remote(server, data)
    reads = RangeReads(connections=4, retry=FAST)
    size = (len(data) - start) // 16
    out = bytearray(16 * size)
    order = [15, 3, 0, 7, 1, 2, 14, 4, 5, 13, 8, 9, 12, 10, 11]  # late ones first

    def work(i):
        for k in order[i::4]:
            reads.read(file, start + k * size, [memoryview(out)[k * size : (k + 1) * size]])

    try:
        with pytest.warns(RangeIgnoredWarning, match="ignores Range") as warned:
            # one read first (requests sent together before any answer each get the whole
            # file, and all but one are hung up on at once), then the rest from four threads
            reads.read(file, start + 6 * size, [memoryview(out)[6 * size : 7 * size]])
            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            # bytes the stream received into a read's views are not kept: asked again, they
            # cost a new answer; those it passed before they were asked for are kept
            again = start + 6 * size + 5
            got = read(reads, file, again, 100)
    finally:
        reads.close()
        server.modes.pop("*", None)  # reset() leaves modes as they are; the server is the module's
    assert bytes(out) == data[start : start + 16 * size] and got == data[again : again + 100]
    assert len(warned) == 1
    gets = [r for r in server.requests if r["method"] == "GET"]
    assert len(gets) == 2  # the stream, and the one read of bytes it had passed


def test_a_whole_file_answer_that_breaks_before_the_range_lands_none_of_its_bytes(served, server):
    """The stream's first answer ends early while it is still passing the bytes before the
    range asked for: the range is read whole from the next answer (it once counted the
    passed bytes as its own, and handed out zeros for them)."""
    _, data, start = served
    server.modes["*"] = "ignore-range"
    server.faults_on, server.faults = "all", {1: "short"}  # the first GET sends half the file, then closes
    try:
        file = remote(server, data)
        reads = RangeReads(connections=1, retry=FAST)
        offset = len(data) * 3 // 4  # past the half the broken answer sends
        with pytest.warns(RangeIgnoredWarning):
            got = read(reads, file, offset, 1000)
        reads.close()
    finally:
        server.faults_on = "data"
        server.modes.pop("*", None)  # reset() leaves modes as they are
    assert got == data[offset : offset + 1000]
    assert len([r for r in server.requests if r["method"] == "GET"]) == 2


def test_a_whole_file_stream_checks_its_new_answer_as_any_range(served, server):
    """The stream breaks and its new answer comes compressed: refused as a compressed body
    (the check every ranged answer gets), not taken for another version of the file."""
    _, data, start = served
    server.modes["*"] = "ignore-range"

    def faults(n, path, first, last):
        if n == 1:
            server.modes["*"] = "gzip"  # the next answer
            return "short"
        return None

    server.faults_on, server.faults = "all", faults
    try:
        reads = RangeReads(connections=1, retry=FAST)
        with pytest.warns(RangeIgnoredWarning), pytest.raises(ReadError) as err:
            read(reads, remote(server, data), len(data) * 3 // 4, 1000)
        reads.close()
    finally:
        server.faults_on = "data"
        server.modes.pop("*", None)  # reset() leaves modes as they are
    assert err.value.reason == "HTTPError" and "compressed" in str(err.value)


def test_a_load_from_http_server_is_one_transfer_of_the_file_and_one_warning(tmp_path):
    """The standard library's http.server answers every ranged GET with the whole file: a
    load of a file that needs many ranges costs one GET and about the file's bytes (the
    header's request goes on into the tensors), and warns once, naming the server."""
    import engine.numpy

    rng = np.random.default_rng(3)
    sd = {f"w{i:02d}": rng.standard_normal(60_000).astype(np.float32) for i in range(24)}
    path = tmp_path / "m.safetensors"
    save_file(sd, str(path))
    size = path.stat().st_size  # 5.8 MB: 23 ranges of 256 KiB
    with StdlibHTTP(str(tmp_path)) as srv, pytest.warns(RangeIgnoredWarning) as warned:
        got = engine.numpy.load_file(srv.url("m.safetensors"), chunk_bytes=256 << 10, connections=4)
    assert all(np.array_equal(got[k], sd[k]) for k in sd)
    sent = sum(srv.sent.values())
    assert srv.gets == ["/m.safetensors"] and sent <= 1.05 * size, (srv.gets, sent, size)
    assert len(warned) == 1 and "SimpleHTTP" in str(warned[0].message) and "m.safetensors" in str(warned[0].message)


@pytest.mark.parametrize("entry", ["stream", "load_into", "safe_open", "get_tensor", "tensor_parallel", "cache_dir"])
def test_every_entry_point_makes_one_whole_file_request_per_file(tmp_path, entry):
    import engine
    import engine.urls.remote

    rng = np.random.default_rng(4)
    sd = {f"w{i:02d}": rng.standard_normal((40, 1000)).astype(np.float32) for i in range(12)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    size = (tmp_path / "m.safetensors").stat().st_size
    with StdlibHTTP(str(tmp_path)) as srv, warnings.catch_warnings():
        warnings.simplefilter("ignore", RangeIgnoredWarning)
        url = srv.url("m.safetensors")
        if entry == "stream":  # a selection: the bytes between are passed, not requested
            got = dict(engine.stream(url, framework="np", names=["w09", "w02", "w05"], chunk_bytes=64 << 10))
            assert sorted(got) == ["w02", "w05", "w09"] and all(np.array_equal(got[k], sd[k]) for k in got)
        elif entry == "load_into":
            dst = {k: np.zeros_like(v) for k, v in sd.items()}
            engine.load_into(url, dst, chunk_bytes=64 << 10)
            assert all(np.array_equal(dst[k], sd[k]) for k in sd)
        elif entry == "safe_open":  # backwards, and twice: a handle keeps what the stream passed
            with engine.safe_open(url, framework="np") as f:
                for k in sorted(sd, reverse=True) + ["w11", "w00"]:
                    assert np.array_equal(f.get_tensor(k), sd[k])
                assert np.array_equal(f.get_slice("w03")[2:5], sd["w03"][2:5])
        elif entry == "get_tensor":
            assert np.array_equal(engine.urls.remote.get_tensor(url, "w07"), sd["w07"])
        elif entry == "tensor_parallel":
            from engine.distributed import ShardingPlan, Split, load_tensor_parallel

            out = load_tensor_parallel(url, ShardingPlan([("*", Split(-1))]), rank=1, world_size=2)
            assert all(np.array_equal(out[k].numpy(), sd[k][:, 500:]) for k in sd)
        else:  # a first load writes the copy, a second reads it
            for _ in range(2):
                got = engine.numpy.load_file(url, cache_dir=str(tmp_path / "cache"), chunk_bytes=64 << 10)
                assert all(np.array_equal(got[k], sd[k]) for k in sd)
                assert len(srv.gets) == 1 and sum(srv.sent.values()) <= 1.05 * size
                srv.reset()
            return
    assert len(srv.gets) == 1 and sum(srv.sent.values()) <= 1.05 * size, (srv.gets, srv.sent, size)


def test_a_whole_file_stream_limits_each_receive_on_a_closing_connection(tmp_path):
    """http.server closes each connection after its answer, so the connection drops the socket
    the stream reads from: each receive must still wait at most the load's timeout, set on the
    socket the answer reads from (not the deadline left over from sending the request)."""
    from engine.net import _response

    data = np.random.default_rng(8).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    with StdlibHTTP(str(tmp_path)) as srv:
        reads = RangeReads(connections=1, retry=FAST, timeout=7.0)
        file = RemoteFile(srv.url("f.bin"), len(data), None)
        try:
            with pytest.warns(RangeIgnoredWarning):
                got = read(reads, file, 1 << 20, 1000)
            stream = reads._streams[file.url]
            assert stream.conn.sock is None  # the connection let go of it
            sock = _response.socket_of(stream.resp)
            assert sock is not None and sock.gettimeout() == 7.0
        finally:
            reads.close()
    assert got == data[1 << 20 : (1 << 20) + 1000]


def test_a_connection_to_the_host_a_redirect_led_to_is_pooled_under_that_host(served, server, tmp_path):
    """A file redirected to another host (a CDN) leaves its connection to that host idle: the
    next request to the first host must not be sent on it (it was, and the other host answered
    404 for a path it does not have)."""
    _, data, _ = served
    (tmp_path / "other.safetensors").write_bytes(data)
    with serving(str(tmp_path)) as cdn:
        cdn.keepalive = True
        server.modes["/moved.safetensors"] = f"redirect:{cdn.url('other.safetensors')}"
        with RangeReads(connections=1, timeout=5.0, retry=FAST) as reads:
            first = reads.first(server.url("moved.safetensors"))
            got = bytearray(100)
            reads.read(first.file, 1000, [memoryview(got)])
            assert bytes(got) == data[1000:1100]
            again = reads.first(server.url("model.safetensors"))  # the first host again
            assert again.prefix == data[:8] and again.file.size == len(data)
        assert all(p == "/other.safetensors" for p in cdn.paths())


def test_a_client_that_hangs_up_prints_no_traceback(server, capfd):
    """A client that resets its idle keep-alive connection (as the loads do when they give a
    connection up) printed the server thread's ``ConnectionResetError`` traceback among the dots
    of a passing run; the test servers take it quietly, as a hang-up the tests expect."""
    import socket as _socket

    host, port = server.server_address[:2]
    with _socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /model.safetensors HTTP/1.1\r\nHost: x\r\nRange: bytes=0-7\r\n\r\n")
        answer = b""
        while not (b"\r\n\r\n" in answer and len(answer.split(b"\r\n\r\n", 1)[1]) == 8):
            answer += sock.recv(65536)  # the whole answer: the server is back to reading requests
        assert answer.startswith(b"HTTP/1.1 206")
        # close with SO_LINGER 0: a TCP reset while the server waits for the next request
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 2
    err = ""
    while time.monotonic() < deadline and "ConnectionResetError" not in err:
        time.sleep(0.1)
        err += capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def test_a_failed_request_for_a_whole_answer_names_no_byte_range():
    """A request that asks for no range (an API's answer, a listing) that fails is not reported as
    'bytes 0--1'; a ranged one names its bytes."""
    from engine.net.retry import fail

    assert "bytes" not in fail("https://hub/api/models/org/none", 0, 0, "ConnectionError", "refused", 0).error.message
    assert "bytes 8-107: refused" in fail("https://host/m.safetensors", 8, 100, "ConnectionError", "refused", 0).error.message
