"""engine.tp_remote: load_tensor_parallel(url) gives each rank the shards of the local load,
requesting only its own byte ranges."""

from __future__ import annotations

import os
import sys

import pytest

import engine
from engine.distributed import ShardingPlan, Split, llama_plan, load_tensor_parallel

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from torch_models import llama, raw  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-remote")
    engine.save_sharded(llama(n_layers=2, width=64, vocab=256), root / "ckpt", max_shard_size=200_000, fsync=False)
    server = serve(str(root))
    yield root, server
    server.stop()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_equals_the_local_direct_load(served, world):
    root, server = served
    plan = llama_plan()
    for rank in range(world):
        got = load_tensor_parallel(server.url("ckpt/model.safetensors.index.json"), plan, rank=rank,
                                   world_size=world)
        want = load_tensor_parallel(str(root / "ckpt"), plan, rank=rank, world_size=world)
        assert list(got) == list(want)
        assert all(got[k].shape == want[k].shape and raw(got[k]) == raw(want[k]) for k in want)


def test_a_rank_requests_about_its_share(served):
    """Rows split along dim 0: each rank's requests cover its rows only."""
    root, server = served
    plan = ShardingPlan([("*", Split(0))])
    url = server.url("ckpt/model.safetensors.index.json")
    load_tensor_parallel(url, plan, rank=0, world_size=1)  # headers and index of a whole load
    server.reset()
    load_tensor_parallel(url, plan, rank=0, world_size=1)
    whole = sum(_span(r["range"]) for r in server.requests if r["range"] and r["range"] != "bytes=0-7")
    server.reset()
    load_tensor_parallel(url, plan, rank=1, world_size=4)
    quarter = sum(_span(r["range"]) for r in server.requests if r["range"] and r["range"] != "bytes=0-7")
    headers = sum(engine.read_header(str(f)).data_start - 8 for f in (root / "ckpt").glob("*.safetensors"))
    assert quarter - headers < (whole - headers) / 4 + 4096


def test_column_blocks_share_requests(served):
    root, server = served
    plan = ShardingPlan([("*", Split(-1))])
    url = server.url("ckpt/model.safetensors.index.json")
    want = load_tensor_parallel(str(root / "ckpt"), plan, rank=1, world_size=2)
    server.reset()
    got = load_tensor_parallel(url, plan, rank=1, world_size=2)
    assert list(got) == list(want) and all(raw(got[k]) == raw(want[k]) for k in want)
    data_gets = [r for r in server.requests if r["range"] and not r["range"].startswith("bytes=0-7")]
    rows = sum(t.shape[0] for t in want.values() if t.dim() == 2)
    assert len(data_gets) < rows / 8  # not one request per row


def _span(header: str) -> int:
    a, b = header.removeprefix("bytes=").split("-")
    return int(b) - int(a) + 1
