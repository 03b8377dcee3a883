"""Host memory a load holds beyond its outputs, at its peak, per load path, beside the time.

Each sample is a fresh process per rank (gloo ranks for the group rows): the outputs (for
``load_into``, pre-faulted CPU tensors, the stand-in for a GPU's parameters) are made first,
the process's peak RSS is reset (``/proc/self/clear_refs``), the load runs, and the row's
figure is the peak RSS less the RSS at the start, less the outputs the load made itself (an
owned load's tensors).  A group row sums its ranks: the node's extra memory.  Consumers of a
stream keep nothing they are handed.  ``x_model`` is that figure over the checkpoint's bytes;
every sample's tensors are hashed against the file's.

    python scripts/bench_memory.py --size 1GiB --ranks 4 --runs 3
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import harness

MIB = 1 << 20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def sample(rank: int, world: int, port: int, mode: str, path: str, opts: dict) -> dict:
    """One rank's load (a fresh process): seconds, peak host bytes beyond its outputs, digest."""
    import time

    import torch
    import torch.distributed as dist

    import engine
    import engine.apps.group_load  # noqa: F401  (imports are the first use's, not the load's)
    import engine.loading.fill  # noqa: F401
    import engine.serving.weights  # noqa: F401
    import engine.torch

    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
    header = engine.read_header(path)
    order = sorted(header.keys(), key=lambda k: header[k].data_offsets[0])
    dest = harness.destination(path) if mode in ("into", "reference") else {}
    if group is not None:
        dist.barrier()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from here
    h = hashlib.sha256()
    owned = 0
    t0 = time.perf_counter()
    if mode == "owned":
        got = engine.torch.load_file(path, backend="pread", process_group=group, **opts)
        owned = sum(t.numel() * t.element_size() for t in got.values())
    elif mode == "into":
        engine.load_into(path, dest, process_group=group, **opts)
    elif mode == "reference":  # each rank alone, the reference's handle, one tensor at a time
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            for k in order:
                dest[k].copy_(f.get_tensor(k))
    else:
        if mode == "stream":
            tensors = engine.stream(path, framework="pt", process_group=group, **opts)
        else:  # the serving loader's weights, a server that copies each tensor and drops it
            from engine.serving.weights import Weights, parse_options

            tensors = Weights(path, options=parse_options({"distributed": world > 1, **opts}), group=group)
        for _, t in tensors:
            h.update(t.view(torch.uint8).numpy())
            del t
    seconds = time.perf_counter() - t0
    extra = _status("VmHWM") - base - owned
    if mode == "owned":
        for k in order:
            h.update(got[k].view(torch.uint8).numpy())
    elif mode in ("into", "reference"):
        for k in order:
            h.update(dest[k].view(torch.uint8).numpy())
    if group is not None:
        dist.barrier()
    return {"seconds": seconds, "extra": extra, "digest": h.hexdigest()}


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=3)
    ap.add_argument("--size", type=harness.parse_size, default=harness.parse_size("1GiB"))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--limit", type=harness.parse_size, default=harness.parse_size("128MiB"),
                    help="memory_limit of the limited group rows (bytes per rank)")
    a = ap.parse_args(argv)
    import numpy as np

    import engine

    report = harness.Report()
    with tempfile.TemporaryDirectory(prefix="engine-memory-") as root:
        path = os.path.join(root, "model.safetensors")
        n = 4 * MIB  # tensors of 4 MiB (F32), the size of a small model's layers
        rng = np.random.default_rng(0)
        sd = {f"layers.{i}.w": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(a.size // n)}
        engine.save_file(sd, path)
        header = engine.read_header(path)
        want = hashlib.sha256(b"".join(sd[k].tobytes() for k in sorted(sd, key=lambda k: header[k].data_offsets[0])))
        nbytes = sum(v.nbytes for v in sd.values())
        del sd
        w, lim = a.ranks, {"memory_limit": a.limit}
        plan = [("one process: owned load_file (pread)", "engine", "owned", 1, {}),
                ("one process: load_into CPU tensors", "engine", "into", 1, {}),
                ("one process: load_into CPU tensors", "reference", "reference", 1, {}),
                ("one process: stream, nothing kept", "engine", "stream", 1, {}),
                (f"{w} ranks: owned load_file, process_group", "engine", "owned", w, {}),
                (f"{w} ranks: load_into CPU tensors, process_group", "engine", "into", w, {}),
                (f"{w} ranks: load_into CPU tensors, process_group", f"engine, memory_limit={a.limit >> 20}MiB",
                 "into", w, lim),
                (f"{w} ranks: load_into CPU tensors, each alone", "reference", "reference", w, {}),
                (f"{w} ranks: stream, process_group, nothing kept", "engine", "stream", w, {}),
                (f"{w} ranks: stream, process_group, nothing kept", f"engine, memory_limit={a.limit >> 20}MiB",
                 "stream", w, lim),
                (f"{w} ranks: serving Weights, distributed", "engine", "weights", w, {})]

        def one(p):
            got = harness.ranks(sample, p[3], p[2], path, p[4])
            if any(g["digest"] != want.hexdigest() for g in got):
                raise SystemExit(f"wrong bytes ({p[0]}, {p[1]})")
            return {"seconds": max(g["seconds"] for g in got), "extra": sum(g["extra"] for g in got)}

        one(plan[0])  # warm-up: the page cache, first imports
        got = harness.rounds([p[:2] + (p[2], p[3], tuple(p[4].items())) for p in plan], a.runs,
                             lambda p: one((*p[:4], dict(p[4]))))
    for (case, impl, _, world, _), s in got.items():
        extra = harness.median(x["extra"] for x in s)
        report.add(case, impl, [x["seconds"] for x in s], nbytes, ranks=world, extra_mib=extra / MIB,
                   x_model=extra / nbytes)
    report.note(f"checkpoint: {nbytes / 2**30:.2f} GiB of 4 MiB tensors; x model: the node's peak host memory beyond "
                "the outputs over the checkpoint's bytes (every rank of a group summed)")
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "extra_mib", "x_model")


if __name__ == "__main__":
    sys.exit(main())
