"""vLLM's weight-loading time with its own loader and with the engine's load format.

Writes a Llama-shaped sharded checkpoint of ``--gb`` gigabytes (random weights, a
``config.json``; no tokenizer: the engine is started with ``skip_tokenizer_init``), reads it
once so that the page cache is warm, then starts vLLM in a fresh process per sample and load
format, interleaved (sample 1 of every format, then sample 2, ...), and reads the time vLLM
logs ("Loading weights took X seconds": from the weights iterator to the end of the model's
``load_weights``; the engine's format logs the same line over the same span).  Prints the
median of each format and its ratio to vLLM's default (``safetensors``).

    python scripts/bench_vllm.py                         # 1.05 GB float32, 5 samples, CPU
    python scripts/bench_vllm.py --gb 0.05 --runs 1      # a dry run
    python scripts/bench_vllm.py --cold                  # the checkpoint evicted before each sample
    python scripts/bench_vllm.py --load-formats safetensors,safetensors_engine,instanttensor,fastsafetensors \\
        --dtype bfloat16 --gb 8                          # a GPU host with those packages

Run it with the Python of a venv that has vLLM and the engine installed (``.ci/vllm_lane.sh
install`` makes one).  ``--engine-config`` passes ``--model-loader-extra-config`` to the
engine's format (e.g. ``'{"cpu": "owned"}'``); ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOOK = re.compile(r"Loading weights took ([0-9.]+) seconds")

# TinyLlama's shape: hidden 2048, 32 heads of 64, 4 KV heads, MLP 5632, vocabulary 32000
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000

CHILD = r"""
import os, sys, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM
args = json.loads(sys.argv[1])
kw = dict(model=args["model"], load_format=args["format"], dtype=args["dtype"], enforce_eager=True,
          skip_tokenizer_init=True, max_model_len=128, max_num_seqs=1)
if args["extra"] is not None:
    kw["model_loader_extra_config"] = args["extra"]
if args["memory"] is not None:
    kw["gpu_memory_utilization"] = args["memory"]
LLM(**kw)
"""


def layers_for(gb: float, itemsize: int) -> int:
    per_layer = (2 * HIDDEN * HIDDEN + 2 * KV_HEADS * 64 * HIDDEN + 3 * HIDDEN * INTER + 2 * HIDDEN) * itemsize
    fixed = (2 * VOCAB * HIDDEN + HIDDEN) * itemsize
    return max(1, -(-int(gb * 1e9 - fixed) // per_layer))


def write_checkpoint(directory: str, gb: float, dtype: str) -> int:
    """A Llama-shaped sharded checkpoint of about ``gb`` GB (at least one layer); returns its bytes."""
    import torch

    sys.path.insert(0, ROOT)
    from engine.checkpoints.shards import save_sharded

    tdtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=tdtype).element_size()
    layers = layers_for(gb, itemsize)
    hidden, inter, vocab = HIDDEN, INTER, VOCAB
    if gb < 0.2:  # a dry run: a narrower model, still at least one layer of every kind
        hidden, inter, vocab = 256, 704, 4000
        layers = 2
    gen = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(tdtype)

    kv = KV_HEADS * 64 if hidden >= KV_HEADS * 64 * 2 else hidden // 2
    t = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=tdtype)
        t[p + "self_attn.q_proj.weight"] = w(hidden, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=tdtype)
        t[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        t[p + "mlp.up_proj.weight"] = w(inter, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, inter)
    t["model.norm.weight"] = torch.ones(hidden, dtype=tdtype)
    t["lm_head.weight"] = w(vocab, hidden)
    save_sharded(t, directory, max_shard_size="500MB", fsync=False)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": hidden // 64, "num_key_value_heads": kv // 64,
        "head_dim": 64, "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": dtype, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(x.numel() * x.element_size() for x in t.values())


def warm(directory: str) -> None:
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(64 << 20):
                pass


def evict(directory: str) -> None:
    """Drop the checkpoint's pages from the page cache (``POSIX_FADV_DONTNEED``; clean pages
    of a file nobody maps go at once), for a cold-cache sample."""
    for name in sorted(os.listdir(directory)):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sample(python: str, model: str, fmt: str, dtype: str, extra, memory, timeout: float) -> dict:
    args = {"model": model, "format": fmt, "dtype": dtype, "extra": extra, "memory": memory}
    started = time.perf_counter()
    proc = subprocess.run([python, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    out = proc.stdout + proc.stderr
    found = TOOK.findall(out)
    if proc.returncode != 0 or not found:
        tail = "\n".join(out.splitlines()[-25:])
        raise SystemExit(f"load format {fmt!r}: exit {proc.returncode}, no load time logged:\n{tail}")
    return {"format": fmt, "seconds": float(found[-1]), "process_s": round(wall, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.05, help="checkpoint size in GB (default 1.05)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--runs", type=int, default=5, help="samples per load format (default 5)")
    ap.add_argument("--load-formats", default="safetensors,safetensors_engine",
                    help="comma-separated; the first is the baseline of the ratios")
    ap.add_argument("--engine-config", default=None, help="JSON for the engine's --model-loader-extra-config")
    ap.add_argument("--memory", type=float, default=None,
                    help="gpu_memory_utilization (on the CPU backend: the share of RAM vLLM reserves; "
                         "default 0.25 on a host without CUDA)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--cold", action="store_true",
                    help="evict the checkpoint from the page cache before every sample (default: warm)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per sample")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs vLLM (default: this one)")
    ap.add_argument("--json", default=None, help="write every sample here")
    a = ap.parse_args(argv)

    formats = [f.strip() for f in a.load_formats.split(",") if f.strip()]
    extra = json.loads(a.engine_config) if a.engine_config else None
    memory = a.memory
    if memory is None:
        import torch

        memory = None if torch.cuda.is_available() else 0.25
    directory = a.dir or tempfile.mkdtemp(prefix="bench_vllm-")
    os.makedirs(directory, exist_ok=True)
    try:
        nbytes = write_checkpoint(directory, a.gb, a.dtype)
        warm(directory)
        print(f"checkpoint: {directory}, {nbytes / 1e9:.3f} GB of {a.dtype} weights, "
              f"{len([n for n in os.listdir(directory) if n.endswith('.safetensors')])} shards; "
              f"page cache {'cold (evicted before each sample)' if a.cold else 'warm'}")
        samples: list[dict] = []
        for run in range(a.runs):
            for fmt in formats:
                if a.cold:
                    evict(directory)
                s = sample(a.python, directory, fmt, a.dtype, extra if fmt == "safetensors_engine" else None,
                           memory, a.timeout)
                s["run"] = run
                samples.append(s)
                print(f"  run {run + 1}/{a.runs} {fmt:20s} {s['seconds']:.2f} s (process {s['process_s']:.1f} s)",
                      flush=True)
        base = statistics.median(s["seconds"] for s in samples if s["format"] == formats[0])
        print(f"\n{'load format':22s} {'median s':>9s} {'min s':>7s} {'GB/s':>6s} {'vs ' + formats[0]:>16s}")
        for fmt in formats:
            xs = [s["seconds"] for s in samples if s["format"] == fmt]
            med = statistics.median(xs)
            rate = nbytes / med / 1e9 if med else float("inf")
            ratio = base / med if med else float("inf")
            print(f"{fmt:22s} {med:9.2f} {min(xs):7.2f} {rate:6.2f} {ratio:15.2f}x")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"bytes": nbytes, "dtype": a.dtype, "engine_config": extra, "samples": samples}, f, indent=1)
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
