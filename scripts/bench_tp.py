"""Tensor-parallel loading: what a server waits for, engine against the reference.

Every sample starts WORLD fresh gloo processes on this machine that load their shards of a
generated LLaMA-shaped BF16 checkpoint at the same moment (after a barrier); the sample's
time is the slowest rank's: from the common start to the last rank done (ranks stamp the
system-wide monotonic clock).  Implementations, alternated sample by sample:

* engine: ``load_tensor_parallel(path, llama_plan(config, world_size))`` (direct mode,
  ``strided="auto"``: column blocks with short rows read as dense spans);
* engine-runs: the same with ``strided="runs"`` (one read per row of a column block, exactly
  the shard's bytes);
* engine-1t: the engine row with one reader thread per rank (``threads=1``), as the
  reference has: what oversubscribing the cores costs when ranks share them;
* engine-mmap: ``backend="mmap"``: the shard copied out of a read-only mapping (column
  blocks in one strided copy each), as the reference reads;
* engine-view: ``backend="mmap", copy=False``: shards that are one range of the file
  (replicated tensors, row blocks) are views of a private mapping, column blocks copied,
  which is what the reference hands out;
* engine-slices: the reference row's code with ``engine.safe_open`` in place of the
  reference's (the drop-in, one ``get_slice`` per piece);
* reference: ``safetensors.safe_open(framework="pt")`` + ``get_slice(name)[index]`` with the
  same index for every tensor, concatenated for fused tensors and made contiguous.  Its
  contiguous slices are views of its mapping of the file (``.contiguous()`` keeps them
  so): for a replicated tensor or a row block no byte is copied, and its pages are read
  only when touched.  Only column blocks are copied.  Compare it with engine-view; the
  other engine rows own every byte when they return;
* floor: no engine and no tensors: each rank reads as many bytes as its shard holds, from
  its own contiguous quarter of the file (wrapping around), into one fresh anonymous block
  with two threads of 8 MiB ``preadv``.  The least a rank can do to end up with its bytes
  in fresh memory of its own: a lower bound for both sides, not a competitor.

"warm": the file is read into the page cache before each sample.  "cold": it is evicted
with POSIX_FADV_DONTNEED before each sample.  Bytes per rank: ``rchar`` of /proc/self/io
(what the rank asked of read system calls; a mapping reads without them, so the reference
shows its header only) and, cold, ``read_bytes`` (what the rank pulled from storage; ranks
share one page cache, so a page one rank brought in is not charged to another).

    python scripts/bench_tp.py                      # ~1 GB checkpoint, world 4, 5 samples each
    python scripts/bench_tp.py --quick              # small, world 2, 3 samples (smoke)
    python scripts/bench_tp.py --only cold --runs 7
    python scripts/bench_tp.py --impls engine engine-view floor   # these rows and the reference
    python scripts/bench_tp.py --shards 4 --impls engine engine-view engine-slices

``--shards N`` writes the checkpoint as N shard files and an index (``save_sharded``) and
loads the directory: the engine rows load it file by file, the reference row opens each
shard file in turn (the floor row is for a single file only).

"CPU ms per rank": user + system time of the rank's process during its load (every thread,
``getrusage``), median over the samples.  With more ranks than cores the ranks take turns,
so the slowest rank's time is about the ranks' CPU added up over the cores: where the wall
clock says who is faster, this column says by how much work.

Earlier versions of this script timed each rank on its own from its own start and reported
per-rank medians; a server waits for the slowest rank of a load that all ranks start
together, which is what is timed now.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
# the asv suites' shared helpers (page-cache eviction and warming)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "asv_benchmarks"))
from benchmarks.common import checkpoint_files, compile_engine, reference_shards, sharded_copy  # noqa: E402
from benchmarks.common import evict_cache as evict  # noqa: E402
from benchmarks.common import warm_cache as warm  # noqa: E402

IMPLS = ("engine", "engine-runs", "engine-1t", "engine-mmap", "engine-view", "engine-slices", "reference", "floor")


def config_for(quick: bool) -> dict:
    if quick:
        return dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=4096)
    return dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000)


def make(path: str, cfg: dict) -> None:
    import engine.torch

    if os.path.exists(path):
        return
    from engine.apps.validator import expected_tensors

    sd = {name: torch.randn(shape).bfloat16() for name, shape in expected_tensors(cfg).items()}
    engine.torch.save_file(sd, path)


def io_counts() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value)
    return out


def worker(rank, world, port, path, cfg, impl, out):
    import safetensors  # noqa: F401  (imported before timing, as the engine is)

    import engine
    import engine.io._pages  # noqa: F401  (the native readers, loaded before timing, as a server would have them)
    import engine.io._spans  # noqa: F401
    import engine.io._split  # noqa: F401
    from engine.distributed import llama_plan, load_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    plan = llama_plan(cfg, world_size=world)

    def floor():
        from engine.io.reader import pread_into, run_threads
        from engine.sinks import host_block

        header = engine.read_header(path)
        total = sum(header[n].nbytes for n in header.keys())
        want = sum(_shard_bytes(header, plan, n, rank, world) for n in header.keys())
        block = host_block(want)
        view = memoryview(block)
        fd = os.open(path, os.O_RDONLY)
        start = header.data_start + (total * rank // world)
        chunk = 8 << 20

        def job(i):
            for lo in range(i * chunk, want, 2 * chunk):
                hi = min(lo + chunk, want)
                off = (start - header.data_start + lo) % (total - chunk) + header.data_start
                pread_into(fd, off, [view[lo:hi]])

        try:
            run_threads([lambda i=i: job(i) for i in range(2)])
        finally:
            os.close(fd)
        return {"block": torch.frombuffer(block, dtype=torch.uint8)}

    fn = {
        "floor": floor,
        "engine": lambda: load_tensor_parallel(path, plan),
        "engine-runs": lambda: load_tensor_parallel(path, plan, strided="runs"),
        "engine-1t": lambda: load_tensor_parallel(path, plan, threads=1),
        "engine-mmap": lambda: load_tensor_parallel(path, plan, backend="mmap"),
        "engine-view": lambda: load_tensor_parallel(path, plan, backend="mmap", copy=False),
        "engine-slices": lambda: reference_shards(path, plan, rank, world, opener=engine.safe_open),
        "reference": lambda: reference_shards(path, plan, rank, world),
    }[impl]
    dist.barrier()
    before = io_counts()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.monotonic()
    shards = fn()
    end = time.monotonic()
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    after = io_counts()
    nbytes = sum(t.numel() * t.element_size() for t in shards.values())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dict(start=start, end=end, shard_bytes=nbytes,
                       cpu=(cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime),
                       rchar=after["rchar"] - before["rchar"],
                       read_bytes=after["read_bytes"] - before["read_bytes"]), f)
    dist.barrier()  # nobody leaves (and frees its shards) before the slowest rank is done
    dist.destroy_process_group()


def _shard_bytes(header, plan, name, rank, world) -> int:
    from engine.distributed import shard_index

    info = header[name]
    item = info.nbytes // max(1, info.numel) if info.numel else 0
    total = 0
    for index, _ in shard_index(name, info.shape, plan.action(name), rank, world):
        n = 1
        for s, d in zip(index, info.shape, strict=True):
            n *= len(range(*s.indices(d)))
        total += n * item
    return total


def sample(path: str, cfg: dict, world: int, impl: str, cold: bool) -> dict:
    """One load by ``world`` fresh processes; the slowest rank's time and each rank's bytes."""
    if cold:
        evict(path)
    else:
        warm(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(world, port, path, cfg, impl, out), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    return dict(seconds=max(r["end"] for r in ranks) - min(r["start"] for r in ranks), ranks=ranks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int)
    ap.add_argument("--runs", type=int, help="samples per implementation and state (default 5, quick 3)")
    ap.add_argument("--only", choices=["warm", "cold"])
    ap.add_argument("--impls", nargs="+", choices=IMPLS, help="rows to run (the reference always runs)")
    ap.add_argument("--shards", type=int, default=1, help="write the checkpoint as this many files and an index")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json")
    args = ap.parse_args()
    compile_engine()  # no sample compiles the engine's modules (see compile_engine)
    cfg = config_for(args.quick)
    world = args.world or (2 if args.quick else 4)
    runs = args.runs or (3 if args.quick else 5)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"bench-tp-{'quick' if args.quick else 'full'}.safetensors")
    make(path, cfg)
    if args.shards > 1:
        path = sharded_copy(path, args.shards)

    from engine.distributed import direct_read_bytes, llama_plan

    plan = llama_plan(cfg, world_size=world)
    planned = {impl: [direct_read_bytes(path, plan, rank=r, world_size=world, strided=strided)
                      for r in range(world)]
               for impl, strided in (("engine", "auto"), ("engine-runs", "runs"))}
    impls = [i for i in IMPLS if (args.impls is None or i in args.impls or i == "reference")
             and not (i == "floor" and args.shards > 1)]
    load_start = os.getloadavg()
    results: dict = {}
    for state in ("warm", "cold"):
        if args.only not in (None, state):
            continue
        got = {impl: [] for impl in impls}
        for _ in range(runs):
            for impl in impls:  # alternated: drift on a shared machine hits every side alike
                got[impl].append(sample(path, cfg, world, impl, state == "cold"))
        results[state] = got
    size = sum(os.path.getsize(f) for f in checkpoint_files(path))
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {len(checkpoint_files(path))} file(s), {size / 1e6:.0f} MB, world {world} "
          f"(all ranks at once), "
          f"{runs} fresh-process samples per row, {os.cpu_count()} cores, "
          f"load average {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print("# time: slowest rank, common start to last rank done; ref/x: median of the per-sample ratios "
          "(samples alternate implementations)")
    print(f"{'state':<5} {'impl':<13} {'median s':>9} {'min s':>7} {'max s':>7} {'ref/x':>7}  "
          f"{'CPU ms per rank':<20} {'MB asked per rank (rchar)':<30} {'MB from storage per rank':<26}")
    for state, got in results.items():
        ref = [s["seconds"] for s in got["reference"]]
        for impl in impls:
            secs = [s["seconds"] for s in got[impl]]
            ratio = statistics.median(r / x for r, x in zip(ref, secs, strict=True))
            cpu = [statistics.median(s["ranks"][r]["cpu"] for s in got[impl]) * 1e3 for r in range(world)]
            rchar = [statistics.median(s["ranks"][r]["rchar"] for s in got[impl]) / 1e6 for r in range(world)]
            stor = [statistics.median(s["ranks"][r]["read_bytes"] for s in got[impl]) / 1e6 for r in range(world)]
            print(f"{state:<5} {impl:<13} {statistics.median(secs):>9.3f} {min(secs):>7.3f} {max(secs):>7.3f} "
                  f"{ratio:>6.2f}x  {' '.join(f'{x:.0f}' for x in cpu):<20} {' '.join(f'{x:.0f}' for x in rchar):<30} "
                  f"{' '.join(f'{x:.0f}' for x in stor) if state == 'cold' else '-':<26}")
    shard = [statistics.median(s["ranks"][r]["shard_bytes"] for s in next(iter(results.values()))[impls[0]]) / 1e6
             for r in range(world)] if results else []
    print(f"# shard MB per rank: {' '.join(f'{x:.0f}' for x in shard)}; tensor bytes each engine mode reads per "
          f"rank (direct_read_bytes): auto {' '.join(f'{x / 1e6:.0f}' for x in planned['engine'])}, "
          f"runs {' '.join(f'{x / 1e6:.0f}' for x in planned['engine-runs'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world=world, file_bytes=size, runs=runs, planned=planned, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
