"""A process group loading one checkpoint from a throttled server: one rank, each rank alone, the group once.

A checkpoint of ``--mb`` MB (4 shards, checksums) served by tests/rangeserver.py at ``--rate-mb`` MB/s
in all; gloo ranks in fresh processes load it alone or with ``process_group=WORLD`` (each byte read
once and broadcast), and the exchange alone (the same bytes broadcast over gloo in the group load's
rounds, no reads: its share of the group's time).  Per row: the slowest rank's seconds, the bytes asked
of the server as a multiple of the checkpoint's, a rank's peak RSS.  ``--local``: from the local files instead.

    python scripts/bench_group.py --ranks 2 4 --mb 96 --rate-mb 40
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import harness


def entries(mb: float) -> list:
    """Eight F32 tensors of ``mb`` MB in all (4 shards of two)."""
    n = int(mb * 1e6) // 4 // 8
    return [(f"layers.{i}.w", "F32", (8, n // 8)) for i in range(8)]


def _digest(tensors: dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(memoryview(tensors[k].contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


def rank(rank: int, world: int, port: int, source: str, group: bool) -> dict:
    """One rank's load (a fresh process): its seconds, its peak RSS and a digest of its tensors."""
    import time

    import torch.distributed as dist
    from benchmarks import common

    import engine.torch

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.barrier()
    t0 = time.perf_counter()
    kw = {"process_group": dist.group.WORLD} if group else {} if "://" in source else {"backend": "pread"}
    got = engine.torch.load_file(source, **kw)
    out = {"seconds": time.perf_counter() - t0, "peak_bytes": common.hwm_bytes(), "digest": _digest(got)}
    if world > 1:
        dist.barrier()
    return out


def exchange(rank: int, world: int, port: int, nbytes: int) -> dict:
    """The group load's exchange alone (a fresh process per rank): the same bytes in rounds of
    the group load's size, each rank's share of a round broadcast to the others, every share in
    flight at once; no reads."""
    import time

    import torch
    import torch.distributed as dist

    from engine.apps.group_load import BUCKET_BYTES, spans

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    buf = torch.ones(min(nbytes, BUCKET_BYTES), dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    for lo in range(0, nbytes, BUCKET_BYTES):
        n = min(BUCKET_BYTES, nbytes - lo)
        works = [dist.broadcast(buf[a:b], src=k, async_op=True) for k, (a, b) in enumerate(spans(n, world)) if a < b]
        for w in works:
            w.wait()
    out = {"seconds": time.perf_counter() - t0}
    dist.barrier()
    return out


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=float, default=96)
    ap.add_argument("--rate-mb", type=float, default=40)
    ap.add_argument("--local", action="store_true")
    a = ap.parse_args(argv)
    from benchmarks import common
    from rangeserver import serving

    import engine.torch

    report = harness.Report()
    with tempfile.TemporaryDirectory(prefix="engine-group-") as root:
        # every load checks the checksums, as it would a checkpoint that records them
        directory = harness.checkpoint(0, root, entries=entries(a.mb), shards=4, checksums=True)
        want = _digest(engine.torch.load_file(directory, backend="pread"))
        nbytes = sum(engine.read_header(f).data_size for f in common.checkpoint_files(directory))
        plan = [("one rank alone", 1, False)]
        for world in a.ranks:
            plan += [(f"{world} ranks, each alone", world, False), (f"{world} ranks, process_group", world, True),
                     (f"{world} ranks, the exchange alone", world, None)]
        where = "local files, warm page cache" if a.local else f"server sending {a.rate_mb:g} MB/s in all"
        with serving(root) as server:
            server.bulk()
            server.rate = a.rate_mb * 1e6
            source = directory if a.local else server.url(os.path.basename(directory) + "/model.safetensors.index.json")

            def sample(p):
                if p[2] is None:  # the same bytes over gloo, no reads: the exchange's share of the group's time
                    return {"seconds": max(g["seconds"] for g in harness.ranks(exchange, p[1], nbytes)),
                            "peak": 0, "asked": 0.0}
                server.requests.clear()
                got = harness.ranks(rank, p[1], source, p[2])
                if any(g["digest"] != want for g in got):
                    raise SystemExit(f"wrong bytes ({p[0]})")
                return {"seconds": max(g["seconds"] for g in got), "peak": max(g["peak_bytes"] for g in got),
                        "asked": server.tensor_bytes_asked() / nbytes}

            sample(plan[0])  # warm-up: page cache, first imports
            got = harness.rounds(plan, a.runs, sample)
    for (name, world, group), s in got.items():
        if group is None:
            report.add(f"{name}", "limit: gloo broadcasts of the same bytes", [x["seconds"] for x in s], nbytes,
                       ranks=world)
            continue
        report.add(f"{name}, {where}", "engine, process_group" if group else "engine", [x["seconds"] for x in s],
                   nbytes, ranks=world, bytes_asked_x=harness.median(x["asked"] for x in s),
                   peak_rank_bytes=harness.median(x["peak"] for x in s))
    report.ratio("x_one_rank", report.rows[0]["median_s"])
    for world in a.ranks:
        alone, g, ex = (report.seconds(f"{world} ranks, {c}") for c in (f"each alone, {where}",
                                                                          f"process_group, {where}", "the exchange alone"))
        if g and alone and ex:
            report.note(f"{world} ranks: process_group takes {g / alone:.2f}x the time of {world} independent loads; "
                        f"the exchange alone (gloo, the same bytes) is {ex / g:.2f} of the group's time")
    return report.finish(a.json, "case", "impl", "median_s", "x_one_rank", "bytes_asked_x", "peak_rank_bytes")


if __name__ == "__main__":
    sys.exit(main())
