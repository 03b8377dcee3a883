"""engine.stats_file: statistics of every tensor of a file or sharded checkpoint."""

from __future__ import annotations

import ml_dtypes
import naive
import numpy as np
from test_kernels import assert_stats

import engine
import engine.numpy
from engine.checkpoints.checkpoint import save_sharded


def _state(rng):
    return {
        "a.f32": rng.standard_normal((7, 9)).astype(np.float32),
        "b.bf16": rng.standard_normal(33).astype(ml_dtypes.bfloat16),
        "c.ids": rng.integers(-5, 5, 40),
        "d.nan": np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32),
        "e.fp8": rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn),
        "f.empty": np.zeros((0, 3), np.float16),
    }


def test_every_supported_tensor_against_the_oracle(tmp_path):
    sd = _state(np.random.default_rng(0))
    path = tmp_path / "m.safetensors"
    engine.numpy.save_file(sd, path)
    got = engine.stats_file(path)
    order = [n for n in engine.open_checkpoint(path).offset_keys() if n != "e.fp8"]
    assert list(got) == order and set(order) == set(sd) - {"e.fp8"}  # file order; FP8 not summarised
    for name, s in got.items():
        assert_stats(s, naive.stats(sd[name]))


def test_names_and_shards(tmp_path):
    sd = _state(np.random.default_rng(1))
    del sd["e.fp8"]
    save_sharded(sd, tmp_path, max_shard_size=300)
    got = engine.stats_file(tmp_path, names=["c.ids", "a.f32"])
    assert sorted(got) == ["a.f32", "c.ids"]
    assert got["c.ids"].max == int(sd["c.ids"].max())
    assert_stats(got["a.f32"], naive.stats(sd["a.f32"]))
