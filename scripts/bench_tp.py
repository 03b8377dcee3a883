"""Tensor-parallel loading: what a server waits for, engine against the reference.

WORLD fresh gloo processes load their shards of a LLaMA-shaped BF16 checkpoint together; a sample's
time is the slowest rank's from the common start.  Rows: ``IMPLS`` (``--impls``), alternated, the
file warm or evicted before each sample.  Per rank: CPU ms, MB asked of read calls and, cold, MB from
storage.

    python scripts/bench_tp.py --quick              # small, world 2, 3 samples (default world 4)
"""

from __future__ import annotations

import math
import os
import resource
import sys
import tempfile
import time

import harness
from benchmarks.common import checkpoint_files, compile_engine, llama_file, reference_shards, sharded_copy
from benchmarks.common import evict_cache as evict
from benchmarks.common import warm_cache as warm

IMPLS = {"engine": "engine", "engine-runs": "engine, strided=runs", "engine-1t": "engine, threads=1",
         "engine-mmap": "engine, backend=mmap", "engine-view": "engine, backend=mmap copy=False",
         "engine-slices": "engine, reference's get_slice code", "reference": "reference",
         "floor": "limit: bare preadv of the shard's size"}


#: the checkpoint's Llama config, with --quick and without
CONFIGS = {True: dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=4096),
           False: dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32000)}


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, _, v in (line.partition(":") for line in f)}


def _floor(path: str, plan, rank: int, world: int) -> dict:
    import torch

    import engine
    from engine.distributed import shard_index
    from engine.io.reader import pread_into, run_threads
    from engine.sinks import host_block

    header = engine.read_header(path)
    total = header.data_size
    want = 0
    for name in header.keys():
        info = header[name]
        item = info.nbytes // max(1, info.numel) if info.numel else 0
        for index, _ in shard_index(name, info.shape, plan.action(name), rank, world):
            want += math.prod(len(range(*s.indices(d))) for s, d in zip(index, info.shape, strict=True)) * item
    block = host_block(want)
    view = memoryview(block)
    fd = os.open(path, os.O_RDONLY)
    start, chunk = total * rank // world, 8 << 20

    def job(i):
        for lo in range(i * chunk, want, 2 * chunk):
            off = (start + lo) % (total - chunk) + header.data_start
            pread_into(fd, off, [view[lo : min(lo + chunk, want)]])

    try:
        run_threads([lambda i=i: job(i) for i in range(2)])
    finally:
        os.close(fd)
    return {"block": torch.frombuffer(block, dtype=torch.uint8)}


def worker(rank: int, world: int, port: int, path: str, cfg: dict, impl: str) -> dict:
    """One rank's load (a fresh process, all ranks started together)."""
    import safetensors  # noqa: F401  (imported before timing, as the engine is)
    import torch.distributed as dist

    import engine
    import engine.io._pages  # noqa: F401  (the native readers, loaded before timing, as a server would have them)
    import engine.io._spans  # noqa: F401
    import engine.io._split  # noqa: F401
    from engine.distributed import llama_plan, load_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    plan = llama_plan(cfg, world_size=world)
    fn = {
        "floor": lambda: _floor(path, plan, rank, world),
        "engine": lambda: load_tensor_parallel(path, plan),
        "engine-runs": lambda: load_tensor_parallel(path, plan, strided="runs"),
        "engine-1t": lambda: load_tensor_parallel(path, plan, threads=1),
        "engine-mmap": lambda: load_tensor_parallel(path, plan, backend="mmap"),
        "engine-view": lambda: load_tensor_parallel(path, plan, backend="mmap", copy=False),
        "engine-slices": lambda: reference_shards(path, plan, rank, world, opener=engine.safe_open),
        "reference": lambda: reference_shards(path, plan, rank, world),
    }[impl]
    dist.barrier()
    io0, cpu0 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    shards = fn()
    end = time.monotonic()
    io1, cpu1 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    out = dict(start=start, end=end, shard_bytes=sum(t.numel() * t.element_size() for t in shards.values()),
               cpu=(cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
               rchar=io1["rchar"] - io0["rchar"], read_bytes=io1["read_bytes"] - io0["read_bytes"])
    dist.barrier()  # nobody leaves (and frees its shards) before the slowest rank is done
    dist.destroy_process_group()
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=None, dir=tempfile.gettempdir())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int)
    ap.add_argument("--only", choices=["warm", "cold"])
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS), help="rows to run (the reference always runs)")
    ap.add_argument("--shards", type=int, default=1, help="the checkpoint as this many files and an index")
    a = ap.parse_args(argv)
    compile_engine()
    cfg = CONFIGS[a.quick]
    world = a.world or (2 if a.quick else 4)
    runs = a.runs or (3 if a.quick else 5)
    path = llama_file(cfg, base=a.dir)
    if a.shards > 1:
        path = sharded_copy(path, a.shards)
    from engine.distributed import direct_read_bytes, llama_plan

    plan = llama_plan(cfg, world_size=world)
    planned = {s: [direct_read_bytes(path, plan, rank=r, world_size=world, strided=s) for r in range(world)]
               for s in ("auto", "runs")}
    impls = [i for i in IMPLS if (a.impls is None or i in a.impls or i == "reference")
             and not (i == "floor" and a.shards > 1)]
    size = sum(os.path.getsize(f) for f in checkpoint_files(path))
    report = harness.Report()
    for state in ("warm", "cold"):
        if a.only not in (None, state):
            continue

        def sample(impl, cold=state == "cold"):
            (evict if cold else warm)(path)
            ranks = harness.ranks(worker, world, path, cfg, impl)
            return {"seconds": max(r["end"] for r in ranks) - min(r["start"] for r in ranks), "ranks": ranks}

        got = harness.rounds(impls, runs, sample)
        ref = [s["seconds"] for s in got["reference"]]
        for impl, samples in got.items():
            secs = [s["seconds"] for s in samples]

            def per_rank(key, scale, samples=samples):
                return [harness.median(s["ranks"][r][key] for s in samples) * scale for r in range(world)]

            report.add(f"{state} file -> {world} ranks' shards", IMPLS[impl], secs, size,
                       x_reference=harness.median(r / x for r, x in zip(ref, secs, strict=True)),
                       cpu_ms_per_rank=per_rank("cpu", 1e3), rchar_mb_per_rank=per_rank("rchar", 1e-6),
                       storage_mb_per_rank=per_rank("read_bytes", 1e-6) if state == "cold" else None,
                       shard_mb_per_rank=per_rank("shard_bytes", 1e-6))
    report.note(f"{len(checkpoint_files(path))} file(s), {size / 1e6:.0f} MB, world {world}; time: slowest rank, common "
                "start to last rank done; x reference: median of the per-sample ratios")
    report.note("tensor MB each engine mode reads per rank (direct_read_bytes): " + ", ".join(
        f"{s} {' '.join(f'{x / 1e6:.0f}' for x in v)}" for s, v in planned.items()))
    return report.finish(a.json, "case", "impl", "median_s", "x_reference", "cpu_ms_per_rank", "rchar_mb_per_rank",
                         "storage_mb_per_rank")


if __name__ == "__main__":
    sys.exit(main())
