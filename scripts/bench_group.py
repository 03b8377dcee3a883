"""A process group loading one checkpoint from a throttled server: each rank alone, or the group once.

``python scripts/bench_group.py --ranks 2 --mb 96 --rate-mb 40`` writes a checkpoint of ``--mb`` MB
(4 shards and an index), serves it from tests/rangeserver.py on 127.0.0.1 sending at most
``--rate-mb`` MB/s in all (a shared link, a throttled store), and times, each in fresh
processes, ``--ranks`` gloo ranks loading it with ``engine.torch.load_file(url)`` each on its own
and with ``process_group=`` (``engine.apps.group_load``: the group reads each byte once).
It prints, per row, the slowest rank's seconds (median of ``--runs``) and the tensor bytes the
server was asked for, as a multiple of the checkpoint's; every rank's tensors are compared
with the file's.
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
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
dist.barrier()
t0 = time.perf_counter()
got = engine.torch.load_file(url, process_group=dist.group.WORLD) if group == "1" else engine.torch.load_file(url)
seconds = time.perf_counter() - t0
digest = hashlib.sha256()
for k in sorted(got):
    digest.update(got[k].contiguous().view(torch.uint8).numpy().tobytes())
with open(out, "w") as f:
    json.dump({"seconds": seconds, "digest": digest.hexdigest()}, f)
dist.barrier()
import os; os._exit(0)  # no interpreter teardown: gloo's threads may abort the process there
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=float, default=96)
    ap.add_argument("--rate-mb", type=float, default=40)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import engine

    with tempfile.TemporaryDirectory(prefix="engine-group-") as root:
        rng = np.random.default_rng(0)
        n = int(args.mb * 1e6) // 4 // 8
        sd = {f"layers.{i}.w": rng.standard_normal((8, n // 8), dtype=np.float32) for i in range(8)}
        engine.save_sharded(sd, os.path.join(root, "ckpt"), max_shard_size=int(args.mb * 1e6) // 4 + 1)
        want = hashlib.sha256(b"".join(np.ascontiguousarray(sd[k]).tobytes() for k in sorted(sd))).hexdigest()
        nbytes = sum(v.nbytes for v in sd.values())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        rows = {}
        with serving(root) as server:
            server.bulk()
            server.rate = args.rate_mb * 1e6
            url = server.url("ckpt/model.safetensors.index.json")
            for name, group in (("each rank alone", "0"), ("process_group (the group once)", "1")):
                times, asked = [], []
                for run in range(args.runs):
                    server.requests.clear()
                    port = free_port()
                    outs = [os.path.join(root, f"{group}-{run}-{r}.json") for r in range(args.ranks)]
                    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(r), str(args.ranks), str(port), url,
                                               outs[r], group], env=env) for r in range(args.ranks)]
                    for p in procs:
                        if p.wait(timeout=600) != 0:
                            raise SystemExit(f"a rank failed ({name})")
                    got = [json.load(open(o)) for o in outs]
                    if any(g["digest"] != want for g in got):
                        raise SystemExit(f"wrong bytes ({name})")
                    times.append(max(g["seconds"] for g in got))
                    asked.append(server.tensor_bytes_asked() / nbytes)
                rows[name] = (statistics.median(times), statistics.median(asked))
    print(f"{nbytes / 1e6:.0f} MB of tensors in 4 shards, {args.ranks} gloo ranks, server {args.rate_mb:g} MB/s in all, "
          f"{args.runs} runs, medians; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'row':34s} {'slowest rank s':>14s} {'bytes asked':>12s}  bytes")
    for name, (sec, asked) in rows.items():
        print(f"{name:34s} {sec:14.2f} {asked:11.2f}x  equal")
    alone, group = rows["each rank alone"][0], rows["process_group (the group once)"][0]
    print(f"process_group: {alone / group:.2f}x faster than each rank alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
