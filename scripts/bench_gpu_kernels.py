"""Statistics and int8 quantization on the GPU during a load, against a plain load and the reference.

Streams a Llama-3-8B-shaped BF16 checkpoint (about 16 GB; generated once) to CUDA with the page
cache warm, one fresh process per sample, and prints medians of:

* ``reference``   safetensors ``safe_open(path, "pt", device="cuda")``, every tensor
* ``plain``       ``engine.stream(path, device="cuda")``
* ``stats``       the same with ``stats=True`` (device statistics, CUDA kernels on each copy's stream)
* ``int8``        ``quantize="int8"``: default selection (2-D weights, not embeddings), a scale per row
* ``int8+stats``  both

with wall time, GB/s of file bytes, and peak device memory (``torch.cuda.max_memory_allocated``),
then the ratios the project tracks: stats wall / plain wall (target <= 1.05), int8 GB/s / plain
GB/s (target >= 0.90), and each mode against the reference.  Every sample is a fresh
process; the first sample of each mode is also run once untimed beforehand, so the Numba
CUDA cache is warm (a load's first launch otherwise pays the JIT).

    python scripts/bench_gpu_kernels.py                          # 16 GB, 5 samples per mode
    python scripts/bench_gpu_kernels.py --layers 2 --repeat 3    # smoke run (about 1.5 GB)
    python scripts/bench_gpu_kernels.py --path /data/llama3.safetensors --json out.json

Needs a CUDA GPU, torch with CUDA, the reference ``safetensors``, and Numba's CUDA target
(with the CUDA toolkit's NVVM: a CUDA_HOME, or the ``nvidia-cuda-nvcc-cu12`` wheel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODES = ("reference", "plain", "stats", "int8", "int8+stats")

#: Llama-3-8B: hidden 4096, 32 layers, MLP 14336, 8 KV heads of 128, vocabulary 128256
HIDDEN, LAYERS, MLP, KV, VOCAB = 4096, 32, 14336, 1024, 128256


def shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (MLP, HIDDEN)),
            (p + "mlp.up_proj.weight", (MLP, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, MLP)),
        ]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def make_checkpoint(path: str, layers: int) -> None:
    """Write the checkpoint tensor by tensor (weights ~ N(0, 0.02), norms near 1), in
    bounded memory, unless a file of the right size is already there."""
    import torch

    from engine.writing.writer import open_writer

    entries = [(name, "BF16", shape) for name, shape in shapes(layers)]
    size = sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for _, _, s in entries)
    if os.path.exists(path) and os.path.getsize(path) >= size:
        return
    gen = torch.Generator().manual_seed(0)
    writer = open_writer(path, entries, {"format": "pt"}, fsync=False)
    try:
        for name, _, shape in entries:
            if len(shape) == 1:
                t = 1 + 0.05 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            writer.write(name, t.to(torch.bfloat16))
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def child(mode: str, path: str) -> dict:
    """One timed load in this (fresh) process."""
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context, outside the timing
    if mode != "reference":
        import engine  # noqa: F401  (imports outside the timing, as an application's would be)
        import engine.loading.loader

        if mode != "plain":
            import engine.device  # noqa: F401  (Numba's CUDA target)
    torch.cuda.reset_peak_memory_stats()
    keep = []
    t0 = time.perf_counter()
    if mode == "reference":
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cuda") as f:
            for k in f.keys():
                keep.append(f.get_tensor(k))
    else:
        kw = {"stats": "stats" in mode, "quantize": "int8" if "int8" in mode else None}
        for item in engine.stream(path, framework="pt", device="cuda", **kw):
            keep.append(item[1])
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"mode": mode, "wall_s": wall, "file_bytes": os.path.getsize(path),
            "peak_device_bytes": torch.cuda.max_memory_allocated(), "tensors": len(keep)}


def sample(mode: str, path: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--path", path], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "llama3-8b-bf16.safetensors"))
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=MODES)
    ap.add_argument("--json")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path)))
        return 0

    make_checkpoint(args.path, args.layers)
    size = os.path.getsize(args.path)
    subprocess.run(["cat", args.path], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    modes = args.only or MODES
    results = {}
    for mode in modes:
        sample(mode, args.path)  # warm-up: Numba's CUDA cache, the page cache
        runs = [sample(mode, args.path) for _ in range(args.repeat)]
        results[mode] = {
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "peak_device_bytes": max(r["peak_device_bytes"] for r in runs),
            "samples": [r["wall_s"] for r in runs],
        }
        r = results[mode]
        r["gb_s"] = size / r["wall_s"] / 1e9
        print(f"{mode:12s} {r['wall_s']:8.3f} s  {r['gb_s']:6.2f} GB/s  peak device "
              f"{r['peak_device_bytes'] / 1e9:6.2f} GB", flush=True)

    ratios = {}
    if "plain" in results:
        base = results["plain"]
        if "stats" in results:
            ratios["stats_wall_over_plain"] = results["stats"]["wall_s"] / base["wall_s"]
        if "int8" in results:
            ratios["int8_gbs_over_plain"] = results["int8"]["gb_s"] / base["gb_s"]
            ratios["int8_peak_over_file"] = results["int8"]["peak_device_bytes"] / size
    if "reference" in results:
        for mode in results:
            if mode != "reference":
                ratios[f"{mode}_gbs_over_reference"] = results[mode]["gb_s"] / results["reference"]["gb_s"]
    for k, v in ratios.items():
        print(f"{k:32s} {v:6.3f}")
    if args.json:
        import torch

        meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
                "host": platform.node(), "file_bytes": size, "layers": args.layers, "repeat": args.repeat,
                "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
