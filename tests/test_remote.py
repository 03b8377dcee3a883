"""engine.urls.remote against a real HTTP server on localhost (tests/rangeserver.py), counting requests."""

from __future__ import annotations

import json
import os
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import engine.numpy
from engine.checkpoints.checkpoint import (
    CheckpointIndexError,
    MissingShardError,
    read_checkpoint_info,
    save_sharded,
)
from engine.errors import HeaderError, MissingDependencyError, ReadError, TensorNotFoundError
from engine.format.header import read_header
from engine.net.retry import Retry
from engine.urls.remote import RemoteFileNotFoundError, get_tensor, read_metadata

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import Nginx, StdlibHTTP, nginx_or_skip  # noqa: E402

TIMEOUT = 5.0  # bounded: nothing in this module waits longer


def tensors():
    rng = np.random.default_rng(0)
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.w": rng.standard_normal((32, 32)).astype(ml_dtypes.bfloat16),
        "layers.0.b": np.arange(32, dtype=np.int64),
        "layers.1.w": rng.standard_normal((32, 32)).astype(np.float16),
        "layers.1.b": np.ones(32, np.float32),
        "norm": np.zeros(0, np.float32),
        "mask": np.array([True, False, True]),
    }


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    sd = tensors()
    engine.numpy.save_file(sd, root / "model.safetensors", metadata={"format": "np"})
    split = save_sharded(sd, root / "sharded", max_shard_size="3KB", metadata={"format": "np"})
    assert split.is_sharded and len(split.filename_to_tensors) >= 3
    (root / "empty.safetensors").write_bytes(b"")
    (root / "tiny.safetensors").write_bytes(b"\x02\x00\x00\x00")
    (root / "pointer.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n"
    )
    (root / "big.safetensors").parent.mkdir(exist_ok=True)
    engine.numpy.save_file({"x": np.zeros(8 << 20, np.float32)}, root / "big.safetensors")  # 32 MiB
    return root


@pytest.fixture(scope="module")
def module_server(www):
    server = serve(str(www))
    yield server
    server.stop()


@pytest.fixture
def server(module_server):
    module_server.reset()
    module_server.modes.clear()
    yield module_server
    module_server.modes.clear()


def same_header(remote, local) -> None:
    assert remote.to_dict() == local.to_dict()
    assert remote.file_size == local.file_size
    assert remote.header_size == local.header_size
    assert remote.data_start == local.data_start
    assert remote.parameters() == local.parameters()
    assert remote.offset_keys() == local.offset_keys()


# --------------------------------------------------------------------------- well-behaved


def test_single_file_costs_exactly_two_requests(server, www):
    url = server.url("model.safetensors")
    info = read_metadata(url, timeout=TIMEOUT)
    local = read_header(www / "model.safetensors")
    assert [r["range"] for r in server.requests] == ["bytes=0-7", f"bytes=8-{7 + local.header_size}"]
    assert all(r["method"] == "GET" for r in server.requests)
    assert info.shards == ["model.safetensors"] and not info.is_sharded
    header = info.headers["model.safetensors"]
    same_header(header, local)
    assert header.path == url
    assert info.parameters() == local.parameters()
    assert info.metadata() == {"format": "np"}


def test_index_costs_one_plus_two_per_shard_and_equals_local(server, www):
    url = server.url("sharded/model.safetensors.index.json")
    info = read_metadata(url, timeout=TIMEOUT)
    local = read_checkpoint_info(www / "sharded")
    n = len(local.shards)
    assert len(server.requests) == 1 + 2 * n
    assert server.requests[0]["path"] == "/sharded/model.safetensors.index.json"
    assert server.requests[0]["range"] is None
    assert sorted(r["path"] for r in server.requests[1:]) == sorted(
        f"/sharded/{s}" for s in local.shards for _ in range(2)
    )
    assert info.shards == local.shards
    for shard in local.shards:
        same_header(info.headers[shard], local.headers[shard])
    assert info.weight_map == local.weight_map
    assert info.index_metadata == local.index_metadata == json.loads(
        (www / "sharded" / "model.safetensors.index.json").read_text()
    )["metadata"]
    assert info.parameters() == local.parameters()
    assert info.parameters()["total"] == sum(a.size for a in tensors().values())
    assert info.keys() == sorted(tensors())


def test_redirect_is_followed_and_the_second_request_goes_straight_there(server, www):
    server.modes["/moved/model.safetensors"] = "redirect:/model.safetensors"
    info = read_metadata(server.url("moved/model.safetensors"), timeout=TIMEOUT)
    same_header(info.headers["model.safetensors"], read_header(www / "model.safetensors"))
    assert server.paths() == ["/moved/model.safetensors", "/model.safetensors", "/model.safetensors"]


def test_authorization_is_dropped_on_a_redirect_to_another_host(server):
    port = server.server_address[1]
    server.modes["/moved/model.safetensors"] = f"redirect:http://localhost:{port}/model.safetensors"
    read_metadata(server.url("moved/model.safetensors"), timeout=TIMEOUT, headers={"Authorization": "Bearer x"})
    assert [r["authorization"] for r in server.requests] == ["Bearer x", None, None]


def test_get_tensor_reads_only_its_range(server, www):
    sd = tensors()
    url = server.url("model.safetensors")
    local = read_header(www / "model.safetensors")
    got = get_tensor(url, "layers.0.w", timeout=TIMEOUT)
    np.testing.assert_array_equal(got, sd["layers.0.w"])
    assert got.dtype == ml_dtypes.bfloat16 and got.flags.writeable
    b, e = local["layers.0.w"].data_offsets
    assert len(server.requests) == 3
    assert server.requests[2]["range"] == f"bytes={local.data_start + b}-{local.data_start + e - 1}"


def test_get_tensor_through_an_index_costs_four_requests(server):
    sd = tensors()
    got = get_tensor(server.url("sharded/model.safetensors.index.json"), "layers.1.w", timeout=TIMEOUT)
    np.testing.assert_array_equal(got, sd["layers.1.w"])
    assert len(server.requests) == 4


def test_get_tensor_torch_and_empty(server):
    torch = pytest.importorskip("torch")
    t = get_tensor(server.url("model.safetensors"), "layers.0.b", framework="pt", timeout=TIMEOUT)
    assert torch.equal(t, torch.arange(32))
    server.reset()
    empty = get_tensor(server.url("model.safetensors"), "norm", timeout=TIMEOUT)
    assert empty.shape == (0,) and len(server.requests) == 2  # no data request for 0 bytes


def test_get_tensor_unknown_name(server):
    with pytest.raises(TensorNotFoundError, match="embed"):
        get_tensor(server.url("model.safetensors"), "embed.weights", timeout=TIMEOUT)
    with pytest.raises(TensorNotFoundError):
        get_tensor(server.url("sharded/model.safetensors.index.json"), "nope", timeout=TIMEOUT)


# --------------------------------------------------------------------------- misbehaving servers


def test_server_ignoring_range_is_read_only_as_far_as_needed(server, www):
    server.modes["*"] = "ignore-range"
    info = read_metadata(server.url("big.safetensors"), timeout=TIMEOUT)
    same_header(info.headers["big.safetensors"], read_header(www / "big.safetensors"))
    assert len(server.requests) == 1  # length and header from the same body
    deadline = time.monotonic() + 2
    while server.aborted == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.aborted == 1  # we hung up on the 32 MiB body


def test_server_ignoring_range_index_and_tensor(server):
    server.modes["*"] = "ignore-range"
    url = server.url("sharded/model.safetensors.index.json")
    info = read_metadata(url, timeout=TIMEOUT)
    assert len(server.requests) == 1 + len(info.shards)
    np.testing.assert_array_equal(get_tensor(url, "layers.1.b", timeout=TIMEOUT), tensors()["layers.1.b"])


def test_404(server):
    url = server.url("nope.safetensors")
    with pytest.raises(RemoteFileNotFoundError) as e:
        read_metadata(url, timeout=TIMEOUT)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ReadError)
    assert e.value.reason == "NotFound" and e.value.status == 404 and url in str(e.value)
    assert len(server.requests) == 1


def test_missing_shard(server):
    server.modes["/sharded/model-00002-of-00003.safetensors"] = "404"
    with pytest.raises(MissingShardError) as e:
        read_metadata(server.url("sharded/model.safetensors.index.json"), timeout=TIMEOUT)
    assert "model-00002-of-00003.safetensors" in str(e.value) and isinstance(e.value, FileNotFoundError)


def test_416_on_an_empty_file_is_header_too_small(server):
    with pytest.raises(HeaderError) as e:
        read_metadata(server.url("empty.safetensors"), timeout=TIMEOUT)
    assert e.value.reason == "HeaderTooSmall" and "empty.safetensors" in str(e.value)


def test_file_shorter_than_8_bytes(server):
    with pytest.raises(HeaderError) as e:
        read_metadata(server.url("tiny.safetensors"), timeout=TIMEOUT)
    assert e.value.reason == "HeaderTooSmall"


def test_416_always(server):
    server.modes["*"] = "416"
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)
    assert e.value.reason == "RangeNotSatisfiable" and e.value.status == 416


def test_truncated_body(server):
    server.modes["*"] = "truncate"
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)
    assert e.value.reason == "ShortRead" and "model.safetensors" in str(e.value)


def test_truncated_tensor(server):
    server.modes["*"] = "truncate"
    with pytest.raises(ReadError, match="truncated"):
        get_tensor(server.url("big.safetensors"), "x", timeout=TIMEOUT)


def test_redirect_loop_is_bounded(server):
    server.modes["/loop.safetensors"] = "redirect:/loop.safetensors"
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("loop.safetensors"), timeout=TIMEOUT, max_redirects=3)
    assert e.value.reason == "TooManyRedirects"
    assert len(server.requests) == 4


def test_slow_server_times_out(server):
    server.modes["*"] = "slow"
    t0 = time.monotonic()
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("model.safetensors"), timeout=0.3, retry=Retry(attempts=2, base=0.01, cap=0.01))
    assert e.value.reason == "Timeout" and "after 2 tries" in str(e.value)
    assert time.monotonic() - t0 < 3  # each request's own deadline, tried twice
    assert len(server.requests) == 2
    assert isinstance(e.value, OSError)


def test_git_lfs_pointer(server):
    with pytest.raises(HeaderError, match="Git LFS pointer") as e:
        read_metadata(server.url("pointer.safetensors"), timeout=TIMEOUT)
    assert "pointer.safetensors" in str(e.value) and "/resolve/" in str(e.value)
    assert e.value.reason == "NotSafetensors"  # the reason a local pointer file gets too
    assert len(server.requests) == 1


def test_html_page(server):
    server.modes["*"] = "html"
    with pytest.raises(HeaderError, match="HTML page"):
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)


def test_unknown_size(server):
    server.modes["*"] = "no-total"
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)
    assert e.value.reason == "UnknownSize" and "Content-Range" in str(e.value)
    server.modes["*"] = "no-length"
    with pytest.raises(ReadError, match="Content-Length"):
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)


def test_compressed_bodies(server, www):
    # a compressed index is fine; compressed ranges cannot be read
    server.modes["/sharded/model.safetensors.index.json"] = "gzip"
    info = read_metadata(server.url("sharded/model.safetensors.index.json"), timeout=TIMEOUT)
    assert info.weight_map == read_checkpoint_info(www / "sharded").weight_map
    server.modes["/model.safetensors"] = "gzip"
    with pytest.raises(ReadError, match="Content-Encoding: gzip"):
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)


def test_connection_refused():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ReadError) as e:
        read_metadata(f"http://127.0.0.1:{port}/model.safetensors", timeout=TIMEOUT)
    assert e.value.reason == "ConnectionError"


def test_header_size_limit(server):
    with pytest.raises(HeaderError) as e:
        read_metadata(server.url("model.safetensors"), timeout=TIMEOUT, max_header_size=64)
    assert e.value.reason == "HeaderTooLarge"
    # a length past the limit may be a damaged byte: read once more, the same bytes again
    assert len(server.requests) == 2 and "the same bytes twice" in str(e.value)


# --------------------------------------------------------------------------- index rules


def write_index(www, name, doc):
    path = www / "sharded" / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path.name


@pytest.mark.parametrize(
    "doc, reason",
    [
        ("[1, 2]", "InvalidIndex"),
        ("{not json", "InvalidIndex"),
        ({"metadata": {}}, "InvalidIndex"),
        ({"weight_map": {"a": 1}}, "InvalidIndex"),
        ({"weight_map": {"a": "../model.safetensors"}}, "UnsafeShardName"),
        ({"weight_map": {"a": "http://example.com/x.safetensors"}}, "UnsafeShardName"),
        ({"weight_map": {"a": "/etc/passwd"}}, "UnsafeShardName"),
    ],
)
def test_bad_index_fetches_no_shard(server, www, doc, reason):
    name = write_index(www, f"bad-{reason}-{abs(hash(str(doc)))}.safetensors.index.json", doc)
    with pytest.raises(CheckpointIndexError) as e:
        read_metadata(server.url(f"sharded/{name}"), timeout=TIMEOUT)
    assert e.value.reason == reason
    assert len(server.requests) == 1


def test_too_many_shards(server, www):
    name = write_index(
        www, "many.safetensors.index.json", {"weight_map": {f"t{i}": f"s{i}.safetensors" for i in range(5)}}
    )
    with pytest.raises(CheckpointIndexError) as e:
        read_metadata(server.url(f"sharded/{name}"), timeout=TIMEOUT, max_shards=4)
    assert e.value.reason == "TooManyShards" and len(server.requests) == 1


def test_index_disagreeing_with_shards(server, www):
    real = json.loads((www / "sharded" / "model.safetensors.index.json").read_text())
    real["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    name = write_index(www, "ghost.safetensors.index.json", real)
    with pytest.raises(CheckpointIndexError) as e:
        read_metadata(server.url(f"sharded/{name}"), timeout=TIMEOUT)
    assert e.value.reason == "TensorNotInShard" and e.value.tensors == ("ghost",)


# --------------------------------------------------------------------------- other transports


def test_fsspec_memory_protocol_equals_local(www):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(www / "sharded"):
        if name.startswith("model"):
            fs.pipe(f"/engine-test/{name}", (www / "sharded" / name).read_bytes())
    info = read_metadata("memory://engine-test/model.safetensors.index.json")
    local = read_checkpoint_info(www / "sharded")
    assert info.shards == local.shards
    for shard in local.shards:
        same_header(info.headers[shard], local.headers[shard])
    sd = tensors()
    np.testing.assert_array_equal(
        get_tensor("memory://engine-test/model.safetensors.index.json", "embed.weight"), sd["embed.weight"]
    )
    with pytest.raises(MissingShardError):
        fs.rm("/engine-test/model-00001-of-00003.safetensors")
        read_metadata("memory://engine-test/model.safetensors.index.json")


def test_file_url_and_local_path(www):
    pytest.importorskip("fsspec")
    local = read_header(www / "model.safetensors")
    same_header(read_metadata(f"file://{www}/model.safetensors").headers["model.safetensors"], local)
    same_header(read_metadata(str(www / "model.safetensors")).headers["model.safetensors"], local)


def test_without_fsspec(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install .*\[remote\]"):
        read_metadata("memory://x/model.safetensors")


def test_http_needs_no_fsspec(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    assert len(read_metadata(server.url("model.safetensors"), timeout=TIMEOUT)) == len(tensors())


# -- the timeout is each request's deadline ----------------------------------------------------


@pytest.mark.parametrize(("mode", "phase"), [("drip", "while receiving the body"), ("drip-head", "no answer"),
                                             ("slow", "no answer")])
def test_timeout_bounds_a_server_that_drips(server, mode, phase):
    # one byte every 0.25 s never lets a single socket wait time out; the deadline still holds
    server.modes["*"] = mode
    t0 = time.monotonic()
    with pytest.raises(ReadError) as e:
        read_metadata(server.url("model.safetensors"), timeout=1.0, retry=Retry(attempts=1))
    elapsed = time.monotonic() - t0
    assert e.value.reason == "Timeout", str(e.value)
    assert phase in str(e.value), str(e.value)
    assert elapsed < 1.0 + 0.5, elapsed


def test_timeout_is_each_requests_own(server):
    # get_tensor makes three requests; each answered in 0.45 s fits a timeout of 1 s, though
    # the call takes longer: the timeout is each request's, the same in every entry point
    server.modes["*"] = "delay:0.45"
    got = get_tensor(server.url("model.safetensors"), "layers.0.w", timeout=1.0, retry=Retry(attempts=1))
    np.testing.assert_array_equal(got, tensors()["layers.0.w"])
    assert len(server.requests) == 3


def test_connect_timeout_names_the_phase():
    import socket

    # a listening socket whose backlog is full never completes another handshake quickly;
    # where the system still accepts, the request phase times out instead
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    fillers = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(s.getsockname())
            fillers.append(c)
        t0 = time.monotonic()
        with pytest.raises(ReadError) as e:
            read_metadata(f"http://127.0.0.1:{s.getsockname()[1]}/model.safetensors", timeout=0.5,
                          retry=Retry(attempts=1))
        assert e.value.reason == "Timeout" and "deadline" in str(e.value)
        assert time.monotonic() - t0 < 1.5
    finally:
        for c in fillers:
            c.close()
        s.close()


# --------------------------------------------------------------------------- a folder named without its slash


@pytest.fixture(scope="module")
def folders(www, tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    sd = tensors()
    (root / "single").mkdir()
    engine.numpy.save_file(sd, root / "single" / "model.safetensors")
    save_sharded(sd, root / "sharded", max_shard_size="3KB")
    (root / "empty").mkdir()
    return root, sd


@pytest.mark.parametrize("where", ["single", "sharded", ""])
@pytest.mark.filterwarnings("ignore::engine.errors.RangeIgnoredWarning")
def test_a_folder_without_its_slash_is_read_as_the_folder(folders, where):
    """http.server redirects /single to /single/ and lists a folder (the bare host) as HTML:
    either way the URL is read as the folder it names."""
    root, sd = folders
    with StdlibHTTP(str(root if where else root / "single")) as srv:
        url = srv.url(where).rstrip("/")
        info = read_metadata(url, timeout=TIMEOUT)
        assert sorted(info.keys()) == sorted(sd)
        np.testing.assert_array_equal(engine.numpy.load_file(url)["layers.1.w"], sd["layers.1.w"])


def test_a_folder_without_its_slash_behind_nginx(folders):
    """nginx redirects /single to /single/ and forbids listing it (403): still the folder."""
    root, sd = folders
    nginx_or_skip()
    with Nginx(str(root)) as srv:
        info = read_metadata(srv.url("sharded"), timeout=TIMEOUT)
        assert sorted(info.keys()) == sorted(sd) and len(info.shards) >= 3


def test_a_folder_without_its_slash_that_holds_no_checkpoint_says_to_add_the_slash(folders):
    root, _ = folders
    with StdlibHTTP(str(root)) as srv:
        with pytest.raises(RemoteFileNotFoundError) as err:
            read_metadata(srv.url("empty"), timeout=TIMEOUT)
        assert err.value.path == srv.url("empty") and "trailing '/'" in str(err.value)
        assert "model.safetensors.index.json" in str(err.value)
        with pytest.raises(RemoteFileNotFoundError):  # a missing name is still just missing
            read_metadata(srv.url("nope"), timeout=TIMEOUT)
