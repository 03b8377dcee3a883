"""engine.urls.hub_cache: ``cache_dir="hf"`` keeps an hf:// load's files in the local Hub cache, laid
out as huggingface_hub lays it out, against the Hub-shaped server of tests/servers.py."""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest

import engine
import engine.numpy

sys.path.insert(0, os.path.dirname(__file__))
from test_hub import _equal, hub_environment, published  # noqa: E402


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with published(tmp_path_factory.mktemp("hub")) as got:
        yield got


@pytest.fixture
def cache(hub, monkeypatch, tmp_path):
    """The Hub's environment, ``HF_HUB_CACHE`` in ``tmp_path``: the folder of ``org/tiny`` there."""
    hub_environment(hub[0], monkeypatch, tmp_path / "hf_home")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache" / "models--org--tiny"
    assert not (tmp_path / "hf_home").exists(), "wrote under HF_HOME"


def _files(server) -> dict[str, bytes]:
    folder = server.folders / "tiny"
    return {f: (folder / f).read_bytes() for f in os.listdir(folder)}


def test_a_load_keeps_its_files_in_the_hub_caches_layout(hub, cache):
    server, sd = hub
    sha = server.shas["tiny"]
    _equal(engine.numpy.load_file("hf://org/tiny", cache_dir="hf"), sd)
    files = _files(server)
    for name, data in files.items():
        link = cache / "snapshots" / sha / name
        assert link.is_symlink() and link.read_bytes() == data
        blob = os.path.basename(os.readlink(link))
        want = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        assert blob == want and os.readlink(link) == f"../../blobs/{blob}"
    assert (cache / "refs" / "main").read_text() == sha
    assert sorted(os.listdir(cache)) == ["blobs", "refs", "snapshots"]  # no staging left behind
    assert sorted(os.listdir(cache / "blobs")) == sorted(
        os.path.basename(os.readlink(cache / "snapshots" / sha / n)) for n in files)


def test_the_next_load_and_huggingface_hub_read_the_cache(hub, cache, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="huggingface_hub is a test extra")
    server, sd = hub
    engine.numpy.load_file("hf://org/tiny", cache_dir="hf")
    server.reset()
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    assert server.cdn.requests == []  # every shard from the cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    folder = huggingface_hub.snapshot_download("org/tiny", cache_dir=str(cache.parent), local_files_only=True)
    assert sorted(os.listdir(folder)) == sorted(_files(server))
    got = huggingface_hub.try_to_load_from_cache("org/tiny", "model.safetensors.index.json",
                                                 cache_dir=str(cache.parent))
    assert isinstance(got, str) and open(got, "rb").read() == _files(server)["model.safetensors.index.json"]


def test_safe_open_downloads_into_the_hub_cache(hub, cache):
    server, sd = hub
    with engine.safe_open("hf://org/tiny", framework="np", cache_dir="hf") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.3.w"), sd["model.layers.3.w"])
    snap = cache / "snapshots" / server.shas["tiny"]
    assert sorted(os.listdir(snap)) == sorted(_files(server))


def test_a_failed_load_leaves_nothing_in_the_hub_cache(hub, cache):
    server, _ = hub
    server.cdn.faults = {1: "404"}
    with pytest.raises(engine.errors.SafetensorError):
        engine.numpy.load_file("hf://org/tiny", cache_dir="hf")
    assert not cache.exists()


def test_without_cache_dir_hf_nothing_is_written(hub, cache):
    _, sd = hub
    _equal(engine.numpy.load_file("hf://org/tiny"), sd)
    assert not cache.exists()
