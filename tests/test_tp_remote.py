"""engine.parallel.tp_remote: load_tensor_parallel(url) gives each rank the shards of the local load,
requesting only its own byte ranges."""

from __future__ import annotations

import os
import sys
import time

import pytest

import engine
from engine.distributed import ShardingPlan, Split, llama_plan, load_tensor_parallel
from engine.net.retry import Retry

sys.path.insert(0, os.path.dirname(__file__))
from rangeserver import serve  # noqa: E402
from servers import MotoS3, moto_available  # noqa: E402
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


def test_the_remote_options_of_load_file_over_http(served, tmp_path):
    """headers, timeout, retry and cache_dir as load_file(url) takes them: the header goes
    with every request, a first load of the whole checkpoint writes the copies and a second
    reads them (its only requests are the headers')."""
    root, server = served
    plan = llama_plan()
    url = server.url("ckpt/model.safetensors.index.json")
    want = load_tensor_parallel(str(root / "ckpt"), plan, rank=0, world_size=1)
    options = {"headers": {"Authorization": "Bearer t0ken"}, "timeout": 10.0, "retry": Retry(attempts=2, base=0.001),
               "cache_dir": str(tmp_path / "cache")}
    server.last_modified = True  # what the copies' versions are told apart by
    # files written within the second of the first load would be fetched again (a copy told
    # apart by Last-Modified alone must be made in a later second than it): make them older
    old = time.time() - 10
    for p in (root / "ckpt").iterdir():
        os.utime(p, (old, old))
    try:
        for run in range(2):
            server.reset()
            got = load_tensor_parallel(url, plan, rank=0, world_size=1, threads=2, **options)
            assert list(got) == list(want) and all(raw(got[k]) == raw(want[k]) for k in want)
            assert server.requests and all(r["authorization"] == "Bearer t0ken" for r in server.requests)
            data = [r for r in server.requests if r["range"] and not r["range"].startswith(("bytes=0-7", "bytes=8-"))]
            assert (len(data) > 0) if run == 0 else data == []
    finally:
        server.last_modified = False
    assert len(list((tmp_path / "cache").glob("*.json"))) == len(list((root / "ckpt").glob("*.safetensors")))
    with pytest.raises(TypeError, match="local path"):
        load_tensor_parallel(str(root / "ckpt"), plan, rank=0, world_size=1, timeout=3.0)
    with pytest.raises(TypeError, match="unexpected"):
        load_tensor_parallel(url, plan, rank=0, world_size=1, chunk_bytes=1 << 16)


def test_the_remote_options_over_s3(tmp_path, monkeypatch):
    """s3= (endpoint, anonymous), timeout and cache_dir from an S3 prefix that holds the
    shards and no index, against moto's S3 server."""
    if not moto_available():
        pytest.skip("moto's S3 server needs moto[server] and flask (a test extra)")
    sd = llama(n_layers=1, width=32, vocab=64)
    engine.save_sharded(sd, tmp_path / "ckpt", max_shard_size=20_000, fsync=False)
    plan = ShardingPlan([("*", Split(0))])
    want = load_tensor_parallel(str(tmp_path / "ckpt"), plan, rank=1, world_size=2)
    with MotoS3() as server:
        client = server.client("s3")
        client.create_bucket(Bucket="models")
        for p in (tmp_path / "ckpt").glob("*.safetensors"):
            client.put_object(Bucket="models", Key=f"bare/{p.name}", Body=p.read_bytes())
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_NO_SIGN_REQUEST"):
            monkeypatch.delenv(name, raising=False)
        for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                            ("AWS_EC2_METADATA_DISABLED", "true")):
            monkeypatch.setenv(name, value)
        s3 = {"endpoint_url": server.endpoint, "region": "us-east-1"}  # the endpoint from the options, not the environment
        for _ in range(2):
            got = load_tensor_parallel("s3://models/bare/", plan, rank=1, world_size=2, s3=s3, timeout=20.0)
            assert sorted(got) == sorted(want) and all(raw(got[k]) == raw(want[k]) for k in want)
        # a rank of two receives only its slices, so no file comes whole: a copy is written by
        # a load that reads whole files (one rank), and read back by the next
        whole = load_tensor_parallel(str(tmp_path / "ckpt"), plan, rank=0, world_size=1)
        for _ in range(2):
            got = load_tensor_parallel("s3://models/bare/", plan, rank=0, world_size=1, s3=s3, timeout=20.0,
                                       cache_dir=str(tmp_path / "cache"))
            assert sorted(got) == sorted(whole) and all(raw(got[k]) == raw(whole[k]) for k in whole)
            shards = len(list((tmp_path / "ckpt").glob("*.safetensors")))
            assert len(list((tmp_path / "cache").glob("*.json"))) == shards
