"""engine/urls/remote_cache.py: ``cache_dir=`` local copies written in the same pass as a remote load,
against tests/rangeserver.py (it counts the data GETs and injects faults) and nginx (HTTP and
path-style S3)."""

from __future__ import annotations

import contextlib
import email.utils
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import engine
import engine.numpy
import engine.torch
from engine.errors import CacheWriteWarning, ReadError, WriteError
from engine.net.retry import Retry
from engine.urls import remote_cache

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import Nginx, StdlibHTTP, nginx_or_skip  # noqa: E402
from torch_models import assert_same, llama, raw  # noqa: E402

INDEX = "model.safetensors.index.json"
FAST = Retry(attempts=2, base=0.001, cap=0.01)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-cache")
    sd = llama()
    engine.save_sharded(sd, root / "sharded", max_shard_size=800_000, fsync=False)
    engine.save_sharded(sd, root / "single", fsync=False)
    assert len(list((root / "sharded").glob("*.safetensors"))) >= 3
    return root, sd


@pytest.fixture
def tree(saved, tmp_path):
    """A copy of the saved checkpoints per test (tests change files on the server)."""
    root = tmp_path / "www"
    shutil.copytree(saved[0], root)
    return root, saved[1]


def _fresh(server) -> None:
    server.reset()
    server.keepalive, server.etags = True, True


@pytest.fixture
def server(tree):
    s = serve(str(tree[0]))
    _fresh(s)
    yield s
    s.stop()


def _copies(d) -> dict[str, str]:
    """The copies in ``d``: served file name -> path; each has its sidecar and nothing else
    is there."""
    entries = sorted(os.listdir(d))
    data = [e for e in entries if not e.endswith(".json")]
    assert entries == sorted(data + [e + ".json" for e in data]), entries
    return {e.split("-", 2)[2]: os.path.join(d, e) for e in data}


def _shards(root, where="sharded") -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / where).glob("*.safetensors")}


def _assert_copies_are(d, served: dict[str, bytes]) -> None:
    got = _copies(d)
    assert sorted(got) == sorted(served)
    for name, path in got.items():  # each copy is the served file, byte for byte
        with open(path, "rb") as f:
            assert f.read() == served[name], name


def _rewrite_same_version(path) -> None:
    """Other bytes in ``path`` under the same size and mtime: the server's ETag stays."""
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _touch_later(path, seconds: int = 10) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


# -- the first load writes, the next reads ---------------------------------------------------------
@pytest.mark.parametrize("where", ["single/model.safetensors", f"sharded/{INDEX}", "sharded/"])
def test_a_first_load_writes_byte_equal_copies_and_the_next_reads_them(tree, server, tmp_path, where):
    root, sd = tree
    d = tmp_path / "cache"
    got = engine.torch.load_file(server.url(where), cache_dir=d)
    assert_same(got, sd)
    served = _shards(root, where.split("/")[0])
    _assert_copies_are(d, served)
    for name, path in _copies(d).items():
        side = json.loads(open(path + ".json").read())
        url = server.url(f"{where.split('/')[0]}/{name}")
        fetched = side.pop("fetched")  # the Date of the header's answer
        assert side == {"url": url, "etag": server.etag(str(root / where.split("/")[0] / name)),
                        "size": len(served[name])}
        assert email.utils.parsedate_to_datetime(fetched).tzinfo is not None
        assert remote_cache.entry_path(str(d), url, side["etag"], None, side["size"]) == path
    # the next load asks for the headers only, and reads the copies
    before = sorted(os.listdir(d))
    _fresh(server)
    again = engine.torch.load_file(server.url(where), cache_dir=d)
    assert_same(again, sd)
    assert server.data_gets == 0 and server.requests
    assert sorted(os.listdir(d)) == before


def test_a_copy_is_read_only_while_the_server_has_its_version(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url("single/model.safetensors")
    engine.torch.load_file(url, cache_dir=d)
    (old,) = _copies(d).values()
    # other bytes under the same ETag (size and mtime kept): the copy is what is read
    _rewrite_same_version(root / "single/model.safetensors")
    cached = engine.torch.load_file(url, cache_dir=d)
    assert_same(cached, sd)
    # a new version on the server (its ETag changes): never served from the copy
    server.generation += 1
    fresh = engine.torch.load_file(url, cache_dir=d)
    plain = engine.torch.load_file(url)
    assert any(raw(fresh[k]) != raw(sd[k]) for k in sd)  # the rewritten bytes, not the copy's
    assert all(raw(fresh[k]) == raw(plain[k]) for k in sd)
    # the new version replaced the old one, copy and sidecar
    _assert_copies_are(d, _shards(root, "single"))
    assert not os.path.exists(old) and not os.path.exists(old + ".json")


# -- only what landed whole ---------------------------------------------------------------------------
def test_a_partial_selection_writes_no_copy_of_a_file_it_did_not_read_whole(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    index = engine.read_checkpoint_info(str(root / "sharded")).weight_map
    by_shard: dict[str, list[str]] = {}
    for name, shard in index.items():
        by_shard.setdefault(shard, []).append(name)
    shard, names = max(by_shard.items(), key=lambda kv: len(kv[1]))
    assert len(names) > 1
    got = dict(engine.stream(url, framework="pt", names=names[:1], cache_dir=d))
    assert list(got) == names[:1]
    assert os.listdir(d) == []
    # every tensor of one shard: that shard's copy, and no other
    got = dict(engine.stream(url, framework="pt", names=names, cache_dir=d))
    assert sorted(got) == sorted(names)
    _assert_copies_are(d, {shard: (root / "sharded" / shard).read_bytes()})


def test_a_file_is_copied_only_when_its_whole_data_region_landed(tree, tmp_path):
    """The coverage check itself: bytes counted and the union of the ranges compared with the
    data region (a range twice and a gap of the same size is not a whole file)."""
    root, _ = tree
    path = root / "single/model.safetensors"
    data = path.read_bytes()
    header = engine.read_header(str(path))
    raw_header = data[: header.data_start]
    ds, size = header.data_start, header.file_size
    half = ds + (size - ds) // 2
    q = ds + (size - ds) // 4
    for ranges, whole in [([(ds, half), (half, size)], True), ([(half, size), (ds, half)], True),
                          ([(ds, half), (ds, half)], False), ([(ds, half)], False),
                          ([(ds, q), (ds, q), (2 * q - ds, size)], False),  # the right count, a gap
                          ([(ds, half), (half + 1, size), (half, half + 1)], True),
                          ([(ds, half), (half, size), (half, half + 1)], False)]:
        d = tmp_path / f"c{len(os.listdir(tmp_path))}"
        copies = remote_cache.Copies(d)
        write = copies.wrap("http://h/model.safetensors", '"e"', None, header, raw_header, lambda o, v: None)
        for a, b in ranges:
            write(a, [memoryview(data)[a:b]])
        assert bool(copies.commit()) == whole, ranges
        copies.close()
        if whole:
            assert open(remote_cache.entry_path(d, "http://h/model.safetensors", '"e"', None, size), "rb").read() \
                == data
        else:
            assert os.listdir(d) == []


# -- nothing of a load that did not succeed ------------------------------------------------------------
def test_a_failed_or_abandoned_load_leaves_nothing(tree, server, tmp_path):
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    server.faults = {3: "403"}
    with pytest.raises(ReadError):
        engine.torch.load_file(url, cache_dir=d, retry=FAST)
    assert os.listdir(d) == []
    # a body cut short on every try: a read error
    server.faults = lambda n, path, first, last: "short" if n >= 2 else None
    with pytest.raises(ReadError):
        engine.torch.load_file(url, cache_dir=d, retry=FAST)
    assert os.listdir(d) == []
    server.faults = {}
    # a consumer that stops after the first tensor: the load did not succeed, nothing is named
    stream = engine.stream(url, framework="pt", cache_dir=d)
    next(stream)
    stream.close()
    assert os.listdir(d) == []


def test_a_load_killed_midway_leaves_nothing(tree, server, tmp_path):
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    server.faults = {2: "slow"}  # the second body stalls; the others land and are written
    server.stall = 60.0
    code = (
        f"import sys; sys.path.insert(0, {os.getcwd()!r})\n"
        "import engine.torch\n"
        f"engine.torch.load_file({url!r}, cache_dir={str(d)!r})\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while server.data_gets < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.data_gets >= 4
        time.sleep(0.5)  # their bytes written into the unnamed copies
        assert child.poll() is None  # still waiting for the stalled body
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    assert os.listdir(d) == []


# -- versions -----------------------------------------------------------------------------------------
def test_without_an_etag_last_modified_and_size_tell_versions_apart(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    path = root / "single/model.safetensors"
    url = server.url("single/model.safetensors")
    server.etags, server.last_modified = False, True
    _touch_later(path, -10)  # changed seconds before the copy is made: a copy to trust
    assert_same(engine.torch.load_file(url, cache_dir=d), sd)
    ((name, copy),) = _copies(d).items()
    side = json.loads(open(copy + ".json").read())
    assert side["etag"] is None and side["last_modified"].endswith("GMT")
    _rewrite_same_version(path)  # same size, same second: the copy is read
    server.reset()
    server.etags, server.last_modified = False, True
    assert_same(engine.torch.load_file(url, cache_dir=d), sd)
    assert server.data_gets == 0
    _touch_later(path)  # a new Last-Modified: the server's bytes, and a new copy
    fresh = engine.torch.load_file(url, cache_dir=d)
    assert any(raw(fresh[k]) != raw(sd[k]) for k in sd)
    assert server.data_gets > 0
    _assert_copies_are(d, _shards(root, "single"))
    # a weak ETag beside Last-Modified: both are the version
    server.etags, server.weak_etags = True, True
    engine.torch.load_file(url, cache_dir=d)
    ((_, copy),) = _copies(d).items()
    assert json.loads(open(copy + ".json").read())["etag"].startswith("W/")


@pytest.mark.filterwarnings("ignore::engine.errors.RangeIgnoredWarning")
def test_a_file_read_from_its_copy_keeps_no_whole_file_answer_open(tmp_path):
    """http.server answers the header's request with the whole file: for a file then read
    from its copy, that answer is hung up on when the parts are opened, not handed to the
    load's reads to stay open (its connection held) until the load ends."""
    from engine.urls.remote_load import open_parts

    www, d = tmp_path / "www", tmp_path / "cache"
    www.mkdir()
    sd = {"w": np.arange(4096, dtype=np.float32)}
    engine.numpy.save_file(sd, str(www / "m.safetensors"))
    os.utime(www / "m.safetensors", (time.time() - 10, time.time() - 10))  # a Last-Modified a copy can trust
    with StdlibHTTP(str(www)) as srv:
        url = srv.url("m.safetensors")
        engine.numpy.load_file(url, cache_dir=d)  # writes the copy
        with open_parts(url, cache_dir=d) as opened:
            assert opened.local()
            assert opened.reads._streams == {}  # no stream adopted for a file read locally


@pytest.mark.filterwarnings("ignore::engine.errors.RangeIgnoredWarning")
def test_a_change_within_the_second_of_a_copy_is_seen(tmp_path):
    """http.server tells versions apart by Last-Modified alone (no ETag).  A file written,
    loaded (its copy made) and rewritten under the same size, header and second: the next
    load must see the new bytes, not the copy.  Once that second is over, a copy is read."""
    www, d = tmp_path / "www", tmp_path / "cache"
    www.mkdir()
    path = www / "m.safetensors"
    rng = np.random.default_rng(5)
    old, new = ({"w": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(2))
    with StdlibHTTP(str(www)) as srv:
        url = srv.url("m.safetensors")
        for _ in range(5):
            time.sleep(1.01 - time.time() % 1)  # at the start of a second: all of it fits in that second
            second = int(time.time())
            engine.numpy.save_file(old, str(path))
            os.utime(path, (second, second))
            first = engine.numpy.load_file(url, cache_dir=d)
            engine.numpy.save_file(new, str(path))  # the same header, other bytes
            os.utime(path, (second, second))
            if int(time.time()) == second:
                break
            shutil.rmtree(d)
        else:
            pytest.skip("a load did not fit within one second five times")
        assert np.array_equal(first["w"], old["w"]) and len(_copies(d)) == 1
        assert np.array_equal(engine.numpy.load_file(url, cache_dir=d)["w"], new["w"])
        # a copy made in a later second than its Last-Modified is read
        time.sleep(1.01 - time.time() % 1)
        engine.numpy.load_file(url, cache_dir=d)
        ((_, copy),) = _copies(d).items()
        made = os.stat(copy).st_ino
        side = json.loads(open(copy + ".json").read())
        assert email.utils.parsedate_to_datetime(side["fetched"]) > email.utils.parsedate_to_datetime(
            side["last_modified"])
        assert np.array_equal(engine.numpy.load_file(url, cache_dir=d)["w"], new["w"])
        assert os.stat(copy).st_ino == made  # read, not written again


def test_no_copy_without_a_strong_etag_or_last_modified(tree, server, tmp_path):
    d = tmp_path / "cache"
    server.etags = False
    with pytest.warns(CacheWriteWarning, match="neither a strong ETag nor Last-Modified"):
        engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=d)
    assert os.listdir(d) == []
    server.etags, server.weak_etags = True, True
    with pytest.warns(CacheWriteWarning, match="versions cannot be told apart"):
        engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=d)
    assert os.listdir(d) == []
    assert remote_cache.entry_path(str(d), "http://h/m.safetensors", None, None, 5) is None
    assert remote_cache.entry_path(str(d), "http://h/m.safetensors", 'W/"x"', None, 5) is None


def test_no_copy_through_fsspec(tree, tmp_path):
    pytest.importorskip("fsspec")
    root, sd = tree
    d = tmp_path / "cache"
    with pytest.warns(CacheWriteWarning, match="fsspec"):
        got = engine.torch.load_file(f"file://{root}/single/model.safetensors", cache_dir=d)
    assert_same(got, sd)
    assert os.listdir(d) == []


def test_a_copy_the_engine_did_not_write_whole_is_never_read(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url("single/model.safetensors")
    engine.torch.load_file(url, cache_dir=d)
    (copy,) = _copies(d).values()
    good = open(copy, "rb").read()
    side = open(copy + ".json", "rb").read()

    def loads_from_server() -> bool:
        _fresh(server)
        assert_same(engine.torch.load_file(url, cache_dir=d), sd)
        return server.data_gets > 0

    with open(copy, "ab") as f:  # another size
        f.write(b"x")
    assert loads_from_server()
    with open(copy, "r+b") as f:  # another header (its first bytes), same size
        f.write(good[:8] + b"[" + good[9:64])
    assert loads_from_server()
    os.unlink(copy + ".json")  # no sidecar: the copy is not known to be of this URL and version
    assert loads_from_server()
    with open(copy + ".json", "wb") as f:
        f.write(side.replace(b'"size"', b'"sizes"'))
    assert loads_from_server()
    assert not loads_from_server()  # the last load wrote it again, whole


# -- names ---------------------------------------------------------------------------------------------
def test_names_hold_no_credentials_and_stay_in_the_cache(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    p = remote_cache.entry_path(str(d), "https://user:secret@h.example/a/..%2F..%2Fevil%20name.safetensors",
                                '"e"', None, 9)
    assert p is not None and "secret" not in p and "user" not in p
    assert os.path.dirname(p) == str(d)
    assert p.endswith("-evil_name.safetensors")
    same = remote_cache.entry_path(str(d), "https://h.example/a/..%2F..%2Fevil%20name.safetensors", '"e"', None, 9)
    assert same == p  # the URL without its password is the key
    assert remote_cache.entry_path(str(d), "https://h.example/x/.hidden", '"e"', None, 9).endswith("-hidden")
    assert os.path.dirname(remote_cache.entry_path(str(d), "https://h.example/..", '"e"', None, 9)) == str(d)
    # a load with a password in its URL and a token in a header: neither reaches a name or a sidecar
    url = server.url("single/model.safetensors").replace("http://", "http://user:secret@")
    assert_same(engine.torch.load_file(url + "?sig=tok-in-query", cache_dir=d,
                                       headers={"Authorization": "Bearer tok-in-header"}), sd)
    (copy,) = _copies(d).values()
    side = open(copy + ".json").read()
    for secret in ("secret", "tok-in-query", "tok-in-header"):
        assert secret not in copy and secret not in side
    assert json.loads(side)["url"] == server.url("single/model.safetensors")


# -- errors ------------------------------------------------------------------------------------------
def test_a_cache_dir_that_cannot_be_created_is_an_error_before_any_data_request(tree, server, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(WriteError, match="cache directory") as info:
        engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=blocker / "sub")
    assert info.value.reason == "CacheDirectory"
    assert server.data_gets == 0


@contextlib.contextmanager
def _read_only(d):
    """``d`` made read-only for this process: its mode, or, for root (whom modes do not
    stop), the immutable attribute (``chattr +i``, where the file system has it)."""
    os.chmod(d, 0o555)
    immutable = False
    try:
        if os.access(d, os.W_OK) and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0
        if os.access(d, os.W_OK):
            pytest.skip("no way to make a directory read-only for this user here")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(d)], check=True)
        os.chmod(d, 0o755)


def test_a_read_only_cache_dir_is_read_and_an_error_when_a_file_must_be_copied(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url("single/model.safetensors")
    engine.torch.load_file(url, cache_dir=d)
    with _read_only(d):
        _fresh(server)
        assert_same(engine.torch.load_file(url, cache_dir=d), sd)  # current copies: read
        assert server.data_gets == 0
        server.generation += 1  # a new version: it would have to be copied
        with pytest.raises(WriteError, match="not writable") as info:
            engine.torch.load_file(url, cache_dir=d)
        assert info.value.reason == "CacheDirectory"
        assert server.data_gets == 0


def test_a_copy_that_cannot_be_written_is_dropped_with_a_warning_and_the_load_goes_on(tree, server, tmp_path,
                                                                                        monkeypatch):
    root, sd = tree
    d = tmp_path / "cache"
    real = os.pwritev
    victim: list[int] = []

    def full(fd, views, offset):  # the first file a body is written to fails, each time
        if offset and not victim:
            victim.append(fd)
        if victim and fd == victim[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, views, offset)

    monkeypatch.setattr(remote_cache.os, "pwritev", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = engine.torch.load_file(server.url(f"sharded/{INDEX}"), cache_dir=d)
    assert_same(got, sd)
    found = [w for w in caught if issubclass(w.category, CacheWriteWarning)]
    assert len(found) == 1 and "No space left" in str(found[0].message)  # once, for the file it hit
    served = _shards(root)
    written = _copies(d)
    assert len(written) == len(served) - 1  # every other file got its copy
    _assert_copies_are(d, {k: served[k] for k in written})


# -- concurrent loaders --------------------------------------------------------------------------------
def test_concurrent_loads_into_one_cache_dir(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    results: list[object] = [None] * 4

    def load(i: int) -> None:
        try:
            results[i] = engine.torch.load_file(url, cache_dir=d)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for got in results:
        assert isinstance(got, dict), got
        assert_same(got, sd)
    _assert_copies_are(d, _shards(root))
    _fresh(server)
    assert_same(engine.torch.load_file(url, cache_dir=d), sd)
    assert server.data_gets == 0


# -- every entry point -------------------------------------------------------------------------------
def test_stream_load_into_and_numpy_take_cache_dir(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    engine.load_into(url, out, cache_dir=d)
    assert_same(dict(sorted(out.items())), sd)
    _assert_copies_are(d, _shards(root))
    _fresh(server)
    streamed = dict(sorted(engine.stream(url, framework="pt", cache_dir=d)))
    assert_same(streamed, sd)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    engine.load_into(url, out, cache_dir=d)
    assert_same(dict(sorted(out.items())), sd)
    arrays = engine.numpy.load_file(url, cache_dir=d)
    assert all(np.asarray(arrays[k]).tobytes() == raw(sd[k]) for k in sd)
    assert server.data_gets == 0


def test_safe_open_downloads_into_the_cache_then_reads_the_copies(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    first = sorted(sd)[0]
    with engine.safe_open(url, "pt", cache_dir=d) as f:
        # every file is downloaded at open, whole, and the handle reads the copies
        _assert_copies_are(d, _shards(root))
        gets = server.data_gets
        assert gets > 0
        assert raw(f.get_tensor(first)) == raw(sd[first])
        assert server.data_gets == gets
    _fresh(server)
    with engine.safe_open(url, "pt", cache_dir=d) as f:
        assert_same({k: f.get_tensor(k) for k in sorted(f.keys())}, sd)
        assert raw(f.get_slice(first)[:1]) == raw(sd[first][:1])
        assert_same(dict(sorted(f.get_tensors().items())), sd)
    assert server.data_gets == 0


def test_safe_open_downloads_through_a_buffer_where_the_file_cannot_be_mapped(tree, server, tmp_path, monkeypatch):
    root, sd = tree
    d = tmp_path / "cache"
    monkeypatch.setattr(remote_cache, "_mapping", lambda copy: None)
    with engine.safe_open(server.url("single/model.safetensors"), "pt", cache_dir=d, connections=3) as f:
        assert_same({k: f.get_tensor(k) for k in sorted(f.keys())}, sd)
    _assert_copies_are(d, _shards(root, "single"))


def test_a_failed_safe_open_download_leaves_nothing(tree, server, tmp_path):
    d = tmp_path / "cache"
    server.faults = lambda n, path, first, last: "403" if n >= 3 else None
    with pytest.raises(ReadError):
        engine.safe_open(server.url(f"sharded/{INDEX}"), "pt", cache_dir=d, retry=FAST)
    assert os.listdir(d) == []


def test_a_device_load_writes_its_copies_from_the_ring(tree, server, tmp_path, monkeypatch):
    """Bodies received into the ring's page-locked chunks (the emulated CUDA runtime, its copies
    asynchronous) are written from the chunks, and the next device load reads the copies."""
    from emucudart import EmulatedRingOps, EmulatedSink, Emulator

    import engine.loading.loader
    from engine.gpu import rings
    from engine.gpu.records import load_records

    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    emulator = Emulator()
    for attempt in range(2):
        emulator.reset()
        ops = EmulatedRingOps(emulator)
        sink = EmulatedSink(ops)
        monkeypatch.setattr(engine.loading.loader, "get_sink", lambda framework, device, sink=sink: sink)
        try:
            with load_records() as records:
                got = dict(engine.stream(url, device="emulated", chunk_bytes=65536, slot_bytes=1 << 18, cache_dir=d))
        finally:
            rings.release_rings()
            ops.close()
        assert sorted(got) == sorted(sd)
        assert all(got[k].tobytes() == raw(v) for k, v in sd.items())
        st = emulator.stats()
        assert st["registered"] == 0 and st["pageable"] == 0 and st["copies"] > 0, st
        assert [r.source == "network" for r in records] == [attempt == 0]
        _assert_copies_are(d, _shards(root))
        if attempt == 0:
            _fresh(server)
    assert server.data_gets == 0


# -- nginx ---------------------------------------------------------------------------------------------
def test_nginx_copies_and_versions(tree, tmp_path):
    """nginx's ETag is the file's mtime and size: a rewrite under both is the same version
    (the copy is read: the proof that it is), a new mtime a new one (never the copy)."""
    nginx_or_skip()
    root, sd = tree
    d = tmp_path / "cache"
    with Nginx(str(root)) as ng:
        url = ng.url(f"sharded/{INDEX}")
        assert_same(engine.torch.load_file(url, cache_dir=d), sd)
        served = _shards(root)
        _assert_copies_are(d, served)
        for name in served:
            _rewrite_same_version(root / "sharded" / name)
        assert_same(engine.torch.load_file(url, cache_dir=d), sd)  # the copies' bytes, not the server's
        for name in served:
            _touch_later(root / "sharded" / name)
        fresh = engine.torch.load_file(url, cache_dir=d)
        assert all(raw(fresh[k]) == raw(v) for k, v in engine.torch.load_file(str(root / "sharded")).items())
        assert any(raw(fresh[k]) != raw(sd[k]) for k in sd)
        _assert_copies_are(d, _shards(root))  # the new versions replaced the old


def test_nginx_http_and_s3(saved, tmp_path):
    """Through nginx, as HTTP and as S3 path-style GETs: copies written, then read."""
    nginx_or_skip()
    root, sd = saved
    d = tmp_path / "cache"
    with Nginx(str(root)) as ng:
        env = {"AWS_ENDPOINT_URL": ng.base, "AWS_NO_SIGN_REQUEST": "1", "AWS_EC2_METADATA_DISABLED": "true",
               "AWS_DEFAULT_REGION": "us-east-1"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for url in (ng.url(f"sharded/{INDEX}"), f"s3://sharded/{INDEX}"):
                assert_same(engine.torch.load_file(url, cache_dir=d), sd)
                assert_same(engine.torch.load_file(url, cache_dir=d), sd)
                with engine.safe_open(url, "pt", cache_dir=d) as f:
                    assert_same({k: f.get_tensor(k) for k in sorted(f.keys())}, sd)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    shards = len(list((root / "sharded").glob("*.safetensors")))
    assert len(os.listdir(d)) == 2 * 2 * shards  # one copy and its sidecar per URL of each shard
