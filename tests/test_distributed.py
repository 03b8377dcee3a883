"""Tensor-parallel loading: 2 and 4 gloo processes on CPU, shards exact, bytes counted."""

from __future__ import annotations

import json
import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is an optional extra")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import engine.torch  # noqa: E402
from engine.distributed import (  # noqa: E402
    Fused,
    Replicate,
    ShardingError,
    ShardingPlan,
    Split,
    direct_read_bytes,
    llama_plan,
    load_tensor_parallel,
    shard_index,
)

if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)


def llama_state_dict(cfg=CONFIG, seed=0):
    """Random weights with the names and shapes a LLaMA config implies (BF16 projections)."""
    from engine.apps.validator import expected_tensors

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16 if "proj" in name else torch.float32)
            for name, shape in expected_tensors(cfg).items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rchar() -> tuple[int, int]:
    """(bytes this process has read with read-family system calls, the kernel's count; the
    bytes this look at /proc/self/io read, which the next look counts)."""
    with open("/proc/self/io", "rb") as f:
        data = f.read()
    return next(int(line.split()[1]) for line in data.splitlines() if line.startswith(b"rchar:")), len(data)


def _counted(fn):
    """(result, bytes read by fn) net of the reads of /proc/self/io itself: its text is read
    before the count is taken, so the second look counts exactly the first one's bytes (a
    fixed probe missed the text growing by a digit here and there)."""
    before, look = _rchar()
    result = fn()
    return result, _rchar()[0] - before - look


def _worker(rank, world, port, path, modes, out_dir):
    import engine.apps.group_load  # noqa: F401  (broadcast mode's group load, and what it imports)
    import engine.checkpoints.checkpoint_info  # noqa: F401
    import engine.format.checksums  # noqa: F401
    import engine.io._pages  # noqa: F401  (the native readers, imported up front so their loading is not counted)
    import engine.io._spans  # noqa: F401
    import engine.io._split  # noqa: F401
    import engine.loading.loader  # noqa: F401  (opening a file does not import the readers: slicing does)
    import engine.sinks._host  # noqa: F401  (nor the owned-block code: the first owned load does)
    import engine.sinks.torch  # noqa: F401
    from engine.io.reader import default_threads

    default_threads()  # reads /sys once (cached): not a tensor byte, keep it out of the count
    # bytes are counted as the kernel counts reads (rchar): copies out of a mapping are not
    os.environ["ENGINE_COPY_SOURCE"] = "pread"

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        plan = llama_plan(CONFIG, world_size=world)
        for mode in modes:
            dist.barrier()
            kind, _, strided = mode.partition("-")  # "direct-runs": direct mode, strided="runs"
            shards, nbytes = _counted(lambda k=kind, s=strided: load_tensor_parallel(path, plan, mode=k, strided=s or "auto"))
            report = {"bytes_read": nbytes, "exact": [], "gathered": []}
            full = engine.torch.load_file(path)
            for name, t in full.items():
                action = plan.action(name)
                mine = shards[name]
                if isinstance(action, Replicate):
                    report["exact"].append([name, bool(torch.equal(mine.float(), t.float()))])
                    continue
                dim = action.dim
                part = t.shape[dim] // world
                expect = t.narrow(dim, rank * part, part)
                report["exact"].append([name, bool(torch.equal(mine.float(), expect.float()))])
                # all_gather rebuilds the full tensor exactly (gloo has no bf16: gather float32, exact for bf16)
                values = mine.float().contiguous()
                gathered = [torch.empty_like(values) for _ in range(world)]
                dist.all_gather(gathered, values)
                report["gathered"].append([name, bool(torch.equal(torch.cat(gathered, dim=dim), t.float()))])
            with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    sd = llama_state_dict()
    path = tmp_path_factory.mktemp("tp") / "model.safetensors"
    engine.torch.save_file(sd, path)
    return str(path), sd


def _header_bytes(path) -> int:
    return 8 + engine.read_header(path).header_size


def _expected_bytes(sd, world, plan):
    split = replicated = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if isinstance(plan.action(name), Replicate):
            replicated += nbytes
        else:
            split += nbytes
    return split, replicated


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_shard_and_broadcast_reads_once(llama_file, tmp_path, world):
    path, sd = llama_file
    modes = ["direct-runs", "direct-spans", "direct", "broadcast"] if world == 4 else ["direct-runs", "direct", "broadcast"]
    mp.spawn(_worker, args=(world, _free_port(), path, modes, str(tmp_path)), nprocs=world, join=True)
    split, replicated = _expected_bytes(sd, world, llama_plan(CONFIG, world_size=world))
    total = split + replicated
    for mode in modes:
        reads = []
        for rank in range(world):
            report = json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text())
            assert all(ok for _, ok in report["exact"]), (mode, report["exact"])
            assert all(ok for _, ok in report["gathered"]), (mode, report["gathered"])
            reads.append(report["bytes_read"])
        header = _header_bytes(path)
        if mode == "direct-runs":
            # exactly 1/world of the split tensors plus the replicated ones (plus the header)
            assert reads == [split // world + replicated + header] * world
        elif mode.startswith("direct"):
            # column blocks read as dense spans: the header's count, more than the shard
            strided = mode.partition("-")[2] or "auto"
            plan = llama_plan(CONFIG, world_size=world)
            expect = [direct_read_bytes(path, plan, rank=r, world_size=world, strided=strided) + header
                      for r in range(world)]
            assert reads == expect
            assert all(n > split // world + replicated + header for n in reads)
        else:
            # the node's ranks read each byte once between them, an equal share each (and the header,
            # and the spans every rank samples to tell its copy from another revision's)
            from engine.apps.group_load import SAMPLE_BYTES, SAMPLES

            sampled = sum(min(SAMPLE_BYTES, total - total * k // SAMPLES) for k in range(SAMPLES))
            assert sum(reads) == total + (header + sampled) * world, reads
            assert max(reads) <= total // world + header + sampled + 64, reads


def _broadcast_url_worker(rank, world, port, url, path, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        plan = llama_plan(CONFIG, world_size=world)
        got = load_tensor_parallel(url, plan, mode="broadcast", timeout=10.0)
        want = load_tensor_parallel(path, plan, rank=rank, world_size=world)
        same = sorted(got) == sorted(want) and all(
            got[k].shape == want[k].shape and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
            for k in want)
        with open(os.path.join(out_dir, f"url-rank{rank}.json"), "w") as f:
            json.dump({"same": same, "names": len(got)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _subgroup_worker(rank, world, port, path, out_dir):
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # a launcher's word that says nothing of this group's nodes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group([2, 3])  # every rank makes it; only 2 and 3 load
        if rank in (2, 3):
            plan = llama_plan(CONFIG, world_size=2)
            got = load_tensor_parallel(path, plan, mode="broadcast", process_group=group)
            want = load_tensor_parallel(path, plan, rank=rank - 2, world_size=2)
            same = sorted(got) == sorted(want) and all(
                torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
            with open(os.path.join(out_dir, f"sub-rank{rank}.json"), "w") as f:
                json.dump({"same": same}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_broadcast_mode_in_a_tensor_parallel_group_of_ranks_2_and_3(llama_file, tmp_path):
    """A TP group {2, 3} in a world of 4 (one host, LOCAL_WORLD_SIZE=1): the node is found by host
    name, no group is made that ranks 0 and 1 would have to enter, and both ranks get the shards
    of the direct load."""
    path, sd = llama_file
    mp.spawn(_subgroup_worker, args=(4, _free_port(), path, str(tmp_path)), nprocs=4, join=True, start_method="spawn")
    for rank in (2, 3):
        assert json.loads((tmp_path / f"sub-rank{rank}.json").read_text()) == {"same": True}


def _device_path_worker(rank, world, port, path, out_dir, fail):
    import engine.apps.group_load as gl
    from engine.errors import DistributedLoadError

    # the stand-in for an NCCL group and CUDA tensors: gloo plays the backend that moves device
    # memory, the CPU the device, so broadcast mode takes the device path (rounds in device blocks)
    gl.DEVICE_PAYLOADS, gl.PAYLOAD_DEVICES = frozenset({"gloo"}), frozenset({"cpu"})
    if fail == "host":  # the backend moves device memory only, and the tensors go to the CPU
        gl.PAYLOAD_DEVICES = frozenset({"cuda"})
    blocks, made = [], gl._device_block
    gl._device_block = lambda n, d: (blocks.append(n), made(n, d))[1]
    if fail == "read" and rank == 0:  # rank 0's reads fail on its third call
        import engine.io.reader

        real, calls = engine.io.reader.pread_into, []

        def failing(*a, **k):
            import threading

            if threading.current_thread().name.startswith("engine-group"):
                calls.append(1)
                if len(calls) == 3:
                    raise OSError("the reader's disk went away")
            return real(*a, **k)

        engine.io.reader.pread_into = failing
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        plan = llama_plan(CONFIG, world_size=world)
        try:
            got = load_tensor_parallel(path, plan, mode="broadcast")
            want = load_tensor_parallel(path, plan, rank=rank, world_size=world)
            result = {"same": sorted(got) == sorted(want) and all(
                torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want),
                "device": bool(blocks)}
        except DistributedLoadError as exc:
            result = {"error": exc.reason, "rank": exc.rank, "cause": exc.cause}
        with open(os.path.join(out_dir, f"pt-rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fail", ["", "read", "host"])
def test_broadcast_mode_on_a_device_backend_sends_the_rounds_through_device_blocks(llama_file, tmp_path, fail):
    """Broadcast mode on a group whose backend moves device memory (NCCL's path, played here by
    gloo and the CPU): the ranks read shares of the rounds and exchange them between device
    blocks; both get the direct load's shards.  A read that fails on rank 0 fails both ranks,
    naming it, instead of leaving rank 1 in a collective that never comes; tensors for a device
    the backend cannot move (an NCCL group and the CPU) are an OptionError on every rank."""
    path, sd = llama_file
    mp.spawn(_device_path_worker, args=(2, _free_port(), path, str(tmp_path), fail), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"pt-rank{r}.json").read_text()) for r in range(2)]
    if not fail:
        assert got == [{"same": True, "device": True}] * 2, got
    elif fail == "read":
        for g in got:
            assert g["error"] == "GroupReadFailed" and g["rank"] == 0 and "disk went away" in g["cause"], g
    else:
        for g in got:
            assert g["error"] == "GroupReadFailed" and g["cause"].startswith("OptionError") and "'cpu'" in g["cause"], g


def test_broadcast_mode_reads_a_urls_bytes_once_per_node(llama_file, tmp_path):
    """Two ranks in broadcast mode over HTTP: each ends with the shards of the direct load, and
    the server is asked for every tensor byte once in all."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from rangeserver import serving

    path, sd = llama_file
    with serving(os.path.dirname(path)) as server:
        server.bulk()
        mp.spawn(_broadcast_url_worker, args=(2, _free_port(), server.url(os.path.basename(path)), path, str(tmp_path)),
                 nprocs=2, join=True)
        asked = server.tensor_bytes_asked()
    for rank in range(2):
        report = json.loads((tmp_path / f"url-rank{rank}.json").read_text())
        assert report == {"same": True, "names": len(sd)}, report
    total = sum(t.numel() * t.element_size() for t in sd.values())
    assert total <= asked <= 1.02 * total, (asked, total)


def test_gqa_kv_replicated_when_fewer_heads_than_ranks():
    plan4 = llama_plan(CONFIG, world_size=4)
    plan2 = llama_plan(CONFIG, world_size=2)
    assert isinstance(plan4.action("model.layers.0.self_attn.k_proj.weight"), Replicate)
    assert plan2.action("model.layers.0.self_attn.k_proj.weight") == Split(0)
    assert plan2.action("model.layers.0.self_attn.o_proj.weight") == Split(1)
    assert plan2.action("model.embed_tokens.weight") == Split(0)
    assert isinstance(plan2.action("model.norm.weight"), Replicate)


def test_uneven_split_is_an_error_unless_padding():
    with pytest.raises(ShardingError, match="evenly") as info:
        shard_index("w", (10, 4), Split(0), 0, 3)
    assert info.value.reason == "UnevenSplit"
    pieces = [shard_index("w", (10, 4), Split(0, pad=True), r, 3) for r in range(3)]
    assert [p[0][0][0] for p in pieces] == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert all(p[0][1] == 4 for p in pieces)


def test_padding_pads_with_zeros(tmp_path):
    path = tmp_path / "p.safetensors"
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    engine.torch.save_file({"w": w}, path)
    plan = ShardingPlan([("w", Split(0, pad=True))])
    last = load_tensor_parallel(path, plan, rank=2, world_size=3)["w"]
    assert last.shape == (4, 4)
    assert torch.equal(last[:2], w[8:]) and torch.equal(last[2:], torch.zeros(2, 4))


def test_fused_qkv_splits_each_part(tmp_path):
    hd, heads, kv_heads = 4, 4, 2
    qkv = torch.arange((heads + 2 * kv_heads) * hd * 3, dtype=torch.float32).reshape(-1, 3)
    path = tmp_path / "f.safetensors"
    engine.torch.save_file({"model.layers.0.self_attn.qkv_proj.weight": qkv}, path)
    cfg = dict(CONFIG, hidden_size=heads * hd, num_attention_heads=heads, num_key_value_heads=kv_heads)
    q, k, v = qkv[:16], qkv[16:24], qkv[24:32]
    for rank in range(2):
        got = load_tensor_parallel(path, llama_plan(cfg, world_size=2), rank=rank, world_size=2)
        t = got["model.layers.0.self_attn.qkv_proj.weight"]
        expect = torch.cat([q[rank * 8:(rank + 1) * 8], k[rank * 4:(rank + 1) * 4], v[rank * 4:(rank + 1) * 4]])
        assert torch.equal(t, expect)
    with pytest.raises(ShardingError, match="add up"):
        shard_index("x", (10, 3), Fused(0, (4, 4)), 0, 2)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io to count reads")
def test_column_split_reads_strided_ranges(tmp_path):
    import engine.io._pages  # noqa: F401  (the native readers, loaded before counting)
    import engine.io._spans  # noqa: F401
    import engine.io._split  # noqa: F401

    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    path = tmp_path / "c.safetensors"
    engine.torch.save_file({"w": w}, path)
    plan = ShardingPlan([("w", Split(1))])
    got, nbytes = _counted(lambda: load_tensor_parallel(path, plan, rank=1, world_size=4, strided="runs"))
    assert torch.equal(got["w"], w[:, 8:16])
    assert nbytes == 64 * 8 * 4 + _header_bytes(path)  # 64 strided runs, nothing between them
    # as one dense span: from row 0's run to row 63's run, 63 rows of 128 bytes and one run
    for strided in ("spans", "auto"):
        got, nbytes = _counted(lambda s=strided: load_tensor_parallel(path, plan, rank=1, world_size=4, strided=s))
        assert torch.equal(got["w"], w[:, 8:16])
        assert nbytes == 63 * 32 * 4 + 8 * 4 + _header_bytes(path)
        assert direct_read_bytes(path, plan, rank=1, world_size=4, strided=strided) == 63 * 32 * 4 + 8 * 4
    assert direct_read_bytes(path, plan, rank=1, world_size=4, strided="runs") == 64 * 8 * 4


def test_spans_through_a_small_bounce_on_several_threads(tmp_path, monkeypatch):
    import engine.parallel.tp_direct as ed

    monkeypatch.setattr(ed, "SPAN_BOUNCE_BYTES", 1000)  # several spans per tensor, several jobs
    w = torch.arange(300 * 48, dtype=torch.float32).reshape(300, 48)
    b = torch.arange(300 * 50, dtype=torch.bfloat16).reshape(300, 50)
    path = tmp_path / "s.safetensors"
    engine.torch.save_file({"w": w, "b": b}, path)
    plan = ShardingPlan([("w", Split(1)), ("b", Split(-1, pad=True))])
    for rank in range(3):
        got = load_tensor_parallel(path, plan, rank=rank, world_size=3, strided="spans", threads=3)
        assert torch.equal(got["w"], w[:, rank * 16 : (rank + 1) * 16])
        expect = torch.zeros(300, 17, dtype=torch.bfloat16)
        part = b[:, rank * 17 : (rank + 1) * 17]
        expect[:, : part.shape[1]] = part
        assert torch.equal(got["b"], expect)
        assert list(got) == engine.read_header(path).offset_keys()
    with pytest.raises(ShardingError, match="strided"):
        load_tensor_parallel(path, plan, rank=0, world_size=3, strided="bounce")


def test_mapped_backend_gives_the_pread_shards(tmp_path, monkeypatch):
    # every kind of job: chunked contiguous reads, long-run column blocks, short strided runs
    # (one strided copy), uneven runs (padding) and replicated tensors, on several threads
    import engine.parallel.tp_direct as ed

    monkeypatch.setattr(ed, "_CHUNK_BYTES", 4096)  # several jobs per tensor
    g = torch.Generator().manual_seed(0)
    sd = {
        "embed": torch.randn(96, 40, generator=g),
        "w": torch.randn(300, 48, generator=g).to(torch.bfloat16),
        "long": torch.randn(8, 1536, generator=g),
        "b": torch.arange(300 * 50, dtype=torch.int32).reshape(300, 50),
        "norm": torch.randn(40, generator=g),
    }
    path = tmp_path / "m.safetensors"
    engine.torch.save_file(sd, path)
    plan = ShardingPlan([("embed", Split(0)), ("w", Split(1)), ("long", Split(1)), ("b", Split(-1, pad=True)),
                         ("norm", Replicate())])
    for rank in range(3):
        ref = load_tensor_parallel(path, plan, rank=rank, world_size=3, strided="runs")
        got = load_tensor_parallel(path, plan, rank=rank, world_size=3, backend="mmap", threads=3)
        assert list(got) == list(ref)
        for name in ref:
            assert got[name].dtype == ref[name].dtype and torch.equal(got[name], ref[name]), (rank, name)
        assert torch.equal(got["w"], sd["w"][:, rank * 16 : (rank + 1) * 16])
    with pytest.raises(ShardingError, match="backend"):
        load_tensor_parallel(path, plan, rank=0, world_size=3, backend="cuda")


def test_mapped_views_alias_the_file_only_where_the_shard_is_one_range(tmp_path):
    """copy=False: replicated tensors and row blocks are views of a private mapping (each
    with a storage of exactly its bytes, writable, writes never reaching the file); column
    blocks, padded and empty shards are owned copies; every shard equals the pread one."""
    g = torch.Generator().manual_seed(1)
    sd = {
        "embed": torch.randn(96, 40, generator=g),
        "w": torch.randn(300, 48, generator=g).to(torch.bfloat16),
        "b": torch.arange(300 * 50, dtype=torch.int32).reshape(300, 50),
        "rows": torch.arange(10 * 4, dtype=torch.int64).reshape(10, 4),
        "norm": torch.randn(40, generator=g),
        "none": torch.zeros(0, 4),
    }
    path = tmp_path / "v.safetensors"
    engine.torch.save_file(sd, path)
    before = path.read_bytes()
    plan = ShardingPlan([("embed", Split(0)), ("w", Split(1)), ("b", Split(-1, pad=True)),
                         ("rows", Split(0, pad=True)), ("norm", Replicate()), ("none", Split(0))])
    for rank in range(3):
        ref = load_tensor_parallel(path, plan, rank=rank, world_size=3)
        got = load_tensor_parallel(path, plan, rank=rank, world_size=3, backend="mmap", copy=False)
        assert list(got) == list(ref)
        for name, t in got.items():
            assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), (rank, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
        with pytest.raises(ShardingError, match="copy=False"):
            load_tensor_parallel(path, plan, rank=rank, world_size=3, copy=False)
        got["embed"].fill_(7)  # copy-on-write: the file keeps its bytes
        got["norm"].zero_()
    assert path.read_bytes() == before
    # the views really are the mapping's pages: from one rank, consecutive row blocks of
    # "embed" and "norm" lie at their file distance from each other
    got = load_tensor_parallel(path, plan, rank=0, world_size=3, backend="mmap", copy=False)
    h = engine.read_header(path)
    gap = h["norm"].data_offsets[0] - h["embed"].data_offsets[0]
    assert got["norm"].data_ptr() - got["embed"].data_ptr() == gap
    owned = load_tensor_parallel(path, plan, rank=0, world_size=3, backend="mmap")
    assert owned["norm"].data_ptr() - owned["embed"].data_ptr() != gap


@pytest.mark.parametrize("backend, copy", [("pread", True), ("mmap", True), ("mmap", False)])
def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, backend, copy):
    """Every shard file of an index goes the single file's way (planned reads, mapped copies,
    views with copy=False): the same shards, in the index's shard order, each file's
    tensors only once; ``names`` still filters; a shard missing from disk is named."""
    from engine.checkpoints.checkpoint import read_checkpoint_info
    from engine.checkpoints.shards import save_sharded

    sd = llama_state_dict()
    single = tmp_path / "model.safetensors"
    engine.torch.save_file(sd, single)
    sharded = tmp_path / "sharded"
    save_sharded(sd, sharded, max_shard_size=40_000, fsync=False)
    info = read_checkpoint_info(sharded)
    assert len(info.shards) >= 3  # the test needs tensors in several files
    plan = llama_plan(CONFIG, world_size=2)
    for rank in range(2):
        ref = load_tensor_parallel(single, plan, rank=rank, world_size=2)
        got = load_tensor_parallel(sharded, plan, rank=rank, world_size=2, backend=backend, copy=copy)
        assert sorted(got) == sorted(ref)
        assert list(got) == [name for shard in info.shards for name in info.headers[shard].offset_keys()]
        for name, t in got.items():
            assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), (rank, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
    # views where the shard is one range of its file, as for a single file
    got = load_tensor_parallel(sharded, plan, rank=0, world_size=2, backend=backend, copy=copy)
    norm = "model.norm.weight"
    path = info.shard_path(info.weight_map[norm])
    mapped = any(path in line and "rw-p" in line.split()[1] for line in _maps_of(got[norm].data_ptr()))
    assert mapped == (not copy)
    for strided in ("auto", "runs", "spans"):  # the byte count adds up over the files
        assert direct_read_bytes(sharded, plan, rank=1, world_size=2, strided=strided) == direct_read_bytes(
            single, plan, rank=1, world_size=2, strided=strided)
    some = load_tensor_parallel(sharded / "model.safetensors.index.json", plan, rank=1, world_size=2,
                                backend=backend, copy=copy, names=lambda n: n.endswith("norm.weight"))
    assert sorted(some) == sorted(n for n in sd if n.endswith("norm.weight"))
    os.unlink(info.shard_path(info.shards[-1]))
    with pytest.raises(engine.errors.MissingShardError, match=info.shards[-1]):
        load_tensor_parallel(sharded, plan, rank=0, world_size=2, backend=backend, copy=copy)


def test_shard_headers_are_parsed_once_unless_the_file_changed(tmp_path, monkeypatch):
    """A sharded load reuses the headers the index check read; a shard file whose size no
    longer matches its header (rewritten in between) has its header read again from the
    descriptor the load opened, so the offsets are the new file's."""
    import engine.format.header
    import engine.parallel.tp_direct as ed
    from engine.checkpoints.shards import save_sharded

    sd = llama_state_dict()
    single = tmp_path / "model.safetensors"
    engine.torch.save_file(sd, single)
    d = tmp_path / "ck"
    save_sharded(sd, d, max_shard_size=40_000, fsync=False)
    plan = llama_plan(CONFIG, world_size=2)
    ref = load_tensor_parallel(single, plan, rank=0, world_size=2)
    files = ed.direct_files(d, None)
    parsed = []
    real = engine.format.header.read_header_fd
    monkeypatch.setattr(engine.format.header, "read_header_fd", lambda fd, **kw: (parsed.append(kw["path"]), real(fd, **kw))[1])
    got = ed.load_files_direct(files, plan, 0, 2, "auto", None)
    assert parsed == [] and all(torch.equal(got[n], ref[n]) for n in ref)
    # rewrite one shard with more metadata: same tensors, every offset moved
    victim = files[0].path
    mine = engine.torch.load_file(victim)
    engine.torch.save_file(mine, victim, metadata={"pad": "x" * 1000})
    got = ed.load_files_direct(files, plan, 0, 2, "auto", None)
    assert parsed == [victim] and all(torch.equal(got[n], ref[n]) for n in ref)


def test_many_shard_files_are_opened_a_batch_at_a_time(tmp_path, monkeypatch):
    """A checkpoint of many small shard files is planned and read in batches, so a load of
    owned shards never holds more than _FILES_AT_ONCE of them open; the shards are the
    single file's.  (copy=False views keep their file's mapping, and CPython's mmap keeps a
    descriptor per mapping while it lives.)"""
    import engine.distributed as ed
    import engine.parallel.tp_direct as td
    from engine.checkpoints.shards import save_sharded

    sd = llama_state_dict()
    single = tmp_path / "model.safetensors"
    engine.torch.save_file(sd, single)
    save_sharded(sd, tmp_path / "ck", max_shard_size=10_000, fsync=False)
    shards = len(list((tmp_path / "ck").glob("*.safetensors")))
    assert shards >= 8
    monkeypatch.setattr(ed, "_FILES_AT_ONCE", 3)
    most = [0]
    real = td._FileLoad.__init__

    def counting(self, *args, **kwargs):
        real(self, *args, **kwargs)
        most[0] = max(most[0], len(os.listdir("/proc/self/fd")))

    monkeypatch.setattr(td._FileLoad, "__init__", counting)
    plan = llama_plan(CONFIG, world_size=2)
    ref = load_tensor_parallel(single, plan, rank=1, world_size=2)
    # owned shards: a batch's descriptors (and, mapped, the mappings' own) go when it ends
    for backend, per_file in (("pread", 1), ("mmap", 2)):
        most[0] = 0
        base = len(os.listdir("/proc/self/fd"))
        got = load_tensor_parallel(tmp_path / "ck", plan, rank=1, world_size=2, backend=backend)
        assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
        assert most[0] - base <= 3 * per_file < shards, backend
        assert len(os.listdir("/proc/self/fd")) == base


def test_sharded_checkpoint_that_disagrees_with_its_index_is_refused(tmp_path):
    """The TP loader checks the index against the shards' headers before reading a byte: a
    tensor the index puts in the wrong shard, or a shard that is a FIFO, is a clear error
    naming it, never a hang or a silently missing tensor."""
    from engine.checkpoints.shards import save_sharded
    from engine.errors import CheckpointIndexError, ReadError

    sd = llama_state_dict()
    d = tmp_path / "ck"
    save_sharded(sd, d, max_shard_size=40_000, fsync=False)
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    plan = llama_plan(CONFIG, world_size=2)
    moved = "model.norm.weight"
    wrong = next(s for s in sorted(set(doc["weight_map"].values())) if s != doc["weight_map"][moved])
    index.write_text(json.dumps({**doc, "weight_map": {**doc["weight_map"], moved: wrong}}))
    for backend, copy in (("pread", True), ("mmap", False)):
        with pytest.raises(CheckpointIndexError, match=moved) as info:
            load_tensor_parallel(d, plan, rank=0, world_size=2, backend=backend, copy=copy)
        assert info.value.reason == "TensorNotInShard"
    index.write_text(json.dumps(doc))
    victim = d / doc["weight_map"][moved]
    victim.unlink()
    os.mkfifo(victim)
    with pytest.raises(ReadError) as info:
        load_tensor_parallel(d, plan, rank=0, world_size=2)
    assert info.value.reason == "NotRegularFile" and victim.name in str(info.value)


def _maps_of(address: int) -> list[str]:
    """The lines of /proc/self/maps whose range holds ``address``."""
    with open("/proc/self/maps") as f:
        return [line for line in f
                if int(line.split()[0].split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)]


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_sub_byte_tensors_take_the_slice_path_replicated_or_split(tmp_path, backend):
    # packed F4 bytes cannot be planned as byte runs: they are read through get_slice, both
    # when a rank gets all of them and when it gets a row block
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch build has no float4_e2m1fn_x2")
    f4 = torch.arange(64, dtype=torch.uint8).reshape(8, 8).view(torch.float4_e2m1fn_x2)
    w = torch.randn(8, 4)
    path = tmp_path / "f4.safetensors"
    engine.torch.save_file({"packed": f4, "w": w}, path)
    for plan, expect in ((ShardingPlan(), f4), (ShardingPlan([("packed", Split(0))]), f4[4:])):
        got = load_tensor_parallel(path, plan, rank=1, world_size=2, backend=backend)
        assert got["packed"].dtype == f4.dtype
        assert torch.equal(got["packed"].view(torch.uint8), expect.view(torch.uint8))
        assert torch.equal(got["w"], w)
    with pytest.raises(ShardingError, match="packed"):
        load_tensor_parallel(path, ShardingPlan([("packed", Split(1))]), rank=0, world_size=2, backend=backend)


def test_mapped_copy_maps_dense_spans_in_one_call(monkeypatch):
    """A job whose runs lie close together has its whole span mapped in one call before
    the copy; runs far apart fault in only their own pages."""
    import numpy as np

    import engine.io.reader
    from engine.parallel.tp_direct import POPULATE_MAX_GAP, Job, copy_mapped

    calls = []
    monkeypatch.setattr(engine.io.reader, "populate_mapping", lambda buf, lo, hi: calls.append((lo, hi)) or 0)
    gap = POPULATE_MAX_GAP
    source = np.arange(4 * gap + 64, dtype=np.int64).view(np.uint8)
    for src, spans in (([0], [(5, 13)]), ([0, 100, 200], [(5, 213)]), ([0, gap + 8, 2 * gap + 16], [(5, 2 * gap + 29)]),
                       ([0, 3 * gap], [])):
        calls.clear()
        dst = bytearray(8 * len(src))
        copy_mapped(source, Job(memoryview(dst), np.array(src, np.int64), 8, 5, False))
        assert bytes(dst) == b"".join(source[5 + o : 13 + o].tobytes() for o in src), src
        assert calls == spans, src


def test_mapped_copy_of_uneven_runs():
    import numpy as np

    from engine.parallel.tp_direct import Job, copy_mapped

    source = np.arange(256, dtype=np.uint8)
    for src in ([3, 10, 40, 41 + 4], [0, 16, 32], [100]):
        dst = bytearray(4 * len(src))
        copy_mapped(source, Job(memoryview(dst), np.array(src, np.int64), 4, 7, False))
        assert bytes(dst) == b"".join(bytes(source[7 + o : 7 + o + 4]) for o in src), src


def test_rank_and_world_are_checked(tmp_path):
    with pytest.raises(ShardingError, match="initialise"):
        load_tensor_parallel(tmp_path / "x", ShardingPlan())
    with pytest.raises(ShardingError, match="outside"):
        load_tensor_parallel(tmp_path / "x", ShardingPlan(), rank=4, world_size=4)
    with pytest.raises(ShardingError, match="mode"):
        load_tensor_parallel(tmp_path / "x", ShardingPlan(), rank=0, world_size=1, mode="x")
