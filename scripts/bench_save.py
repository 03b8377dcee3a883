#!/usr/bin/env python
"""save_file against the reference ``safetensors``, at two sizes and both durabilities.

  gpt2   a GPT-2 (124M) shaped F32 state dict with its attention-mask buffers: 548 MB,
         160 tensors (the Hub's ``gpt2/model.safetensors``)
  2g     a 2 GB BF16 Llama-shaped checkpoint (``asv_benchmarks/benchmarks/common.py``)
  fixed  GPT-2's 160 names with 16-byte tensors: only the per-save and per-tensor costs;
         each sample is the median of 50 saves in its process

Durability ``fsync``: the engine's default ``save_file`` (file synced before the rename,
directory after) against the reference's ``save_file`` followed by ``fsync`` of the file
and of its directory.  ``nofsync``: ``save_file(..., fsync=False)`` against the plain
reference.

Every sample runs in a fresh process: build the tensors (every page touched), ``os.sync()``
so that no earlier write-back is pending, an untimed one-tensor save with the same library,
then the timed save; the output is removed afterwards.  The four variants alternate within
each round, in an order that rotates from round to round, so that drift on a shared machine
hits them alike.  Reported: median and min-max per variant, and ref/engine (the
reference's median over the engine's: above 1 the engine is faster).

Usage::

    python scripts/bench_save.py                      # both sizes, 7 rounds
    python scripts/bench_save.py --only gpt2 --repeat 11 --dir /data/tmp
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "asv_benchmarks")]

VARIANTS = [("reference", "fsync"), ("engine", "fsync"), ("reference", "nofsync"), ("engine", "nofsync")]


def gpt2_tensors() -> dict:
    """GPT-2 (124M) shapes in F32, attention-mask buffers included: 548 MB."""
    import torch

    d, layers, vocab, ctx = 768, 12, 50257, 1024
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.bias": (1, 1, ctx, ctx),
            p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,),
        })  # fmt: skip
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    g = torch.Generator().manual_seed(0)
    return {k: torch.empty(s, dtype=torch.float32).normal_(generator=g) for k, s in shapes.items()}


def make_tensors(size: str) -> dict:
    if size == "gpt2":
        return gpt2_tensors()
    if size == "fixed":
        import torch

        return {k: torch.zeros(4) for k in gpt2_tensors()}
    from benchmarks import common

    return common.checkpoint_tensors(2_000_000_000)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    impl, durability, out = spec["impl"], spec["durability"], spec["out"]
    sync = durability == "fsync"
    if impl == "reference":
        import safetensors.torch as st

        def save(tensors, path):
            st.save_file(tensors, path)
            if sync:  # the same durability as the engine's default: file, then directory
                _fsync_path(path)
                _fsync_path(os.path.dirname(path))
    else:
        from engine.writing import writer

        def save(tensors, path):
            writer.save_file(tensors, path, fsync=sync)

    tensors = make_tensors(spec["size"])
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    warm = out + ".warm"
    save({"w": torch.zeros(4)}, warm)
    os.unlink(warm)
    os.sync()
    times = []
    for _ in range(50 if spec["size"] == "fixed" else 1):
        t0 = time.perf_counter()
        save(tensors, out)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    size = os.path.getsize(out)
    os.unlink(out)
    os.sync()
    return {"seconds": seconds, "bytes": nbytes, "file_bytes": size, "tensors": len(tensors)}


def run_child(spec: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"worker failed: {spec}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def fmt(s: float) -> str:
    if s < 0.01:
        return f"{s * 1000:.2f} ms"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.3f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=["fixed", "gpt2", "2g"], default=["fixed", "gpt2", "2g"])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the files are written (default: a temporary directory)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    from benchmarks import common

    common.compile_engine()  # no sample compiles the engine's modules (see compile_engine)

    base = args.dir or tempfile.mkdtemp(prefix="bench-save-")
    os.makedirs(base, exist_ok=True)
    load0 = os.getloadavg()
    rows = []
    for size in args.only:
        samples: dict = {v: [] for v in VARIANTS}
        info = None
        for rep in range(args.repeat):
            k = rep % len(VARIANTS)
            for impl, durability in VARIANTS[k:] + VARIANTS[:k]:
                out = os.path.join(base, f"{size}-{impl}-{durability}.safetensors")
                r = run_child({"impl": impl, "durability": durability, "size": size, "out": out})
                samples[(impl, durability)].append(r["seconds"])
                info = r
        for durability in ("fsync", "nofsync"):
            ref = samples[("reference", durability)]
            eng = samples[("engine", durability)]
            ratio = statistics.median(ref) / statistics.median(eng)
            ratios = sorted(a / b for a, b in zip(ref, eng, strict=True))
            rows.append((size, durability, ref, eng, ratio, ratios, info))
    load1 = os.getloadavg()

    print(f"{'size':6} {'durability':10} {'reference':>20} {'engine':>20} {'ref/eng':>8}  per-round ratios")
    for size, durability, ref, eng, ratio, ratios, _ in rows:
        def cell(xs):
            return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"

        print(f"{size:6} {durability:10} {cell(ref):>20} {cell(eng):>20} {ratio:7.2f}x  "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f} (median {statistics.median(ratios):.2f})")
    for size in args.only:
        info = next(r[6] for r in rows if r[0] == size)
        print(f"{size}: {info['tensors']} tensors, {info['bytes'] / 1e6:.3g} MB of tensor data, "
              f"file {info['file_bytes'] / 1e6:.3g} MB")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    print(f"medians of {args.repeat} fresh-process samples per variant, written to {base}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"engine @ {rev.strip()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z; "
          f"load average at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
          f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
