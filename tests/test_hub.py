"""engine.net._hub and hf:// loads against a Hub-shaped server (tests/servers.py HubServer): the
revision resolved once to its commit, resolve URLs followed to a CDN on another port without the
token, the token from the environment, the token file or headers=, gated repos, the local Hub
cache, every entry point."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import engine
import engine.numpy
from engine.errors import ReadError, RemoteFileNotFoundError
from engine.net._hub import HubPath, from_hub_url, hub_token, split_hf_url

sys.path.insert(0, os.path.dirname(__file__))
from servers import HubServer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "hf_test_token_0123456789"


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    sd = {f"model.layers.{i}.w": rng.standard_normal((48, 40 + 4 * i)).astype(np.float32) for i in range(6)}
    sd["model.embed"] = rng.integers(-100, 100, (30, 8), dtype=np.int64)
    return sd


def _size(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


@contextlib.contextmanager
def published(root):
    """The Hub with ``org/tiny`` (gated, sharded with its index; also tagged ``v1``), ``org/open``
    (public, one file and a README), ``org/multi`` (public, two files and no index), ``org/private``
    and an older commit of ``org/tiny`` on the branch ``old``: ``(server, tensors)``."""
    sd = tensors()
    engine.save_sharded(sd, root / "tiny", max_shard_size=12_000, fsync=False)
    (root / "open").mkdir()
    engine.numpy.save_file(sd, str(root / "open" / "model.safetensors"))
    (root / "open" / "README.md").write_text("a model")
    (root / "multi").mkdir()
    names = sorted(sd)
    engine.numpy.save_file({k: sd[k] for k in names[:3]}, str(root / "multi" / "a.safetensors"))
    engine.numpy.save_file({k: sd[k] for k in names[3:]}, str(root / "multi" / "b.safetensors"))
    (root / "multi" / "sub").mkdir()
    engine.numpy.save_file({"other": np.zeros(3, np.float32)}, str(root / "multi" / "sub" / "c.safetensors"))
    (root / "old").mkdir()
    engine.numpy.save_file({"old": np.arange(4, dtype=np.int32)}, str(root / "old" / "model.safetensors"))
    with HubServer(str(root / "served")) as server:
        server.tokens.add(TOKEN)
        server.shas = {"old": server.add("org/tiny", str(root / "old"), gated=True, refs=("old",)),
                       "tiny": server.add("org/tiny", str(root / "tiny"), gated=True, refs=("main", "v1")),
                       "open": server.add("org/open", str(root / "open")),
                       "multi": server.add("org/multi", str(root / "multi")),
                       "private": server.add("org/private", str(root / "open"), private=True)}
        server.folders = root
        yield server, sd


def hub_environment(server, monkeypatch, home) -> None:
    """The Hub's endpoint, a token in ``HF_TOKEN``, ``HF_HOME`` at ``home``, nothing else of the Hub's."""
    server.reset()
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN_PATH",
              "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with published(tmp_path_factory.mktemp("hub")) as got:
        yield got


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    """:func:`hub_environment` with an empty ``HF_HOME``, checked empty after the test."""
    hub_environment(hub[0], monkeypatch, tmp_path / "hf_home")
    yield hub[0]
    assert not (tmp_path / "hf_home").exists() or not os.listdir(tmp_path / "hf_home"), "wrote under HF_HOME"


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])


def _no_token_at_the_cdn(server) -> None:
    assert server.cdn.requests, "nothing was read from the CDN"
    assert all(r["authorization"] is None for r in server.cdn.requests), "the token reached the CDN"


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize("url, want", [
    ("hf://org/name", HubPath("model", "org/name", None, "")),
    ("hf://org/name/", HubPath("model", "org/name", None, "")),
    ("hf://org/name@v1.0/sub/model.safetensors", HubPath("model", "org/name", "v1.0", "sub/model.safetensors")),
    ("hf://org/name@refs/pr/3/model.safetensors", HubPath("model", "org/name", "refs/pr/3", "model.safetensors")),
    ("hf://org/name@refs%2Fpr%2F3", HubPath("model", "org/name", "refs/pr/3", "")),
    ("hf://datasets/org/data/x.safetensors", HubPath("dataset", "org/data", None, "x.safetensors")),
    ("hf://gpt2", HubPath("model", "gpt2", None, "")),
    ("hf://gpt2/model.safetensors", HubPath("model", "gpt2", None, "model.safetensors")),
    ("hf://gpt2@main/model.safetensors", HubPath("model", "gpt2", "main", "model.safetensors")),
])
def test_hf_urls_name_a_repo_a_revision_and_a_path(url, want):
    assert split_hf_url(url) == want


@pytest.mark.parametrize("url", ["hf://org/name/../other/x.safetensors", "hf://org/na me", "hf://org/name@",
                                 "hf://", "hf://org/..%2Fx"])
def test_a_malformed_hf_url_is_an_invalid_url(url):
    with pytest.raises(ReadError) as e:
        split_hf_url(url)
    assert e.value.reason == "InvalidURL"


@pytest.mark.parametrize("url, want", [
    ("https://huggingface.co/org/name", "hf://org/name"),
    ("https://huggingface.co/org/name/tree/main", "hf://org/name@main"),
    ("https://huggingface.co/org/name/tree/v1.0/sub", "hf://org/name@v1.0/sub"),
    ("https://huggingface.co/org/name/resolve/main/model.safetensors.index.json",
     "hf://org/name@main/model.safetensors.index.json"),
    ("https://hf.co/org/name/blob/refs/pr/2/model.safetensors", "hf://org/name@refs%2Fpr%2F2/model.safetensors"),
    ("https://huggingface.co/datasets/org/data/tree/main", "hf://datasets/org/data@main"),
    ("https://huggingface.co/org/name/discussions/3", None),
    ("https://huggingface.co/org", None),
    ("https://mirror.example/org/name", None),
    ("https://huggingface.co/org/name/resolve/main/x.safetensors?download=true", None),
])
def test_the_hub_sites_own_urls_are_hf_urls(url, want):
    assert from_hub_url(url) == want
    if want is not None:
        assert split_hf_url(want).repo_id in ("org/name", "org/data")


def test_the_token_comes_from_the_environment_then_the_token_file(tmp_path, monkeypatch):
    for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert hub_token() is None
    (tmp_path / "token").write_text("hf_from_file\n")
    assert hub_token() == "hf_from_file"
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hub_token() == "hf_from_env"
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    assert hub_token() is None


# --------------------------------------------------------------------------- loads


def test_load_file_of_a_gated_sharded_repo_equals_the_files(hub, env):
    """The revision is resolved once; every file is read at its commit, through the Hub's
    302 to the CDN, which never sees the token and sends no more than the checkpoint."""
    import engine.torch

    server, sd = hub
    got = engine.torch.load_file("hf://org/tiny")
    _equal({k: v.numpy() for k, v in got.items()}, sd)
    sha = server.shas["tiny"]
    api = [p for p, _ in server.requests if p.startswith("/api/")]
    assert api == ["/api/models/org/tiny/revision/main?blobs=true"]
    resolves = [p for p, _ in server.requests if "/resolve/" in p]
    assert resolves and all(p.startswith(f"/org/tiny/resolve/{sha}/") for p in resolves)
    assert all(auth == f"Bearer {TOKEN}" for _, auth in server.requests)
    _no_token_at_the_cdn(server)
    assert server.cdn_bytes() <= 1.05 * _size(server.folders / "tiny")


def test_a_revision_is_read_at_its_commit(hub, env):
    server, _ = hub
    got = engine.numpy.load_file("hf://org/tiny@old")
    assert list(got) == ["old"] and got["old"].tolist() == [0, 1, 2, 3]
    assert all(server.shas["old"] in p for p, _ in server.requests if "/resolve/" in p)
    _equal(engine.numpy.load_file(f"hf://org/tiny@{server.shas['tiny']}/model.safetensors.index.json"), hub[1])


def test_a_repo_without_an_index_loads_every_safetensors_file_at_its_top(hub, env):
    server, sd = hub
    _equal(engine.numpy.load_file("hf://org/multi"), sd)  # sub/c.safetensors is one level down
    _equal(engine.numpy.load_file("hf://org/open"), sd)
    got = engine.numpy.load_file("hf://org/multi/sub")
    assert list(got) == ["other"]


def test_safe_open_load_into_and_stream(hub, env):
    import torch

    server, sd = hub
    with engine.safe_open("hf://org/tiny", framework="np") as f:
        assert sorted(f.keys()) == sorted(sd)
        np.testing.assert_array_equal(f.get_tensor("model.layers.2.w"), sd["model.layers.2.w"])
        np.testing.assert_array_equal(f.get_slice("model.embed")[3:5], sd["model.embed"][3:5])
    _equal(dict(engine.stream("hf://org/tiny", framework="np")), sd)
    dest = {k: torch.empty(v.shape, dtype=torch.from_numpy(v).dtype) for k, v in sd.items()}
    engine.load_into("hf://org/tiny", dest)
    _equal({k: v.numpy() for k, v in dest.items()}, sd)
    _no_token_at_the_cdn(server)


def test_engine_inspect_of_a_repo(hub, env, tmp_path):
    server, sd = hub
    child = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "engine", "inspect", "hf://org/tiny", "--json"], capture_output=True,
                         text=True, env=child, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    local = subprocess.run([sys.executable, "-m", "engine", "inspect", str(server.folders / "tiny"), "--json"],
                           capture_output=True, text=True, env=child, cwd=ROOT, timeout=120).stdout
    assert json.loads(text) == json.loads(local) and sorted(json.loads(text)["weight_map"]) == sorted(sd)


# --------------------------------------------------------------------------- tokens and refusals


def test_a_gated_repo_without_a_token_is_an_error_naming_the_repo(hub, env, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file("hf://org/tiny")
    msg = str(e.value)
    assert e.value.reason == "AccessDenied" and e.value.status == 401
    assert "org/tiny" in msg and "HF_TOKEN" in msg and "huggingface-cli login" in msg and "GatedRepo" in msg


def test_a_private_repo_without_a_token_is_an_error_naming_the_repo(hub, env, monkeypatch):
    """The Hub's API hides a private repo (401 ``RepoNotFound``) from a client without a token."""
    server, sd = hub
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file("hf://org/private")
    assert e.value.reason == "AccessDenied" and "org/private" in str(e.value) and "RepoNotFound" in str(e.value)
    assert "HF_TOKEN" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    _equal(engine.numpy.load_file("hf://org/private"), sd)


def test_a_wrong_token_is_an_error_naming_the_repo_and_never_the_token(hub, env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_secret")
    with pytest.raises(ReadError) as e:
        engine.numpy.load_file("hf://org/tiny/model.safetensors.index.json")
    assert e.value.reason == "AccessDenied" and "org/tiny" in str(e.value) and "refused" in str(e.value)
    assert "hf_wrong_secret" not in str(e.value) and "hf_wrong_secret" not in repr(e.value)


def test_the_token_file_under_hf_home_and_headers_give_the_token(hub, env, monkeypatch, tmp_path):
    server, sd = hub
    monkeypatch.delenv("HF_TOKEN")
    home = tmp_path / "login"
    home.mkdir()
    (home / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("HF_HOME", str(home))
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    assert os.listdir(home) == ["token"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "none"))
    _equal(engine.numpy.load_file("hf://org/tiny", headers={"Authorization": f"Bearer {TOKEN}"}), sd)
    _no_token_at_the_cdn(server)


def test_an_unknown_repo_revision_or_file_is_not_found(hub, env):
    with pytest.raises(RemoteFileNotFoundError, match="org/nothing"):
        engine.numpy.load_file("hf://org/nothing")
    with pytest.raises(RemoteFileNotFoundError, match="no-such-branch"):
        engine.numpy.load_file("hf://org/tiny@no-such-branch")
    with pytest.raises(RemoteFileNotFoundError, match="hf://org/open/missing.safetensors"):
        engine.numpy.load_file("hf://org/open/missing.safetensors")
    with pytest.raises(RemoteFileNotFoundError, match="no .safetensors file"):
        engine.numpy.load_file("hf://org/multi/nothing-here")


# --------------------------------------------------------------------------- the local Hub cache


def test_a_file_in_the_local_hub_cache_is_read_from_disk(hub, env, monkeypatch, tmp_path):
    """``HF_HUB_CACHE``'s snapshot of the commit holds one shard: it is read from there (no CDN
    request for it), the others from the CDN; the cache is left as it was."""
    server, sd = hub
    sha = server.shas["tiny"]
    cache = tmp_path / "cache"
    shards = sorted(f for f in os.listdir(server.folders / "tiny") if f.endswith(".safetensors"))
    snap = cache / "models--org--tiny" / "snapshots" / sha
    snap.mkdir(parents=True)
    (snap / shards[0]).write_bytes((server.folders / "tiny" / shards[0]).read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    before = sorted(str(p) for p in cache.rglob("*"))
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    cdn = {r["path"].rsplit("/", 1)[1] for r in server.cdn.requests}
    assert shards[0] not in cdn and set(shards[1:]) <= cdn
    assert sorted(str(p) for p in cache.rglob("*")) == before
    server.reset()
    with engine.safe_open("hf://org/tiny", framework="np") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.0.w"), sd["model.layers.0.w"])
    # a snapshot of another commit is not this one's
    other = cache / "models--org--tiny" / "snapshots" / ("0" * 40)
    other.mkdir()
    server.reset()
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)


def test_hf_urls_load_without_huggingface_hub(hub, env):
    """A fresh interpreter in which ``huggingface_hub`` cannot be imported loads a repo."""
    code = ("import sys; sys.modules['huggingface_hub'] = None; sys.modules['fsspec'] = None\n"
            "import engine.numpy\n"
            "got = engine.numpy.load_file('hf://org/open')\n"
            f"print(sorted(got) == sorted({sorted(hub[1])!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_the_load_of_a_repo_is_printed_by_the_cli_error_path(hub, env, monkeypatch):
    """``engine inspect`` of a gated repo without a token exits with the engine's message."""
    monkeypatch.delenv("HF_TOKEN")
    from engine.commands.cli import main

    err = io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        code = main(["inspect", "hf://org/tiny"])
    finally:
        sys.stderr = old
    assert code != 0 and "huggingface-cli login" in err.getvalue()


def test_tensor_parallel_loads_only_its_rows_from_the_repo(hub, env):
    from engine.distributed import ShardingPlan, Split, load_tensor_parallel

    server, sd = hub
    got = load_tensor_parallel("hf://org/tiny", ShardingPlan([("model.layers.*", Split(0))]), rank=1, world_size=2)
    for name, want in sd.items():
        part = want[want.shape[0] // 2:] if name.startswith("model.layers.") else want
        np.testing.assert_array_equal(got[name].numpy(), part)
    _no_token_at_the_cdn(server)


def test_hf_hub_offline_reads_the_local_cache_alone(hub, env, monkeypatch, tmp_path):
    """With ``HF_HUB_OFFLINE`` the revision comes from the cache's ``refs/``, the files from its
    snapshot, and no request reaches the Hub or the CDN; a file the cache lacks is not found."""
    server, sd = hub
    sha = server.shas["tiny"]
    repo = tmp_path / "cache" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in os.listdir(server.folders / "tiny"):
        (snap / f).write_bytes((server.folders / "tiny" / f).read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    _equal(engine.numpy.load_file(f"hf://org/tiny@{sha}/model.safetensors.index.json"), sd)
    assert server.requests == [] and server.cdn.requests == []
    shard = sorted(f for f in os.listdir(snap) if f.endswith(".safetensors"))[1]
    (snap / shard).unlink()
    with pytest.raises(RemoteFileNotFoundError, match="HF_HUB_OFFLINE"):
        engine.numpy.load_file("hf://org/tiny")
    with pytest.raises(RemoteFileNotFoundError, match="HF_HUB_OFFLINE"):
        engine.numpy.load_file("hf://org/open")
    assert server.requests == [] and server.cdn.requests == []


def test_an_expired_redirect_to_the_cdn_is_asked_for_again(hub, env):
    """The CDN's presigned URLs expire: a handle whose redirects have expired asks the Hub for
    them again and reads on; a CDN that still refuses is an AccessDenied after a bounded number
    of tries."""
    from engine.net.retry import Retry

    server, sd = hub
    fast = Retry(attempts=3, base=0.001, cap=0.01)

    def shard_resolves() -> int:
        return sum(1 for p, _ in server.requests if "/resolve/" in p and p.endswith(".safetensors"))

    server.ttl = 2.0
    try:
        with engine.safe_open("hf://org/tiny", framework="np", retry=fast) as f:
            first = shard_resolves()
            time.sleep(2.2)  # every redirect the headers followed has expired
            server.ttl = 3600.0
            for name in ("model.layers.0.w", "model.layers.5.w", "model.embed"):
                np.testing.assert_array_equal(f.get_tensor(name), sd[name])
            assert shard_resolves() > first  # asked for again
        server.reset()
        server.ttl = 2.0
        with engine.safe_open("hf://org/tiny", framework="np", retry=fast) as f:
            first = shard_resolves()
            time.sleep(2.2)
            server.ttl = 0.0  # every new redirect has expired too: the refusal stands
            with pytest.raises(ReadError) as e:
                f.get_tensor("model.layers.0.w")
            assert e.value.status == 403 and e.value.reason == "AccessDenied"
            assert shard_resolves() - first == 1  # one new redirect (a minute must pass for another)
    finally:
        server.ttl = 3600.0


def test_urls_get_tensor_of_a_repo(hub, env):
    """``engine.urls.remote.get_tensor`` of a repo: its index's shard, or the one of several files
    that holds the tensor."""
    from engine.urls import remote

    server, sd = hub
    for url in ("hf://org/tiny", "hf://org/multi", "hf://org/open/model.safetensors"):
        for name in ("model.layers.1.w", "model.layers.4.w"):
            np.testing.assert_array_equal(remote.get_tensor(url, name), sd[name])
