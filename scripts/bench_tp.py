"""Tensor-parallel loading: per-rank time and bytes read, engine against the reference.

Spawns WORLD gloo processes on this machine.  Each rank loads its shard of every tensor of
a generated LLaMA-shaped checkpoint with

* engine: ``load_tensor_parallel(path, llama_plan(config, world_size))`` (direct mode), and
* the reference: ``safetensors.safe_open(framework="pt")`` + ``get_slice(name)[index]``
  with the same index for every tensor (the usual way servers shard today),

from a cold page cache (the file is evicted with POSIX_FADV_DONTNEED before each run) so
that ``read_bytes`` in /proc/self/io counts what each rank really pulled from storage.

    python scripts/bench_tp.py                # ~1 GB checkpoint, world 4, 3 runs
    python scripts/bench_tp.py --quick        # small, world 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    from engine.validator import expected_tensors

    sd = {name: torch.randn(shape).bfloat16() for name, shape in expected_tensors(cfg).items()}
    engine.torch.save_file(sd, path)


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def worker(rank, world, port, path, cfg, runs, out):
    import safetensors

    from engine.distributed import Replicate, llama_plan, load_tensor_parallel, shard_index

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    plan = llama_plan(cfg, world_size=world)

    def ours():
        return load_tensor_parallel(path, plan)

    def reference():
        out = {}
        with safetensors.safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                action = plan.action(name)
                if isinstance(action, Replicate):
                    out[name] = sl[:]
                    continue
                parts = [sl[index] for index, _ in shard_index(name, sl.get_shape(), action, rank, world)]
                out[name] = (parts[0] if len(parts) == 1 else torch.cat(parts, action.dim)).contiguous()
        return out

    results = {}
    for label, fn in (("engine", ours), ("reference", reference)):
        times, nbytes = [], []
        for _ in range(runs):
            dist.barrier()
            if rank == 0:
                evict(path)
            dist.barrier()
            before = read_bytes()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            nbytes.append(read_bytes() - before)
        results[label] = dict(seconds=statistics.median(times), read_bytes=statistics.median(nbytes))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    cfg = config_for(args.quick)
    world = args.world or (2 if args.quick else 4)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"bench-tp-{'quick' if args.quick else 'full'}.safetensors")
    make(path, cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(world, port, path, cfg, args.runs, out), nprocs=world, join=True)
        rows = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    size = os.path.getsize(path)
    print(f"# {time.strftime('%Y-%m-%d')} file {size / 1e6:.0f} MB, world {world}, cold cache, median of {args.runs}")
    print(f"{'rank':>4} {'engine s':>9} {'engine MB read':>15} {'ref s':>8} {'ref MB read':>12} {'ref/eng time':>13}")
    for r, row in enumerate(rows):
        e, ref = row["engine"], row["reference"]
        print(f"{r:>4} {e['seconds']:>9.3f} {e['read_bytes'] / 1e6:>15.1f} {ref['seconds']:>8.3f} "
              f"{ref['read_bytes'] / 1e6:>12.1f} {ref['seconds'] / e['seconds']:>12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
