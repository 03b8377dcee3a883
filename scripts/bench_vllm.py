"""vLLM's weight-loading time with its own loader and with the engine's load format.

vLLM started in a fresh process per sample and format, interleaved, on a generated Llama-shaped
sharded checkpoint (warm, or ``--cold``); the time it logs ("Loading weights took X seconds") is the
figure.  Run it with the Python of a venv with vLLM (``.ci/vllm_lane.sh install``) or name it with
``--python``; without vLLM the rows say so.

    python scripts/bench_vllm.py --gb 0.05 --runs 1      # a dry run (default 1.05 GB float32, 5 runs)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import harness
from benchmarks import common

TOOK = re.compile(r"Loading weights took ([0-9.]+) seconds")
DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
IMPLS = {"safetensors": "reference", "safetensors_engine": "engine", "runai_streamer": "runai"}

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


def write_checkpoint(directory: str, gb: float, dtype: str) -> int:
    """A Llama-shaped sharded checkpoint of about ``gb`` GB (TinyLlama's widths; a narrower model for
    a dry run under 0.2 GB) and its ``config.json``; returns its tensor bytes."""
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    hidden, inter, vocab, kv = (2048, 5632, 32000, 256) if gb >= 0.2 else (256, 704, 4000, 128)
    fixed = common.entries_bytes(common.model_entries(0, hidden, inter, vocab, kv)) // 2 * item
    per_layer = common.entries_bytes(common.model_entries(1, hidden, inter, vocab, kv)) // 2 * item - fixed
    layers = max(1, -(-int(gb * 1e9 - fixed) // per_layer)) if gb >= 0.2 else 2
    entries = common.model_entries(layers, hidden, inter, vocab, kv, dtype=DTYPES[dtype])
    path = harness.checkpoint(0, directory, values="weights", entries=entries)
    nbytes = common.entries_bytes(entries) // 2 * item
    shards = common.sharded_copy(path, -(-nbytes // 500_000_000))
    for f in os.listdir(shards):
        os.replace(os.path.join(shards, f), os.path.join(directory, f))
    os.rmdir(shards)
    os.remove(path)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": hidden // 64, "num_key_value_heads": kv // 64,
        "head_dim": 64, "num_hidden_layers": layers, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": dtype, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return nbytes


def sample(python: str, model: str, fmt: str, dtype: str, extra, memory, timeout: float = 600) -> float:
    """One vLLM start in a fresh process: the load time it logs."""
    args = {"model": model, "format": fmt, "dtype": dtype, "extra": extra, "memory": memory}
    proc = subprocess.run([python, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, timeout=timeout)
    found = TOOK.findall(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise SystemExit(f"load format {fmt!r}: exit {proc.returncode}, no load time logged:\n{tail}")
    return float(found[-1])


def main(argv=None) -> int:
    ap = harness.parser(__doc__, runs=5, dir=None)
    ap.add_argument("--gb", type=float, default=1.05, help="checkpoint size in GB")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--load-formats", default="safetensors,safetensors_engine",
                    help="comma-separated; the first is the baseline of the ratios")
    ap.add_argument("--engine-config", help="JSON for the engine's --model-loader-extra-config")
    ap.add_argument("--cold", action="store_true", help="evict the checkpoint before every sample")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs vLLM")
    a = ap.parse_args(argv)
    formats = [f.strip() for f in a.load_formats.split(",") if f.strip()]
    extra = json.loads(a.engine_config) if a.engine_config else None
    import torch

    memory = None if torch.cuda.is_available() else 0.25  # on the CPU backend: the share of RAM vLLM reserves
    directory = a.dir or tempfile.mkdtemp(prefix="bench_vllm-")
    os.makedirs(directory, exist_ok=True)
    report = harness.Report()
    try:
        nbytes = write_checkpoint(directory, a.gb, a.dtype)
        common.warm_cache(directory)
        why = harness.missing("vllm", a.python)
        case = f"vLLM load of a {nbytes / 1e9:.2f} GB {a.dtype} Llama, page cache {'cold' if a.cold else 'warm'}"

        def one(fmt):
            if a.cold:
                common.evict_cache(directory)
            t0 = time.perf_counter()
            s = sample(a.python, directory, fmt, a.dtype, extra if fmt == "safetensors_engine" else None, memory)
            return {"seconds": s, "process_s": time.perf_counter() - t0}

        got = {f: [] for f in formats} if why else harness.rounds(formats, a.runs, one)
        for fmt, samples in got.items():
            report.add(case, IMPLS.get(fmt, fmt), [s["seconds"] for s in samples], nbytes, format=fmt,
                       process_s=harness.median([s["process_s"] for s in samples] or [0]) or None, skipped=why)
        report.ratio("x_" + formats[0], report.rows[0]["median_s"])
        if why:
            report.note(f"skipped: {why}")
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return report.finish(a.json, "format", "impl", "median_s", "gbps", "x_" + formats[0], "process_s")


if __name__ == "__main__":
    sys.exit(main())
