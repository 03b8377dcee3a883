"""save_file against the reference ``safetensors``, at three sizes and both durabilities.

``gpt2``: a GPT-2 (124M) shaped F32 state dict (548 MB); ``2g``: a 2 GB BF16 checkpoint; ``fixed``:
GPT-2's 160 names with 16-byte tensors (per-save costs).  ``fsync``: the engine's default against the
reference's ``save_file`` then ``fsync`` of the file and its folder; ``nofsync``: neither syncs.

    python scripts/bench_save.py --only gpt2 --repeat 11 --dir /data/tmp
"""

from __future__ import annotations

import os
import sys
import tempfile

import harness

VARIANTS = [("reference", "fsync"), ("engine", "fsync"), ("reference", "nofsync"), ("engine", "nofsync")]


def gpt2_tensors() -> dict:
    """GPT-2 (124M) shapes in F32, attention-mask buffers included: 548 MB."""
    import torch

    d, vocab, ctx = 768, 50257, 1024
    shapes = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d)}
    for i in range(12):
        shapes.update({f"h.{i}.{k}": s for k, s in (
            ("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.bias", (1, 1, ctx, ctx)),
            ("attn.c_attn.weight", (d, 3 * d)), ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)),
            ("attn.c_proj.bias", (d,)), ("ln_2.weight", (d,)), ("ln_2.bias", (d,)), ("mlp.c_fc.weight", (d, 4 * d)),
            ("mlp.c_fc.bias", (4 * d,)), ("mlp.c_proj.weight", (4 * d, d)), ("mlp.c_proj.bias", (d,)))})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    g = torch.Generator().manual_seed(0)
    return {k: torch.empty(s, dtype=torch.float32).normal_(generator=g) for k, s in shapes.items()}


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sample(impl: str, durability: str, size: str, out: str) -> dict:
    """One timed save in this fresh process."""
    import torch
    from benchmarks import common

    torch.set_num_threads(1)
    sync = durability == "fsync"
    if impl == "reference":
        import safetensors.torch as st

        def save(tensors, path):
            st.save_file(tensors, path)
            if sync:  # the engine's default durability: the file, then its directory
                _fsync_path(path)
                _fsync_path(os.path.dirname(path))
    else:
        from engine.writing import writer

        def save(tensors, path):
            writer.save_file(tensors, path, fsync=sync)

    tensors = {"gpt2": gpt2_tensors, "fixed": lambda: {k: torch.zeros(4) for k in gpt2_tensors()},
               "2g": lambda: common.checkpoint_tensors(2_000_000_000)}[size]()
    save({"w": torch.zeros(4)}, out + ".warm")
    os.unlink(out + ".warm")
    os.sync()
    seconds = harness.median(harness.times(lambda: save(tensors, out), 50 if size == "fixed" else 1, warmup=0))
    file_bytes = os.path.getsize(out)
    os.unlink(out)
    os.sync()
    return {"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "file_bytes": file_bytes, "tensors": len(tensors)}


def main(argv=None) -> int:
    ap = harness.parser(__doc__, dir=None)
    ap.add_argument("--only", nargs="+", choices=["fixed", "gpt2", "2g"], default=["fixed", "gpt2", "2g"])
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    from benchmarks import common

    common.compile_engine()
    base = a.dir or tempfile.mkdtemp(prefix="bench-save-")
    os.makedirs(base, exist_ok=True)
    report = harness.Report()
    for size in a.only:
        got = harness.rounds(VARIANTS, a.repeat, lambda v, size=size: harness.call(
            sample, *v, size, os.path.join(base, f"{size}-{v[0]}-{v[1]}.safetensors"), timeout=1200), rotate=True)
        for (impl, durability), samples in got.items():
            info = samples[0]
            report.add(f"save_file {size}, {durability}", impl, [s["seconds"] for s in samples], info["bytes"],
                       file_bytes=info["file_bytes"], tensors=info["tensors"])
        for durability in ("fsync", "nofsync"):
            ratios = sorted(r["seconds"] / e["seconds"] for r, e in zip(got[("reference", durability)],
                                                                        got[("engine", durability)], strict=True))
            report.rows[-4 + VARIANTS.index(("engine", durability))]["round_ratios"] = [ratios[0], ratios[-1]]
    report.against("x_reference", "reference")
    report.note(f"medians of {a.repeat} fresh-process samples per variant, written to {base}")
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_reference", "round_ratios", "file_bytes")


if __name__ == "__main__":
    sys.exit(main())
