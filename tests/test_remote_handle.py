"""engine.urls.remote_handle: engine.safe_open(url) against nginx, equal to the local handle;
slices request only the rows they select (counted on tests/rangeserver.py)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import engine
import engine.numpy
from engine.errors import InvalidSliceError, TensorNotFoundError

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import nginx_serving  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-handle")
    rng = np.random.default_rng(0)
    sd = {
        "a.weight": rng.standard_normal((64, 256)).astype(np.float32),
        "b.weight": rng.standard_normal((300, 40)).astype(np.float16),
        "c.ids": np.arange(1000, dtype=np.int64),
        "d.empty": np.zeros((0, 4), np.float32),
    }
    engine.numpy.save_file(sd, root / "one.safetensors", metadata={"format": "np", "k": "v"})
    engine.save_sharded({k: torch.from_numpy(v) for k, v in sd.items()}, root / "ckpt", max_shard_size=70_000,
                        fsync=False)
    return root, sd


@pytest.fixture(scope="module")
def nginx(files):
    with nginx_serving(files[0]) as server:
        yield server


@pytest.mark.parametrize("where", ["one.safetensors", "ckpt/model.safetensors.index.json", "ckpt/"])
def test_safe_open_of_a_url_is_a_safe_open_with_the_local_contents(files, nginx, where):
    root, sd = files
    with engine.safe_open(nginx.url(where), framework="np") as f, \
            engine.safe_open(str(root / where.rstrip("/")), framework="np") as local:
        assert isinstance(f, engine.safe_open)
        assert f.keys() == local.keys() == sorted(sd) and len(f) == len(sd) and "a.weight" in f
        assert f.offset_keys() == local.offset_keys()
        if where == "one.safetensors":
            assert f.metadata() == local.metadata() == {"format": "np", "k": "v"}
        for k, v in sd.items():
            assert f.get_tensor(k).tobytes() == v.tobytes() and f.get_tensor(k).shape == v.shape
            s = f.get_slice(k)
            assert s.get_shape() == list(v.shape) and s.get_dtype() == local.get_slice(k).get_dtype()
        got = f.get_tensors()
        assert list(got) == f.offset_keys() and all(got[k].tobytes() == sd[k].tobytes() for k in sd)


@pytest.mark.parametrize("index", [np.s_[3:9], np.s_[3:9, 100:200:3], np.s_[::-2, 5], np.s_[-1], np.s_[...],
                                   np.s_[:, :0]])
def test_slices_equal_numpy_indexing(files, nginx, index):
    _, sd = files
    with engine.safe_open(nginx.url("one.safetensors"), framework="np") as f:
        got = f.get_slice("a.weight")[index]
    want = sd["a.weight"][index]
    assert got.shape == want.shape and np.array_equal(got, want)
    with engine.safe_open(nginx.url("one.safetensors"), framework="pt") as f:
        t = f.get_slice("a.weight")[index]
    assert torch.equal(t, torch.from_numpy(np.ascontiguousarray(want)))


def test_errors_name_the_tensor_and_the_url(files, nginx):
    url = nginx.url("one.safetensors")
    with engine.safe_open(url, framework="np") as f:
        with pytest.raises(TensorNotFoundError) as err:
            f.get_tensor("nope")
        assert "nope" in str(err.value)
        with pytest.raises(InvalidSliceError) as err2:
            f.get_slice("a.weight")[99]
        assert "a.weight" in str(err2.value) and err2.value.path == url


def test_a_slice_requests_only_the_rows_it_selects(files):
    root, sd = files
    server = serve(str(root))
    try:
        with engine.safe_open(server.url("one.safetensors"), framework="np") as f:
            server.reset()
            rows = f.get_slice("a.weight")[10:12]
            # a column block of every row: neighbouring runs share one request
            cols = f.get_slice("a.weight")[:, 7:9]
        assert np.array_equal(rows, sd["a.weight"][10:12]) and np.array_equal(cols, sd["a.weight"][:, 7:9])
        gets = [r for r in server.requests if r["range"]]
        assert len(gets) == 2
        first, last = (int(x) for x in gets[0]["range"].removeprefix("bytes=").split("-"))
        assert last - first + 1 == 2 * 256 * 4  # two rows, nothing more
    finally:
        server.stop()


def test_a_large_tensor_is_read_by_several_connections(files, monkeypatch):
    import engine.urls.remote_handle as rh

    root, sd = files
    monkeypatch.setattr(rh, "_SPLIT_BYTES", 4096)
    server = serve(str(root))
    try:
        with engine.safe_open(server.url("one.safetensors"), framework="np", connections=4) as f:
            server.reset()
            got = f.get_tensor("a.weight")
        assert got.tobytes() == sd["a.weight"].tobytes()
        assert len([r for r in server.requests if r["range"]]) == 4
    finally:
        server.stop()
