"""engine.urls.remote_load: whole remote checkpoints (a file, an index, a prefix; HTTP and
path-style S3) against nginx, byte for byte equal to the local load; and loads through
failing requests against tests/rangeserver.py."""

from __future__ import annotations

import os
import shutil
import sys
import traceback
import warnings

import numpy as np
import pytest
import torch

import engine
import engine.numpy
import engine.torch
from engine.errors import RangeIgnoredWarning, ReadError, RemoteFileNotFoundError
from engine.format.header import read_header
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import Nginx, nginx_or_skip, nginx_serving  # noqa: E402
from torch_models import assert_same, llama, raw  # noqa: E402

FAST = Retry(attempts=4, base=0.001, cap=0.01)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-load")
    sd = llama()
    engine.save_sharded(sd, root / "sharded", max_shard_size=800_000, fsync=False)
    assert len(list((root / "sharded").glob("*.safetensors"))) >= 3
    engine.save_sharded(sd, root / "single", fsync=False)
    assert sorted(os.listdir(root / "single")) == ["model.safetensors"]
    shutil.copytree(root / "sharded", root / "bucket" / "ckpt")
    shutil.copytree(root / "single", root / "bucket" / "one")
    return root, sd


@pytest.fixture(scope="module")
def nginx(checkpoint):
    with nginx_serving(checkpoint[0]) as server:
        yield server


# -- nginx: every way of naming a checkpoint --------------------------------------------------------
@pytest.mark.parametrize("where", ["single/model.safetensors", f"sharded/{INDEX}", "sharded/", "single/"])
def test_torch_load_file_of_a_url_equals_the_local_load(checkpoint, nginx, where):
    root, sd = checkpoint
    with warnings.catch_warnings():
        # nginx honours Range: parallel ranges, never the whole-file stream of a server that does not
        warnings.simplefilter("error", RangeIgnoredWarning)
        got = engine.torch.load_file(nginx.url(where), chunk_bytes=1 << 16)
    assert_same(got, sd)
    local = engine.torch.load_file(str(root / where.rstrip("/")))
    assert all(raw(local[k]) == raw(got[k]) for k in sd)


def test_numpy_load_file_of_a_url(checkpoint, nginx):
    _, sd = checkpoint
    sd = {k: v for k, v in sd.items() if v.dtype != torch.bfloat16}  # numpy has no BF16
    got = engine.numpy.load_file(nginx.url(f"sharded/{INDEX}"))
    for k, v in sd.items():
        assert got[k].dtype == v.numpy().dtype and got[k].tobytes() == raw(v), k


@pytest.mark.parametrize("select", [
    {"names": ["lm_head.weight", "model.empty", "model.layers.2.mlp.up_proj.weight"]},
    {"patterns": ["model.layers.*.self_attn.q_proj.weight", "model.norm.*"]},
    {"layers": range(1, 3)},
])
def test_stream_of_a_url_selects_as_a_local_stream(checkpoint, nginx, select):
    root, sd = checkpoint
    got = dict(engine.stream(nginx.url("sharded/"), chunk_bytes=65536, connections=3, **select))
    shards = sorted(str(p) for p in (root / "sharded").glob("*.safetensors"))
    want = dict(engine.stream(shards, **select))  # a local stream takes the shards' list
    assert sorted(got) == sorted(want) and got
    assert_same({k: got[k] for k in sorted(got)}, {k: sd[k] for k in want})


def test_load_into_from_a_url_fills_cpu_tensors_in_place(checkpoint, nginx):
    _, sd = checkpoint
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    before = {k: v.data_ptr() for k, v in dst.items()}
    filled = engine.load_into(nginx.url(f"sharded/{INDEX}"), dst, strict=True, chunk_bytes=100_000)
    assert sorted(filled) == sorted(sd)
    assert {k: v.data_ptr() for k, v in dst.items()} == before
    assert_same({k: dst[k] for k in sorted(dst)}, sd)


class EmulatedArray:
    """A tensor of a framework the engine does not know, in the emulated device's memory."""

    def __init__(self, code, shape, nbytes):
        self.code, self.shape, self.data = code, shape, bytearray(nbytes)


@pytest.fixture
def ring_ops():
    """Device operations over the emulated CUDA runtime (tests/emucudart): remote loads to them
    go through the chunk ring (tests/test_remote_ring.py tests that path in depth)."""
    from emucudart import EmulatedRingOps, Emulator

    from engine.gpu import rings

    emulator = Emulator()
    emulator.reset()
    ops = EmulatedRingOps(emulator)
    yield ops
    rings.release_rings()
    st = emulator.stats()
    ops.close()
    emulator.reset()
    assert st["copies"] > 0 and st["registered"] == 0 and st["pageable"] == 0, st


@pytest.mark.parametrize("gpu_path", ["copy", "auto"])
def test_load_into_a_device_from_a_url_goes_through_the_ring(checkpoint, nginx, monkeypatch, gpu_path, ring_ops):
    """A device destination, emulated on the CPU: remote bytes land in the ring's chunks,
    then the device's copies."""
    import engine.loading.fill
    from engine.base import dtypes
    from engine.sinks._targets import FillTarget

    _, sd = checkpoint
    emu = ring_ops

    class EmulatedTarget(FillTarget):
        device = ("emulated", 0)

        def __init__(self, arr):
            super().__init__(arr, arr.code, arr.shape, True, "emulated")

        def device_bytes(self):
            return memoryview(self.tensor.data)

        def device_ops(self):
            return emu

    real = engine.loading.fill.fill_target
    monkeypatch.setattr(engine.loading.fill, "fill_target",
                        lambda x: EmulatedTarget(x) if isinstance(x, EmulatedArray) else real(x))
    on_device = [k for k in sd if "proj" in k]
    dst = {k: EmulatedArray(dtypes.from_torch(sd[k].dtype), tuple(sd[k].shape), len(raw(sd[k])))
           for k in on_device}
    host = {k: torch.zeros_like(v) for k, v in sd.items() if k not in dst}
    filled = engine.load_into(nginx.url("sharded/"), {**dst, **host}, strict=True, gpu_path=gpu_path,
                              chunk_bytes=65536)
    assert sorted(filled) == sorted(sd)
    for k in on_device:
        assert bytes(dst[k].data) == raw(sd[k]), k
    assert_same({k: host[k] for k in sorted(host)}, {k: sd[k] for k in host})


@pytest.mark.parametrize("gpu_path", ["copy", "auto"])
def test_stream_to_a_device_from_a_url_is_one_allocation_through_the_ring(checkpoint, nginx, monkeypatch, gpu_path,
                                                                         ring_ops):
    from emucudart import EmulatedSink

    import engine.loading.loader

    _, sd = checkpoint
    allocations = []

    class CountingSink(EmulatedSink):
        def allocate_device(self, specs, per_tensor=False):
            allocations.append(len(specs))
            return super().allocate_device(specs, per_tensor)

    sink = CountingSink(ring_ops)
    monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device: sink)
    got = dict(engine.stream(nginx.url(f"sharded/{INDEX}"), device="emulated", gpu_path=gpu_path,
                             chunk_bytes=65536, slot_bytes=1 << 18))
    assert sorted(got) == sorted(sd) and allocations == [len(sd)]
    assert all(np.asarray(got[k]).tobytes() == raw(v) for k, v in sd.items())


# -- path-style S3 against nginx ---------------------------------------------------------------------
@pytest.mark.parametrize("where", [f"ckpt/{INDEX}", "one/model.safetensors"])
def test_anonymous_path_style_s3(checkpoint, nginx, monkeypatch, where):
    _, sd = checkpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", nginx.base)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull + "-none")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull + "-none")
    assert_same(engine.torch.load_file(f"s3://bucket/{where}"), sd)


def test_anonymous_s3_never_imports_botocore(checkpoint, nginx):
    from conftest import run_python

    env = {**os.environ, "AWS_ENDPOINT_URL": nginx.base, "AWS_NO_SIGN_REQUEST": "1"}
    code = ("import sys, engine.torch\n"
            "sd = engine.torch.load_file('s3://bucket/one/model.safetensors')\n"
            "print(len(sd), 'botocore' in sys.modules)\n")
    assert run_python(code, env=env).split() == [str(len(checkpoint[1])), "False"]


# -- failing requests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flaky(checkpoint):
    server = serve(str(checkpoint[0]))
    yield server
    server.stop()


@pytest.fixture
def rangeserver(flaky):
    yield flaky.bulk()
    flaky.faults = {}


def test_a_load_through_transient_failures_is_byte_exact(checkpoint, rangeserver):
    _, sd = checkpoint
    kinds = ["503", "reset", "slowdown", "short", "500", "slow"]
    rangeserver.faults = lambda n, path, first, last: kinds[(n // 20) % len(kinds)] if n % 20 == 7 else None
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    filled = engine.load_into(rangeserver.url(f"sharded/{INDEX}"), dst, chunk_bytes=16384, connections=4,
                              retry=FAST, timeout=1.0)
    assert sorted(filled) == sorted(sd)
    assert_same({k: dst[k] for k in sorted(dst)}, sd)
    faulty = [n for n in range(1, rangeserver.data_gets + 1) if n % 20 == 7]
    assert len(faulty) >= len(kinds)  # every kind was met at least once
    assert rangeserver.connections < rangeserver.data_gets  # keep-alive connections were reused


def covered(requests: list[dict], path: str) -> list[tuple[int, int]]:
    """The byte spans [a, b) of ``path`` answered in full before the failure, adjacent
    ones merged (a tensor may span several requests)."""
    spans: list[tuple[int, int]] = []
    for a, b in sorted(tuple(map(int, r["range"][6:].split("-"))) for r in requests if r["path"] == path):
        if spans and spans[-1][1] >= a:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b + 1))
        else:
            spans.append((a, b + 1))
    return spans


def test_a_permanent_failure_mid_load_into_says_which_names_are_complete(checkpoint, rangeserver):
    root, sd = checkpoint
    rangeserver.faults = {9: "403"}
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(ReadError) as err:
        engine.load_into(rangeserver.url(f"sharded/{INDEX}"), dst, chunk_bytes=30000, connections=1, retry=FAST)
    assert err.value.reason == "AccessDenied" and "see .filled" in str(err.value)
    done = [r for r in rangeserver.data_requests() if r["n"] < 9]
    assert len(done) == 8 and len(rangeserver.data_requests()) == 9  # one worker: requests in order
    want = []
    for shard in sorted((root / "sharded").glob("*.safetensors")):
        header = read_header(str(shard))
        spans = covered(done, f"/sharded/{shard.name}")
        table, start = header.table, header.data_start
        for name, b, e in zip(table.names, table.begins, table.ends, strict=True):
            a, z = start + int(b), start + int(e)
            if a == z or any(s <= a and z <= t for s, t in spans):
                want.append(name)
    assert err.value.filled == sorted(want)
    assert 0 < len(want) < len(sd)
    for k in want:
        assert raw(dst[k]) == raw(sd[k]), k


def test_a_file_replaced_mid_load_is_file_changed(checkpoint, rangeserver):
    _, sd = checkpoint
    rangeserver.faults = {4: "change"}
    with pytest.raises(ReadError) as err:
        dict(engine.stream(rangeserver.url("sharded/"), chunk_bytes=30000, connections=2, retry=FAST))
    assert err.value.reason == "FileChanged" and "/sharded/model-" in str(err.value)
    changed = [r for r in rangeserver.data_requests() if r["n"] >= 4]
    assert changed and all(r["if_match"] for r in changed)


@pytest.mark.parametrize("kind", ["503", "slowdown", "500", "short", "reset"])
def test_transient_failures_of_the_header_and_index_requests_are_retried(checkpoint, rangeserver, kind):
    """The requests before the bulk reads (the index, each shard's length and header) meet
    the same transient failures as the data reads and are retried the same way: here every
    distinct request fails once."""
    root, sd = checkpoint
    seen: set = set()

    def once(n, path, first, last):
        if (path, first) in seen or not (path.endswith(INDEX) or first in (0, 8, None)):
            return None  # the data reads' retries are tested in test_remote_reads
        seen.add((path, first))
        return kind

    rangeserver.faults_on = "all"
    rangeserver.faults = once
    got = dict(engine.stream(rangeserver.url("sharded/"), retry=FAST, timeout=5.0))
    assert_same({k: got[k] for k in sorted(got)}, sd)
    index = [r for r in rangeserver.requests if r["path"].endswith(INDEX)]
    lengths = [r for r in rangeserver.requests if r["range"] == "bytes=0-7"]
    ends = {f"/sharded/{f.name}": 8 + int.from_bytes(f.read_bytes()[:8], "little")
            for f in (root / "sharded").glob("*.safetensors")}
    headers = [r for r in rangeserver.requests if r["path"] in ends and r["range"]
               and 8 <= int(r["range"][6:].partition("-")[0]) < ends[r["path"]]]  # a short body's rest too
    shards = len(ends)
    # the index: the prefix's probe fails, then succeeds (and serves the load: no third
    # fetch); each shard's length and header: each request fails once and is tried again by
    # itself (the one client retries a request, not the call)
    assert len(index) == 2 and len(lengths) == 2 * shards and len(headers) == 2 * shards


@pytest.mark.parametrize(("where", "fault", "cls"), [
    ("sharded/absent.safetensors", None, RemoteFileNotFoundError),  # a file's header request
    ("single/nothing/", None, RemoteFileNotFoundError),  # a prefix's probes
    (f"sharded/{INDEX}", {1: "403"}, ReadError),  # a bulk read
])
def test_errors_of_a_url_with_a_password_never_show_it(checkpoint, rangeserver, where, fault, cls):
    rangeserver.faults = fault or {}
    url = rangeserver.url(where).replace("http://", "http://alice:pa55word@")
    with pytest.raises(cls) as err:
        engine.load_into(url, {k: torch.zeros_like(v) for k, v in checkpoint[1].items()}, retry=FAST)
    seen = "\n".join([str(err.value), repr(err.value.args), "".join(traceback.format_exception(err.value))])
    assert "pa55word" not in seen and "alice" not in seen, seen
    assert rangeserver.base + "/" in str(err.value)


@pytest.mark.parametrize("how", ["load_into", "stream"])
def test_a_permanent_failure_ends_the_other_readers_retries(checkpoint, rangeserver, how):
    """Every reader's first request meets a busy server (503) but the last one's, refused
    for good: the other readers stop waiting between tries instead of using up their tries."""
    _, sd = checkpoint
    connections = 4
    rangeserver.faults = lambda n, path, first, last: "403" if n == connections else "503"
    slow = Retry(attempts=4, base=5.0, cap=5.0)  # waits the load must not sit through
    url = rangeserver.url(f"sharded/{INDEX}")
    with pytest.raises(ReadError) as err:
        if how == "load_into":
            engine.load_into(url, {k: torch.zeros_like(v) for k, v in sd.items()}, chunk_bytes=16384,
                             connections=connections, retry=slow)
        else:
            dict(engine.stream(url, chunk_bytes=16384, connections=connections, retry=slow))
    assert err.value.reason == "AccessDenied"
    assert rangeserver.data_gets < 2 * connections  # not 1 + 3 * 4 tries


# -- fsspec: any other protocol ----------------------------------------------------------------
def test_an_fsspec_protocol_loads_through_the_same_pipeline(checkpoint):
    """memory:// (fsspec's in-memory file system) stands for gs://, hf://, ...: the same
    selection and destinations, the ranges read through fsspec."""
    fsspec = pytest.importorskip("fsspec", reason="fsspec is the optional remote extra")
    root, sd = checkpoint
    fs = fsspec.filesystem("memory")
    for name in os.listdir(root / "sharded"):
        fs.pipe(f"/engine-test/ckpt/{name}", (root / "sharded" / name).read_bytes())
    try:
        got = engine.torch.load_file(f"memory://engine-test/ckpt/{INDEX}")
        assert_same(got, sd)
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        engine.load_into(f"memory://engine-test/ckpt/{INDEX}", dst)
        assert all(raw(dst[k]) == raw(sd[k]) for k in sd)
        some = dict(engine.stream(f"memory://engine-test/ckpt/{INDEX}", patterns="model.layers.1.*"))
        assert sorted(some) == sorted(k for k in sd if k.startswith("model.layers.1."))
    finally:
        fs.rm("/engine-test", recursive=True)


# -- https ------------------------------------------------------------------------------------------
def test_https_with_a_certificate_the_environment_trusts(checkpoint, tmp_path, monkeypatch):
    """nginx over TLS with a self-signed certificate for 127.0.0.1: trusted through
    SSL_CERT_FILE, the load is byte-exact on pooled TLS connections; untrusted, it fails
    with a clear error naming the URL."""
    from servers import self_signed

    import engine.net._http

    nginx_or_skip()
    root, sd = checkpoint
    cert, key = self_signed(str(tmp_path))
    monkeypatch.setattr(engine.net._http, "_SSL_CONTEXT", None)  # made again from the environment below
    with Nginx(str(root), tls=(cert, key)) as server:
        url = server.url(f"sharded/{INDEX}")
        assert url.startswith("https://")
        with pytest.raises(ReadError) as err:
            engine.torch.load_file(url, retry=Retry(attempts=6, base=5.0, cap=5.0))  # a retry would take 5 s
        assert err.value.reason == "CertificateError" and server.base in str(err.value)
        assert "CERTIFICATE_VERIFY_FAILED" in str(err.value) and "after" not in str(err.value)
        monkeypatch.setattr(engine.net._http, "_SSL_CONTEXT", None)
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        assert_same(engine.torch.load_file(url), sd)
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        engine.load_into(url, dst, connections=3)
        assert all(raw(dst[k]) == raw(sd[k]) for k in sd)
    monkeypatch.setattr(engine.net._http, "_SSL_CONTEXT", None)  # no trust in this certificate afterwards


def test_load_file_takes_the_remote_options_for_a_url_only(checkpoint, nginx):
    root, sd = checkpoint
    got = engine.torch.load_file(nginx.url(f"sharded/{INDEX}"), connections=2, chunk_bytes=1 << 16, retry=FAST)
    assert_same(got, sd)
    with pytest.raises(TypeError):
        engine.torch.load_file(str(root / "single" / "model.safetensors"), connections=2)
    with pytest.raises(TypeError):
        engine.numpy.load_file(str(root / "single" / "model.safetensors"), timeout=3.0)


@pytest.mark.parametrize("url", ["http://alice:s3cr3t@[::1:9/m.safetensors", "http://127.0.0.1:notaport/m/"])
def test_a_malformed_url_is_an_invalid_url_error_without_its_password(url):
    with pytest.raises(ReadError) as err:
        engine.torch.load_file(url)
    assert err.value.reason == "InvalidURL" and "s3cr3t" not in str(err.value)


def test_an_fsspec_protocol_that_cannot_connect_names_the_url():
    """ftp:// connects while fsspec makes the file system: the failure is the engine's error."""
    pytest.importorskip("fsspec", reason="fsspec is the optional remote extra")
    with pytest.raises(ReadError) as err:
        engine.torch.load_file("ftp://127.0.0.1:9/m.safetensors")
    assert err.value.reason == "ConnectionError" and "ftp://127.0.0.1:9/m.safetensors" in str(err.value)


def test_credentials_never_follow_a_redirect_to_another_host_in_the_bulk_reads(checkpoint, rangeserver):
    """The header's requests drop Authorization when a redirect leaves the host; the
    tensor reads go straight to where that redirect led, and must not bring it back."""
    _, sd = checkpoint
    port = rangeserver.server_address[1]
    rangeserver.modes["/moved/single/model.safetensors"] = f"redirect:http://localhost:{port}/single/model.safetensors"
    got = engine.torch.load_file(rangeserver.url("moved/single/model.safetensors"),
                                 headers={"Authorization": "Bearer s3cr3t"}, retry=FAST)
    assert_same(got, sd)
    to_other_host = [r for r in rangeserver.requests if not r["path"].startswith("/moved/")]
    assert len(to_other_host) > 2  # the header's two requests and the tensor reads
    assert all(r["authorization"] is None for r in to_other_host)


def test_a_prefix_reads_what_it_probed_once(checkpoint, rangeserver):
    """Looking up a prefix fetches its index (or its single file's header); the load then
    uses what was read instead of asking again."""
    _, sd = checkpoint
    assert_same(engine.torch.load_file(rangeserver.url("single/"), retry=FAST), sd)
    assert sum(r["range"] == "bytes=0-7" for r in rangeserver.requests) == 1
    rangeserver.reset()
    engine.torch.load_file(rangeserver.url("sharded/"), retry=FAST)
    assert sum(r["path"].endswith(INDEX) for r in rangeserver.requests) == 1


# -- every entry point that takes a path takes a URL, resolved as load_file resolves it -------------
@pytest.mark.parametrize("where", ["single/", "sharded/", f"sharded/{INDEX}", "single/model.safetensors"])
def test_read_checkpoint_info_open_checkpoint_and_read_metadata_take_the_urls_load_file_takes(
        checkpoint, nginx, where):
    """They raised a raw FileNotFoundError for a URL, and read_metadata of a folder URL got
    the server's 403 for the folder itself."""
    from engine.urls import remote

    root, sd = checkpoint
    url = nginx.url(where)
    local = engine.read_checkpoint_info(str(root / where.rstrip("/")))
    for info in (engine.read_checkpoint_info(url), remote.read_metadata(url)):
        assert {k: h.to_dict() for k, h in info.headers.items()} == {k: h.to_dict() for k, h in local.headers.items()}
        assert info.weight_map == local.weight_map and info.index_metadata == local.index_metadata
    with engine.open_checkpoint(url, framework="pt") as ckpt:
        assert isinstance(ckpt, engine.safe_open)
        assert ckpt.keys() == sorted(sd) and ckpt.info.weight_map == local.weight_map
        assert_same(dict(sorted(ckpt.get_tensors().items())), sd)
        name = sorted(sd)[0]
        assert raw(ckpt.get_tensor(name)) == raw(sd[name])


@pytest.mark.parametrize("where", ["single/", "single/model.safetensors"])
def test_engine_read_header_takes_a_url(checkpoint, nginx, where):
    root, _ = checkpoint
    got = engine.read_header(nginx.url(where))
    want = read_header(str(root / "single" / "model.safetensors"))
    assert got.to_dict() == want.to_dict() and got.file_size == want.file_size


def test_read_header_of_a_url_holding_several_files_says_so(nginx):
    with pytest.raises(ReadError) as err:
        engine.read_header(nginx.url("sharded/"))
    assert err.value.reason == "NotAFile" and nginx.url("sharded/") in str(err.value)
    assert "read_checkpoint_info" in str(err.value)


def test_the_local_only_functions_name_a_url_and_where_urls_go():
    from engine.checkpoints import checkpoint
    from engine.format import header

    url = "http://127.0.0.1:9/m/model.safetensors"
    for call in (header.read_header, checkpoint.read_checkpoint_info, checkpoint.open_checkpoint):
        with pytest.raises(ReadError) as err:
            call(url)
        assert err.value.reason == "LocalPathExpected" and url in str(err.value) and "engine." in str(err.value)


@pytest.mark.parametrize("call", ["load_file", "safe_open", "read_checkpoint_info", "read_header", "stream"])
def test_a_refused_connection_fails_at_once_in_every_call(call):
    """load_file retried a refused connection silently for 3.6 s while read_metadata failed at
    once: nothing listens there, and every call says so at once, naming the URL."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/model/"
    calls = {
        "load_file": lambda: engine.torch.load_file(url),
        "safe_open": lambda: engine.safe_open(url, "np"),
        "read_checkpoint_info": lambda: engine.read_checkpoint_info(url),
        "read_header": lambda: engine.read_header(url),
        "stream": lambda: list(engine.stream(url, framework="np")),
    }
    t0 = time.monotonic()
    with pytest.raises(ReadError) as err:
        calls[call]()
    assert time.monotonic() - t0 < 0.5
    assert err.value.reason == "ConnectionError" and url in str(err.value) and "refused" in str(err.value)


# -- host memory: an owned load holds its tensors and a bounded margin, whatever the model's size ----
#: what an owned remote load may hold beyond its tensors: threads' stacks, connection buffers,
#: the headers, the interpreter's own allocations during the load (4 MiB measured on the 2-core VM)
RSS_MARGIN = 32 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
@pytest.mark.parametrize("where", ["big/model.safetensors.index.json", "big/s3"])
def test_an_owned_remote_load_holds_its_tensors_and_a_bounded_margin(tmp_path, where):
    """Peak RSS of a fresh process's owned load over nginx (HTTP and S3 path-style) is the
    tensors plus at most RSS_MARGIN, measured from after the imports."""
    import subprocess

    import numpy as np

    nginx_or_skip()
    rng = np.random.default_rng(3)
    sd = {f"layer.{i}.w": torch.from_numpy(rng.standard_normal((1024, 1024 + i), dtype=np.float32))
          for i in range(48)}
    tensor_bytes = sum(t.numel() * 4 for t in sd.values())  # about 200 MB
    engine.save_sharded(sd, tmp_path / "bucket" / "big", max_shard_size=60_000_000, fsync=False)
    del sd
    with Nginx(str(tmp_path)) as server:
        if where.endswith("s3"):
            url = "s3://bucket/big/model.safetensors.index.json"
            env = {**os.environ, "AWS_ENDPOINT_URL": server.base, "AWS_NO_SIGN_REQUEST": "1",
                   "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}
        else:
            url, env = server.url("bucket/" + where), dict(os.environ)
        code = (
            "import torch, engine.torch\n"
            "def status(key):\n"
            "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key))\n"
            "open('/proc/self/clear_refs', 'w').write('5')\n"
            "before = status('VmRSS:')\n"
            f"out = engine.torch.load_file({url!r})\n"
            "print(status('VmHWM:') - before, sum(t.numel() * t.element_size() for t in out.values()))\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    grew, loaded = map(int, run.stdout.split())
    assert loaded == tensor_bytes
    assert tensor_bytes <= grew <= tensor_bytes + RSS_MARGIN, (grew - tensor_bytes) >> 20
