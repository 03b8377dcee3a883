"""engine/remote_cache.py: ``cache_dir=`` local copies written in the same pass as a remote load."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import engine
import engine.torch
from engine import remote_cache
from engine.errors import ReadError, WriteError
from engine.remote_reads import Retry

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import Nginx, nginx_or_skip  # noqa: E402
from torch_models import assert_same, llama, raw  # noqa: E402

INDEX = "model.safetensors.index.json"
FAST = Retry(attempts=2, base=0.001, cap=0.01)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-cache")
    sd = llama()
    engine.save_sharded(sd, root / "sharded", max_shard_size=800_000, fsync=False)
    engine.save_sharded(sd, root / "single", fsync=False)
    return root, sd


@pytest.fixture
def tree(saved, tmp_path):
    """A copy of the saved checkpoints per test (tests change files on the server)."""
    root = tmp_path / "www"
    shutil.copytree(saved[0], root)
    return root, saved[1]


@pytest.fixture
def server(tree):
    s = serve(str(tree[0]))
    s.keepalive, s.etags = True, True
    yield s
    s.stop()


def _files(d) -> list[str]:
    """Every regular file under ``d``, relative."""
    out = []
    for top, _, names in os.walk(d):
        out += [os.path.relpath(os.path.join(top, n), d) for n in names]
    return sorted(out)


def _rewrite_same_version(path) -> None:
    """Other bytes in ``path`` under the same size and mtime: the server's ETag stays."""
    st = os.stat(path)
    data = bytearray(open(path, "rb").read())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    with open(path, "wb") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("where", ["single/model.safetensors", f"sharded/{INDEX}"])
def test_a_first_load_writes_byte_equal_copies_and_the_next_reads_them(tree, server, tmp_path, where):
    root, sd = tree
    d = tmp_path / "cache"
    got = engine.torch.load_file(server.url(where), cache_dir=d)
    assert_same(got, sd)
    copies = _files(d)
    served = sorted(p.name for p in (root / where).parent.glob("*.safetensors"))
    assert sorted(os.path.basename(c) for c in copies) == served
    for c in copies:  # each copy is the served file, byte for byte
        assert (d / c).read_bytes() == ((root / where).parent / os.path.basename(c)).read_bytes()
    # the next load asks for the headers only, and reads the copies
    server.reset()
    server.keepalive, server.etags = True, True
    again = engine.torch.load_file(server.url(where), cache_dir=d)
    assert_same(again, sd)
    assert server.data_gets == 0 and server.requests
    assert _files(d) == copies


def test_a_copy_is_read_only_while_the_server_has_its_version(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url("single/model.safetensors")
    engine.torch.load_file(url, cache_dir=d)
    (old,) = _files(d)
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
    (new,) = _files(d)
    assert new != old  # the new version replaced the old one
    assert (d / new).read_bytes() == (root / "single/model.safetensors").read_bytes()


def test_a_partial_selection_writes_no_copy_of_a_file_it_did_not_read_whole(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    name = sorted(sd)[0]
    got = dict(engine.stream(server.url(f"sharded/{INDEX}"), framework="pt", names=[name], cache_dir=d))
    assert list(got) == [name]
    index = engine.read_checkpoint_info(str(root / "sharded")).weight_map
    shard = index[name]
    only = [n for n in sd if index[n] == shard]
    # the shard holding it is copied only when it holds nothing else
    assert [os.path.basename(c) for c in _files(d)] == ([shard] if only == [name] else [])


def test_stream_load_into_and_safe_open_take_cache_dir(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    # safe_open writes no copy (it reads what is asked), but reads complete ones
    with engine.safe_open(url, "pt", cache_dir=d) as f:
        assert raw(f.get_tensor(sorted(sd)[0])) == raw(sd[sorted(sd)[0]])
    assert _files(d) == []
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    engine.load_into(url, out, cache_dir=d)
    assert_same(dict(sorted(out.items())), sd)
    copies = _files(d)
    assert len(copies) == len(list((root / "sharded").glob("*.safetensors")))
    server.reset()
    server.keepalive, server.etags = True, True
    streamed = dict(sorted(engine.stream(url, framework="pt", cache_dir=d)))
    assert_same(streamed, sd)
    with engine.safe_open(url, "pt", cache_dir=d) as f:
        assert_same({k: f.get_tensor(k) for k in sorted(f.keys())}, sd)
        assert raw(f.get_slice(sorted(sd)[0])[:1]) == raw(sd[sorted(sd)[0]][:1])
    assert server.data_gets == 0


def test_a_failed_or_abandoned_load_leaves_no_file(tree, server, tmp_path):
    d = tmp_path / "cache"
    url = server.url(f"sharded/{INDEX}")
    server.faults = {3: "403"}
    with pytest.raises(ReadError):
        engine.torch.load_file(url, cache_dir=d, retry=FAST)
    assert _files(d) == []
    server.faults = {}
    # a consumer that stops after the first tensor: the load did not succeed, nothing is named
    stream = engine.stream(url, framework="pt", cache_dir=d)
    next(stream)
    stream.close()
    assert _files(d) == []


def test_a_load_killed_midway_leaves_no_file(tree, server, tmp_path):
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
    assert _files(d) == []


def test_no_copy_without_a_strong_etag(tree, server, tmp_path):
    d = tmp_path / "cache"
    server.etags = False
    engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=d)
    assert _files(d) == []
    server.etags, server.weak_etags = True, True
    engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=d)
    assert _files(d) == []
    assert remote_cache.version_path(str(d), "http://h/m.safetensors", None, 5) is None
    assert remote_cache.version_path(str(d), "http://h/m.safetensors", 'W/"x"', 5) is None


def test_paths_never_hold_credentials_or_leave_the_cache(tmp_path):
    d = str(tmp_path)
    p = remote_cache.version_path(d, "https://user:secret@h.example/a/..%2F..%2Fevil%20name.safetensors", '"e"', 9)
    assert p is not None and "secret" not in p and "user" not in p
    assert os.path.dirname(os.path.dirname(os.path.dirname(p))) == d
    assert os.path.basename(p) == "evil_name.safetensors"
    same = remote_cache.version_path(d, "https://h.example/a/..%2F..%2Fevil%20name.safetensors", '"e"', 9)
    assert same == p  # the URL without its password is the key
    assert remote_cache.version_path(d, "https://h.example/x/.hidden", '"e"', 9).endswith(os.sep + "hidden")
    other = remote_cache.version_path(d, "https://h.example/a/..%2F..%2Fevil%20name.safetensors", '"f"', 9)
    assert os.path.dirname(other) != os.path.dirname(p)  # another version, beside it


def test_a_cache_dir_that_cannot_be_written_is_an_error_before_any_request(tree, server, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(WriteError, match="cache directory"):
        engine.torch.load_file(server.url("single/model.safetensors"), cache_dir=blocker / "sub")
    assert server.data_gets == 0


def test_a_copy_of_another_size_is_never_read(tree, server, tmp_path):
    root, sd = tree
    d = tmp_path / "cache"
    url = server.url("single/model.safetensors")
    engine.torch.load_file(url, cache_dir=d)
    (copy,) = _files(d)
    with open(d / copy, "ab") as f:  # not what the engine wrote: a copy must have the file's size
        f.write(b"x")
    server.reset()
    server.keepalive, server.etags = True, True
    assert_same(engine.torch.load_file(url, cache_dir=d), sd)
    assert server.data_gets > 0


def test_s3_and_nginx(saved, tmp_path):
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
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    shards = len(list((root / "sharded").glob("*.safetensors")))
    assert len(_files(d)) == 2 * shards  # one copy per URL of each shard


def test_a_copy_that_cannot_be_written_is_dropped_with_a_warning_and_the_load_goes_on(tree, server, tmp_path,
                                                                                        monkeypatch):
    import errno
    import warnings

    from engine.errors import CacheWriteWarning

    root, sd = tree
    d = tmp_path / "cache"
    real = os.pwritev
    victim = []

    def full(fd, views, offset):  # the first file written to fails, each time
        if not victim:
            victim.append(fd)
        if fd == victim[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, views, offset)

    monkeypatch.setattr(remote_cache.os, "pwritev", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = engine.torch.load_file(server.url(f"sharded/{INDEX}"), cache_dir=d)
    assert_same(got, sd)
    found = [w for w in caught if issubclass(w.category, CacheWriteWarning)]
    assert len(found) == 1 and "No space left" in str(found[0].message)  # once, for the file it hit
    shards = len(list((root / "sharded").glob("*.safetensors")))
    written = _files(d)
    assert len(written) == shards - 1  # every other file got its copy
    for c in written:
        assert (d / c).read_bytes() == (root / "sharded" / os.path.basename(c)).read_bytes()

