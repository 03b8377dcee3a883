"""A process group loading one checkpoint from a throttled server: one rank, each rank alone, the group once.

``python scripts/bench_group.py --ranks 2 4 --mb 96 --rate-mb 40`` writes a checkpoint of ``--mb``
MB (4 shards and an index, with checksums), serves it from tests/rangeserver.py on 127.0.0.1 sending at most
``--rate-mb`` MB/s in all (a token bucket shared by every connection, as a storage service or
a node's NIC is), and times, in fresh processes per sample:

* ``one rank alone``: one process, ``engine.torch.load_file(url)`` (what a group load is held to;
  with ``--local``, ``backend="pread"``: owned tensors, as a group load's are);
* ``N ranks, each alone``: N gloo ranks, each ``load_file(url)`` by itself (N times the bytes);
* ``N ranks, process_group``: N gloo ranks, ``load_file(url, process_group=WORLD)``
  (``engine.apps.group_load``: the group reads each byte once and broadcasts).

Per row: the slowest rank's seconds (median of ``--runs``), the tensor bytes the server was
asked for as a multiple of the checkpoint's, and the largest peak resident memory of a rank
(``VmHWM``); every rank's tensors are compared with the file's.  ``--json PATH`` writes the
rows.  ``--local`` loads the files from disk instead (warm page cache; no server): where
sharing does not pay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402
from rangeserver import serving  # noqa: E402
from servers import free_port  # noqa: E402

CHILD = r"""
import hashlib, json, sys, time
import torch, torch.distributed as dist
import engine.torch
rank, world, port, url, out, group = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
if world > 1:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
t0 = time.perf_counter()
local = "://" not in url  # owned tensors both ways (a local file's default is a lazy mapping)
alone = {"backend": "pread"} if local else {}
got = engine.torch.load_file(url, process_group=dist.group.WORLD) if group == "1" else engine.torch.load_file(url, **alone)
seconds = time.perf_counter() - t0
# VmHWM: this process's peak (ru_maxrss would keep the parent's across exec), before the digest
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
digest = hashlib.sha256()
for k in sorted(got):
    digest.update(memoryview(got[k].contiguous().view(torch.uint8).numpy()))
with open(out, "w") as f:
    json.dump({"seconds": seconds, "digest": digest.hexdigest(), "peak_mb": peak}, f)
if world > 1:
    dist.barrier()
import os; os._exit(0)  # no interpreter teardown: gloo's threads may abort the process there
"""


def _sample(source: str, world: int, group: str, env: dict, scratch: str) -> list[dict]:
    """One sample: ``world`` fresh processes loading ``source``; what each reported."""
    port = free_port()
    outs = [os.path.join(scratch, f"rank{r}.json") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(world), str(port), source, outs[r], group],
                              env=env) for r in range(world)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"a rank failed ({world} ranks, group={group})")
    return [json.load(open(o)) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=float, default=96)
    ap.add_argument("--rate-mb", type=float, default=40)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--local", action="store_true", help="load from the local files (warm page cache), no server")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    import engine

    with tempfile.TemporaryDirectory(prefix="engine-group-") as root:
        rng = np.random.default_rng(0)
        n = int(args.mb * 1e6) // 4 // 8
        sd = {f"layers.{i}.w": rng.standard_normal((8, n // 8), dtype=np.float32) for i in range(8)}
        engine.save_sharded(sd, os.path.join(root, "ckpt"), max_shard_size=int(args.mb * 1e6) // 4 + 1,
                            checksums=True)  # every load checks them, as it would a checkpoint that records them
        want = hashlib.sha256(b"".join(np.ascontiguousarray(sd[k]).tobytes() for k in sorted(sd))).hexdigest()
        nbytes = sum(v.nbytes for v in sd.values())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        plan = [("one rank alone", 1, "0")]
        for world in args.ranks:
            plan += [(f"{world} ranks, each alone", world, "0"), (f"{world} ranks, process_group", world, "1")]
        rows = {}
        with serving(root) as server:
            server.bulk()
            server.rate = args.rate_mb * 1e6
            source = os.path.join(root, "ckpt") if args.local else server.url("ckpt/model.safetensors.index.json")
            _sample(source, 1, "0", env, root)  # warm-up: page cache, first imports
            for name, world, group in plan:
                times, asked, peaks = [], [], []
                for _ in range(args.runs):
                    server.requests.clear()
                    got = _sample(source, world, group, env, root)
                    if any(g["digest"] != want for g in got):
                        raise SystemExit(f"wrong bytes ({name})")
                    times.append(max(g["seconds"] for g in got))
                    asked.append(server.tensor_bytes_asked() / nbytes)
                    peaks.append(max(g["peak_mb"] for g in got))
                rows[name] = {"ranks": world, "group": group == "1", "seconds": statistics.median(times), "samples": times,
                              "bytes_asked": statistics.median(asked), "peak_rank_mb": statistics.median(peaks)}
    where = "local files, warm page cache" if args.local else f"server {args.rate_mb:g} MB/s in all"
    print(f"{nbytes / 1e6:.0f} MB of tensors in 4 shards, gloo ranks, {where}, {args.runs} runs, medians; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'row':28s} {'slowest rank s':>14s} {'bytes asked':>12s} {'peak MB/rank':>13s}  bytes")
    for name, r in rows.items():
        print(f"{name:28s} {r['seconds']:14.2f} {r['bytes_asked']:11.2f}x {r['peak_rank_mb']:13.0f}  equal")
    one = rows["one rank alone"]["seconds"]
    for world in args.ranks:
        group, alone = rows[f"{world} ranks, process_group"]["seconds"], rows[f"{world} ranks, each alone"]["seconds"]
        print(f"{world} ranks: process_group takes {group / alone:.2f}x the time of {world} independent loads, "
              f"{group / one:.2f}x one rank's load alone")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mb": nbytes / 1e6, "where": where, "runs": args.runs, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
