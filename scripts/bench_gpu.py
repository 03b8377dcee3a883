"""File to GPU: every engine entry point against the reference and the peer loaders, in one run.

Generates a checkpoint of Llama-3-8B shapes (BF16, 291 tensors, 16.06 GB in 4 shards plus
``model.safetensors.index.json``; ``--size`` scales the layer count) and prints, for each
implementation, the median of ``--runs`` samples, warm and cold page cache, every sample in
a fresh process: the CUDA context is up before the clock starts, the clock stops after
``torch.cuda.synchronize()`` with every tensor on the GPU, and a checksum of every tensor
(computed after the clock) is printed so that all rows can be seen to have loaded the same
bytes.  Limits are measured the same way: pinned and pageable host-to-device copies of
1 GiB, and page cache to pinned memory with the engine's split read on 1 / 8 / 16 threads.

Each sample also reports its process's resident memory before the clock and its peak
during the load (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the clock:
``ru_maxrss`` would carry the parent's size through fork and exec), and on a GPU the peak
of torch's allocator (``torch.cuda.max_memory_allocated``) and the device memory in use
after the load (``mem_get_info``, which also sees the peers' own allocators).  The host
memory by kind (scripts/host_memory.py: anonymous, file-backed mapped and ``mlock``-ed
pages from ``/proc/self/status``, and the engine's own count of what its rings page-locked)
is sampled on a thread every 10 ms while the load runs: each kind's peak growth over its
level before the clock, and the mapped file pages still there after the load.  The
``stats=True`` and ``quantize="int8"`` rows count the file's tensor bytes.  The per-key
rows are the loop of accelerate's ``load_state_dict``: ``safe_open(f, device=...)`` and
``get_tensor(k)`` for every key of every shard, through the engine and the reference.
scripts/gpu_check.py runs a selection of these rows in one command with the other GPU
checks.

Cold samples drop the page cache before each run (``/proc/sys/vm/drop_caches`` as root,
else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every shard); warm samples read the shards
once before the first run.

Peers (``fastsafetensors``, ``instanttensor``, ``runai_model_streamer``) are optional; a row
whose package is missing says so.  On the lent GPU machine (Python 3.12, no package index)
install the wheels of ``../shared/wheels`` (carried in an ignored folder of the checkout) and
build the extensions there first::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    python3 setup.py -q build_ext --inplace
    PYTHONPATH=/tmp/site python3 scripts/bench_gpu.py --runs 3 --modes warm
    PYTHONPATH=/tmp/site python3 scripts/bench_gpu.py --runs 3 --modes cold

The script and its children import the engine of the checkout it sits in (put first on
``sys.path`` by scripts/checkout_path.py), installed or not.

Other options: ``--size 4GB`` (smaller checkpoint), ``--only engine,reference`` (rows whose
name contains one of the words), ``--dir`` (where the checkpoint lives, reused between
runs), ``--json out.json`` (append the results).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # imported from elsewhere (a test): its sibling modules
    sys.path.insert(0, HERE)
import checkout_path  # noqa: E402

# this checkout's engine, here and in every child (they run this file): on a GPU host it is
# built in place and not installed
ROOT = checkout_path.use_checkout()
# the asv suites' shared helpers (page-cache eviction)
sys.path.insert(1, os.path.join(ROOT, "asv_benchmarks"))
import host_memory  # noqa: E402
from benchmarks.common import evict_cache, hwm_bytes, per_key_load, reset_hwm, rss_bytes  # noqa: E402

GiB = 1 << 30
#: passes over the checkpoint inside one page cache -> pinned limit sample (the median is its figure)
LIMIT_PASSES = 3

# Llama-3-8B
HIDDEN, INTER, VOCAB, KV = 4096, 14336, 128256, 1024
LAYER_SHAPES = [
    ("input_layernorm.weight", (HIDDEN,)),
    ("mlp.down_proj.weight", (HIDDEN, INTER)),
    ("mlp.gate_proj.weight", (INTER, HIDDEN)),
    ("mlp.up_proj.weight", (INTER, HIDDEN)),
    ("post_attention_layernorm.weight", (HIDDEN,)),
    ("self_attn.k_proj.weight", (KV, HIDDEN)),
    ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
    ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
    ("self_attn.v_proj.weight", (KV, HIDDEN)),
]


def _nbytes(shape) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def _layer_shapes(hidden: int, inter: int, kv: int) -> list[tuple[str, tuple]]:
    scale = {HIDDEN: hidden, INTER: inter, KV: kv}
    return [(n, tuple(scale[d] for d in s)) for n, s in LAYER_SHAPES]


def model_shapes(total_bytes: int) -> list[tuple[str, tuple]]:
    """Tensor names and shapes of a Llama-3-8B-like model of about ``total_bytes`` (BF16).

    From about 2.5 GB up: Llama-3-8B's tensors, as many layers as fit.  Below (smoke runs):
    the same names and proportions, every dimension scaled down, so that 64 MB still holds
    several layers."""
    hidden, inter, kv, vocab = HIDDEN, INTER, KV, VOCAB
    per_layer = sum(_nbytes(s) for _, s in LAYER_SHAPES)
    if total_bytes < 2 * _nbytes((VOCAB, HIDDEN)) + per_layer:
        # bytes per hidden**2 of 4 layers and the two vocabulary tables (vocab = 8 * hidden)
        unit = 4 * per_layer / HIDDEN**2 + 2 * 2 * 8
        hidden = max(64, int((total_bytes / unit) ** 0.5) // 64 * 64)
        inter, kv, vocab = hidden * INTER // HIDDEN // 64 * 64, max(64, hidden // 4), 8 * hidden
    layer = _layer_shapes(hidden, inter, kv)
    per_layer = sum(_nbytes(s) for _, s in layer)
    layers = max(1, round((total_bytes - 2 * _nbytes((vocab, hidden))) / per_layer))
    out: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        out += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def make_checkpoint(folder: str, total_bytes: int, shards: int = 4) -> list[str]:
    """Write the checkpoint (once; reused when its index exists) and return the shard paths.

    Each shard through the engine's streaming writer without ``fsync`` (scratch data: the
    sync would only lengthen the GPU check's budget), one tensor at a time."""
    import ml_dtypes
    import numpy as np

    from engine.writing.writer import open_writer

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    os.makedirs(folder, exist_ok=True)
    shapes = model_shapes(total_bytes)
    total = sum(_nbytes(s) for _, s in shapes)
    # a pool of random finite BF16 bit patterns; each tensor starts at a different place in it
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 1 << 14, min(96 << 20, total // 2 + 1), dtype=np.uint16)
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in shapes:
        if size >= total / shards * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append((name, shape))
        size += _nbytes(shape)
    weight_map, files = {}, []
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        with open_writer(os.path.join(folder, fname), [(n, "BF16", s) for n, s in group], fsync=False) as w:
            for j, (name, shape) in enumerate(group):
                n = _nbytes(shape) // 2
                start = (j * 7919 + k * 104729) % pool.size
                w.write(name, np.resize(pool[start:], n).view(ml_dtypes.bfloat16).reshape(shape))
                weight_map[name] = fname
        files.append(os.path.join(folder, fname))
    with open(index_path + ".tmp", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    os.replace(index_path + ".tmp", index_path)
    return files


def tensor_bytes(files: list[str]) -> int:
    import engine

    total = 0
    for p in files:
        t = engine.read_header(p).table
        total += int(sum(int(e) - int(b) for b, e in zip(t.begins, t.ends, strict=True)))
    return total


def warm(files: list[str]) -> None:
    buf = bytearray(64 << 20)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_cache(files: list[str]) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            evict_cache(p)
        return "fadvise"


# -- implementations (each runs in a fresh child process) ---------------------------------------------


def _engine_per_file(files, dev, **kw):
    import engine.torch

    out = {}
    for f in files:
        out.update(engine.torch.load_file(f, device=dev, **kw))
    return out


def _engine_stream(files, dev, **kw):
    import engine

    return dict(engine.stream(files, framework="pt", device=dev, **kw))


def _engine_stream_per_file(files, dev, **kw):
    import engine

    out = {}
    for f in files:
        out.update(engine.stream(f, framework="pt", device=dev, **kw))
    return out


def _engine_safe_open(target):
    def load(files, dev):
        import engine

        where = os.path.dirname(files[0]) if target == "directory" else os.path.join(
            os.path.dirname(files[0]), "model.safetensors.index.json")
        with engine.safe_open(where, framework="pt", device=dev) as f:
            return f.get_tensors()

    return load


def _engine_load_file_directory(files, dev):
    import engine.torch

    return engine.torch.load_file(os.path.dirname(files[0]), device=dev)


def _engine_load_into_prepare(files, dev):
    import torch

    import engine

    dst = {}
    for f in files:
        for name, info in engine.read_header(f).items():
            dst[name] = torch.empty(info.shape, dtype=torch.bfloat16, device=dev)
    return dst


def _engine_load_into(files, dev, prepared):
    import engine

    for f in files:
        engine.load_into(f, {k: prepared[k] for k in engine.read_header(f).keys()})
    return prepared


def _engine_load_into_directory(files, dev, prepared):
    import engine

    engine.load_into(os.path.dirname(files[0]), prepared, strict=True)  # every shard, one load
    return prepared


def _engine_load_into_directory_path(gpu_path):
    def load(files, dev, prepared):
        import engine

        engine.load_into(os.path.dirname(files[0]), prepared, strict=True, gpu_path=gpu_path)
        return prepared

    return load


def _engine_prepare_device_prepare(files, dev):
    """The destinations, then ``engine.prepare_device(dev)`` (timed, outside the load's clock):
    an inference server that warms the ring at start, before its first load."""
    import engine

    prepared = _engine_load_into_prepare(files, dev)
    _sync(dev)
    t0 = time.perf_counter()
    locked = engine.prepare_device(dev)
    _sync(dev)
    PREPARED["fields"] = {"prepare_s": time.perf_counter() - t0, "prepare_lock_s": locked}
    return prepared


def _engine_reload_prepare(files, dev):
    """A server reloading its weights: the ring and file mappings kept between loads
    (``engine.keep_staging``, ``engine.keep_mappings``), one untimed load first; the clock
    times the next."""
    import engine

    engine.keep_staging(True)
    engine.keep_mappings(True)
    prepared = _engine_load_into_prepare(files, dev)
    _engine_load_into_directory(files, dev, prepared)
    return prepared


def _engine_stream_stats(files, dev):
    """stream(stats=True), one shard at a time (statistics take one file per call)."""
    import engine

    out = {}
    for f in files:
        for name, t, st in engine.stream(f, framework="pt", device=dev, stats=True):
            out[name] = t
            out[name + " stats"] = st
    return out


def _engine_stream_int8(files, dev):
    """stream(quantize="int8"), one shard at a time; a quantized tensor counts as its
    int8 values and its scales."""
    import engine

    out = {}
    for f in files:
        out.update(engine.stream(f, framework="pt", device=dev, quantize="int8"))
    return out


def _engine_stream_both(files, dev):
    """stream(stats=True, quantize="int8"), one shard at a time."""
    import engine

    out = {}
    for f in files:
        for name, t, st in engine.stream(f, framework="pt", device=dev, stats=True, quantize="int8"):
            out[name] = t
            out[name + " stats"] = st
    return out


def validator_config(files: list[str]) -> dict:
    """A LLaMA ``config.json`` for the checkpoint of :func:`make_checkpoint`, read from its
    headers (heads of 64: the shapes' own proportions)."""
    import engine

    shapes = {}
    for f in files:
        t = engine.read_header(f).table
        shapes.update({n: tuple(int(d) for d in t.shapes[i]) for i, n in enumerate(t.names)})
    vocab, hidden = shapes["model.embed_tokens.weight"]
    layers = sum(1 for n in shapes if n.endswith(".mlp.up_proj.weight"))
    return {"hidden_size": hidden, "intermediate_size": shapes["model.layers.0.mlp.up_proj.weight"][0],
            "num_hidden_layers": layers, "num_attention_heads": hidden // 64, "head_dim": 64,
            "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // 64, "vocab_size": vocab}


def _engine_validator(files, dev):
    """``WeightValidator(config).validate(directory)`` with statistics: the checkpoint's
    tensors summarised on the CPU (the validator reads mappings; it has no device path)."""
    import engine

    report = engine.WeightValidator(validator_config(files)).validate(os.path.dirname(files[0]))
    return {t.name + " stats": t for t in report.tensors}


def _reference(files, dev):
    from safetensors.torch import load_file

    out = {}
    for f in files:
        out.update(load_file(f, device=dev))
    return out


def _engine_per_key(files, dev):
    """The loop of accelerate's ``load_state_dict``: ``safe_open(f, device=...)``, then
    ``get_tensor(k)`` for every key, shard after shard (the asv suite's loop)."""
    import engine

    return per_key_load(engine.safe_open, files, dev)


def _reference_per_key(files, dev):
    """:func:`_engine_per_key` with the reference's ``safe_open``."""
    from safetensors import safe_open

    return per_key_load(safe_open, files, dev)


def _reference_then_to(files, dev):
    from safetensors.torch import load_file

    out = {}
    for f in files:
        out.update({k: v.to(dev) for k, v in load_file(f).items()})
    return out


def _fastsafetensors(files, dev):
    from fastsafetensors import SafeTensorsFileLoader

    names = _names(files)  # header reads, outside fastsafetensors' own work
    loader = SafeTensorsFileLoader(None, dev, nogds=True)
    loader.add_filenames({0: files})
    fb = loader.copy_files_to_device()
    # fb and loader stay open: their device buffers back the tensors until the process ends
    return {k: fb.get_tensor(k) for k in names}


def _names(files):
    import engine

    return [n for f in files for n in engine.read_header(f).keys()]


def _instanttensor(policy):
    def load(files, dev):
        import instanttensor

        kw = {}
        if policy == "BUFFERED":
            kw["backend"] = instanttensor.BackendPolicy.BUFFERED
        elif policy == "MMAP":
            kw["backend"] = instanttensor.Backend.MMAP
        out = {}
        with instanttensor.safe_open(files, framework="pt", device=int(dev.split(":")[1]), **kw) as f:
            got = f.tensors()
            for name, t in (got.items() if hasattr(got, "items") else got):
                out[name] = t
        return out

    return load


def _runai(files, dev):
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as s:
        s.stream_files(files, device=dev)
        for name, t in s.get_tensors():
            out[name] = t if t.is_cuda else t.to(dev)
    return out


def _limit_h2d(pinned: bool):
    def run(files, dev):
        import torch

        src = torch.empty(GiB, dtype=torch.uint8, pin_memory=pinned)
        src.fill_(1)
        dst = torch.empty(GiB, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=pinned)  # first copy outside the clock
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return GiB, statistics.median(times)

    return run


def _limit_page_cache_to_pinned(threads: int):
    def run(files, dev):
        import numpy as np
        import torch

        from engine.io import _split

        slot = 512 << 20
        buf = torch.empty(slot, dtype=torch.uint8, pin_memory=True)
        out = buf.numpy()
        out.fill(0)
        fds = [os.open(f, os.O_RDONLY) for f in files]
        reader = _split.SplitReader(threads)  # the engine's copy path, without the DMA
        times = []
        # the median of three passes over every shard: one fresh process per row is enough
        for _ in range(LIMIT_PASSES):
            total = 0
            t0 = time.perf_counter()
            for fd in fds:
                size = os.fstat(fd).st_size
                for off in range(0, size, slot):
                    n = min(slot, size - off)
                    err, _, _ = reader.copy(fd, None, np.array([off], np.int64), [memoryview(out)[:n]])
                    assert err == 0
                    total += n
            times.append(time.perf_counter() - t0)
        reader.close()
        for fd in fds:
            os.close(fd)
        return total, statistics.median(times)

    return run


IMPLEMENTATIONS = {
    "engine load_file(f) per shard": _engine_per_file,
    "engine load_file(directory)": _engine_load_file_directory,
    "engine safe_open(directory).get_tensors()": _engine_safe_open("directory"),
    "engine safe_open(index).get_tensors()": _engine_safe_open("index"),
    "engine stream(shards) auto": lambda files, dev: _engine_stream(files, dev),
    "engine stream(shards) gpu_path=copy": lambda files, dev: _engine_stream(files, dev, gpu_path="copy"),
    "engine stream(shards) slot_bytes=128MiB": lambda files, dev: _engine_stream(
        files, dev, slot_bytes=128 << 20),
    "engine stream(shards) slot_bytes=256MiB": lambda files, dev: _engine_stream(
        files, dev, slot_bytes=256 << 20),
    "engine stream(f) per shard": lambda files, dev: _engine_stream_per_file(files, dev),
    "engine load_into(f) per shard": (_engine_load_into_prepare, _engine_load_into),
    "engine load_into(directory)": (_engine_load_into_prepare, _engine_load_into_directory),
    "engine load_into(directory) gpu_path=copy": (_engine_load_into_prepare, _engine_load_into_directory_path("copy")),
    "engine load_into(directory) first load after engine.prepare_device": (
        _engine_prepare_device_prepare, _engine_load_into_directory),
    "engine load_into(directory) reload, staging and mappings kept": (
        _engine_reload_prepare, _engine_load_into_directory),
    "engine stream(f) stats=True per shard": _engine_stream_stats,
    "engine stream(f) quantize=int8 per shard": _engine_stream_int8,
    "engine stream(f) stats=True quantize=int8 per shard": _engine_stream_both,
    "engine WeightValidator(config).validate(directory)": _engine_validator,
    "engine safe_open(f, device) get_tensor per key": _engine_per_key,
    "reference load_file(f, device) per shard": _reference,
    "reference safe_open(f, device) get_tensor per key": _reference_per_key,
    "reference load_file(f) then .to(device)": _reference_then_to,
    "fastsafetensors (nogds, buffered)": _fastsafetensors,
    "InstantTensor default": _instanttensor(None),
    "InstantTensor BackendPolicy.BUFFERED": _instanttensor("BUFFERED"),
    "InstantTensor Backend.MMAP": _instanttensor("MMAP"),
    "Run:ai streamer": _runai,
    "Run:ai streamer (io_uring_buffered)": _runai,
}
ENV = {
    "fastsafetensors (nogds, buffered)": {"FASTSAFETENSORS_ODIRECT": "0"},
    "Run:ai streamer (io_uring_buffered)": {"RUNAI_STREAMER_FS_STRATEGY": "io_uring_buffered"},
}
LIMITS = {
    "limit: pinned host-to-device 1 GiB": _limit_h2d(True),
    "limit: pageable host-to-device 1 GiB": _limit_h2d(False),
    "limit: page cache to pinned, split read, 1 thread": _limit_page_cache_to_pinned(1),
    "limit: page cache to pinned, split read, 8 threads": _limit_page_cache_to_pinned(8),
    "limit: page cache to pinned, split read, 16 threads": _limit_page_cache_to_pinned(16),
}


#: the package a row needs beyond torch and the engine (a row whose package is missing is skipped)
REQUIRES = {
    "fastsafetensors (nogds, buffered)": "fastsafetensors",
    "InstantTensor default": "instanttensor",
    "InstantTensor BackendPolicy.BUFFERED": "instanttensor",
    "InstantTensor Backend.MMAP": "instanttensor",
    "Run:ai streamer": "runai_model_streamer",
    "Run:ai streamer (io_uring_buffered)": "runai_model_streamer",
    "engine stream(f) stats=True per shard": "numba",
    "engine stream(f) quantize=int8 per shard": "numba",
    "engine stream(f) stats=True quantize=int8 per shard": "numba",
    "engine WeightValidator(config).validate(directory)": "numba",
}
#: rows that need an engine API that an older checkout lacks (the row is skipped there, saying so)
NEEDS_API = {"engine load_into(directory) first load after engine.prepare_device": "prepare_device"}
#: rows that mean nothing without a CUDA device (pinned memory, a device ordinal, GPU-only peers)
NEEDS_CUDA = {
    *(n for n in REQUIRES if REQUIRES[n] not in ("numba",)),
    *(n for n in LIMITS if "pinned" in n or "host-to-device" in n),
    "engine load_into(directory) first load after engine.prepare_device",
}


def skip_reason(impl: str, dev: str, path: list[str] | None = None) -> str | None:
    """Why ``impl`` cannot run on ``dev`` here (its package is missing, or it needs CUDA), or None.

    ``path``: extra folders to look for packages in (the children's PYTHONPATH)."""
    import importlib.util

    module = REQUIRES.get(impl)
    if module is not None:
        saved = sys.path[:]
        sys.path[:0] = path or []
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path[:] = saved
        if not found:
            return f"{module} not installed"
    if impl in NEEDS_CUDA and not dev.startswith("cuda"):
        return f"no CUDA device (--device {dev})"
    api = NEEDS_API.get(impl)
    if api is not None:
        try:
            import engine
        except Exception as exc:  # the build failed: the row's sample would say the same
            return f"the engine cannot be imported: {type(exc).__name__}: {exc}"
        if not hasattr(engine, api):
            return f"engine.{api} is not in this checkout's engine"
    return None


def checksum(tensors: dict) -> str:
    """Over every tensor in name order, each byte weighted by its position in its tensor (so
    a swapped tensor or shifted bytes change it); computed on the GPU in 64 Mi-word chunks."""
    import torch

    mod = (1 << 61) - 1
    acc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous().view(-1).view(torch.uint8)
        n = t.numel() // 4 * 4
        words = t[:n].view(torch.int32)
        s = int(t[n:].to(torch.int64).sum().item())
        step = 64 << 20
        for lo in range(0, words.numel(), step):
            w = words[lo : lo + step].to(torch.int64)
            weights = torch.arange(lo + 1, lo + 1 + w.numel(), device=t.device, dtype=torch.int64) % 65521
            s += int((w * weights).sum().item())
        acc = (acc * 1000003 + s % mod) % mod
    return f"{acc:016x}"


def _sync(dev: str) -> None:
    import torch

    if dev != "cpu":
        torch.cuda.synchronize()


def _flatten(out: dict) -> tuple[dict, int]:
    """Tensors only (a quantized tensor as its values and scales; statistics dropped), and how
    many statistics came back."""
    tensors, stats = {}, 0
    for name, v in out.items():
        if name.endswith(" stats"):
            stats += v is not None
        elif hasattr(v, "q") and hasattr(v, "scale"):
            tensors[name + ".q"], tensors[name + ".scale"] = v.q, v.scale
        else:
            tensors[name] = v
    return tensors, stats


def _host_mark() -> tuple[int, bool]:
    """Resident memory now, bytes, after resetting the process's high-water mark to it, and
    whether the reset happened (else the peak that follows counts from the process's start).

    The mark is the kernel's ``VmHWM`` of this process's own address space (not ``ru_maxrss``,
    which survives ``fork`` and ``exec`` and so starts at the parent's size)."""
    reset = reset_hwm()
    return rss_bytes(), reset


def ring_records():
    """``(context manager, list)``: the engine's per-load records of the chunk ring
    (``engine.load_records()``, each an ``engine.LoadRecord``) collected inside the block, or
    a no-op and None where this engine has no such API."""
    import contextlib

    try:
        import engine
    except Exception:  # a peer's row in a process without the engine
        return contextlib.nullcontext(None), None
    collect = getattr(engine, "load_records", None)
    if collect is None:
        return contextlib.nullcontext(None), None
    return collect(), True


def record_dicts(records) -> list[dict]:
    """Plain fields of the engine's load records (``LoadRecord.as_dict()``)."""
    out = []
    for r in records or []:
        as_dict = getattr(r, "as_dict", None)
        out.append(dict(as_dict()) if as_dict else {k: v for k, v in vars(r).items() if not k.startswith("_")})
    return out


#: the records' fields summed over a sample's loads (a per-shard row makes one load per shard)
RECORD_SUMS = ("chunks", "bytes", "seconds", "fill_wait_s", "slot_wait_s", "fill_s", "lock_s", "lock_calls",
               "pread_bytes", "mmap_bytes", "network_bytes", "reported", "report_s")
#: the fields that describe the ring rather than count its work (the first load's)
RECORD_SHAPE = ("chunk_bytes", "slots", "threads")


def sum_records(records: list[dict] | None) -> dict | None:
    """One sample's ring records as one: ``loads`` and ``cold`` (how many set the ring up),
    :data:`RECORD_SUMS` summed, :data:`RECORD_SHAPE` of the first, ``source`` and ``unmap``
    (every value seen, ``/``-joined); None when the engine kept no records."""
    if records is None:
        return None
    out: dict = {"loads": len(records), "cold": sum(bool(r.get("cold")) for r in records),
                 "pageable": sum(bool(r.get("pageable")) for r in records),
                 "hooked": sum(bool(r.get("hooked")) for r in records)}
    for key in RECORD_SUMS:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        out[key] = sum(values) if values else None
    for key in RECORD_SHAPE:
        out[key] = records[0].get(key) if records else None
    for key in ("source", "unmap"):
        seen = sorted({str(r[key]) for r in records if r.get(key) is not None})
        out[key] = "/".join(seen) or None
    return out


def median_records(summaries: list[dict | None]) -> dict | None:
    """The samples' summed records (:func:`sum_records`) as one: the median of each number,
    the last sample's text."""
    got = [s for s in summaries if s]
    if not got:
        return None
    out: dict = {}
    for key in got[-1]:
        values = [s[key] for s in got if isinstance(s.get(key), (int, float)) and not isinstance(s.get(key), bool)]
        out[key] = statistics.median(values) if values else got[-1][key]
    return out


def _timed_load(fn, files, dev, prepared, engine_row: bool) -> tuple[object, float, dict | None]:
    """One load on the clock (to the device's synchronisation): its output, seconds and, for
    the engine's rows, the ring's records summed (None where the engine keeps none)."""
    import contextlib

    cm, on = ring_records() if engine_row else (contextlib.nullcontext(None), None)
    with cm as got:
        t0 = time.perf_counter()
        out = fn(files, dev) if prepared is None else fn(files, dev, prepared)
        _sync(dev)
        seconds = time.perf_counter() - t0
    return out, seconds, sum_records(record_dicts(got)) if on else None


def child(impl: str, files: list[str], dev: str) -> dict:
    import torch

    cuda = dev != "cpu"
    if cuda:  # (--device cpu: a smoke test of the script on a machine without a GPU)
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context is up before the clock
    _sync(dev)
    if impl in LIMITS:
        nbytes, seconds = LIMITS[impl](files, dev)
        return {"seconds": seconds, "bytes": nbytes, "checksum": "", "host_peak_bytes": hwm_bytes(),
                "engine_file": checkout_path.engine_origin()}
    fn = IMPLEMENTATIONS[impl]
    prepared = None
    record: dict = {}
    if isinstance(fn, tuple):  # load_into: the destinations exist before the clock
        prepare, fn = fn
        prepared = prepare(files, dev)
        _sync(dev)
        record.update(PREPARED.pop("fields", {}))
    engine_row = impl.startswith("engine")
    host_before, reset = _host_mark()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        free_before = torch.cuda.mem_get_info()[0]
    # memory by kind, sampled on a thread from before the clock until the load has synchronized
    with host_memory.Sampler() as kinds:
        out, seconds, records = _timed_load(fn, files, dev, prepared, engine_row)
    # memory before the checksum, which allocates its own
    record.update({"seconds": seconds, "host_before_bytes": host_before, "host_peak_bytes": hwm_bytes(),
                   "host_peak_from": "clock" if reset else "process start", **kinds.result(),
                   "file_after_bytes": kinds.file_now(), "records": records})
    if cuda:
        # torch's allocator only; peers with their own allocator show in device_used_bytes
        record["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        record["device_used_bytes"] = free_before - torch.cuda.mem_get_info()[0]
    tensors, stats = _flatten(out)
    if impl in SOURCE_BYTES:  # a rate of the file's bytes, not of what the load produced
        record["bytes"] = tensor_bytes(files)
    else:
        record["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    record.update(checksum=checksum(tensors), tensors=len(tensors),
                  all_on_gpu=all(t.device.type == "cuda" for t in tensors.values()),
                  engine_file=checkout_path.engine_origin())
    if impl in SOURCE_BYTES:
        record["stats"] = stats
    if impl in HOOKED:  # off the clock: the results against the CPU kernels'
        record["cpu_kernels"] = against_cpu_kernels(out, files)
    if impl in TWICE:  # the same load again in this process: what a warm ring gives
        if prepared is not None:
            for t in tensors.values():
                t.zero_()
            _sync(dev)
        else:
            del out, tensors
        again, seconds2, records2 = _timed_load(fn, files, dev, prepared, engine_row)
        tensors2, _ = _flatten(again)
        record["second"] = {"seconds": seconds2, "records": records2, "checksum": checksum(tensors2),
                            "bytes": sum(t.numel() * t.element_size() for t in tensors2.values())}
    return record


#: rows whose child times a second load in the same process (``record["second"]``), the
#: first being the row's own figure: a process's first load against a warm ring's
TWICE = {"engine load_into(directory)"}
#: what a ``prepare`` step leaves for the child's record (the seconds of ``engine.prepare_device``)
PREPARED: dict = {}


#: rows whose rate counts the file's tensor bytes (what they produce differs from what they read)
SOURCE_BYTES = {"engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard",
                "engine stream(f) stats=True quantize=int8 per shard",
                "engine WeightValidator(config).validate(directory)"}
#: loads with device kernels: their results are checked against the CPU kernels'
HOOKED = {"engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard",
          "engine stream(f) stats=True quantize=int8 per shard"}
#: tensors checked per hooked sample (spread over the checkpoint; each costs a CPU pass)
CPU_CHECKS = 6


def against_cpu_kernels(out: dict, files: list[str]) -> dict:
    """A few tensors' statistics and int8 values and scales from a hooked load, against
    ``engine.stats`` and ``engine.quantize_int8`` of the same tensors read on the CPU:
    ``{"checked": n, "mismatched": {name: what}}`` (counts, min, max and absmax exactly;
    mean and std to a relative 1e-6; int8 values and scale bits exactly)."""
    import math

    import numpy as np

    import engine

    names = sorted(n for n in out if not n.endswith(" stats"))
    picked = names[:: max(1, len(names) // CPU_CHECKS)][:CPU_CHECKS]
    mismatched: dict = {}
    where = {}
    for f in files:
        for n in engine.read_header(f).table.names:
            where[n] = f
    for name in picked:
        with engine.safe_open(where[name], framework="np") as h:
            x = h.get_tensor(name)
        st = out.get(name + " stats")
        if st is not None:
            cpu = engine.stats(x)
            exact = ("count", "nan_count", "posinf_count", "neginf_count", "zero_count", "min", "max", "absmax")
            bad = [k for k in exact if float(getattr(st, k)) != float(getattr(cpu, k))]
            bad += [k for k in ("mean", "std") if not math.isclose(getattr(st, k), getattr(cpu, k), rel_tol=1e-6)]
            if bad:
                mismatched[name + " stats"] = bad
        v = out[name]
        if hasattr(v, "q"):
            q, scale = engine.quantize_int8(x, v.axis, on_nonfinite="clamp")
            got_q = v.q.cpu().numpy() if hasattr(v.q, "cpu") else np.asarray(v.q)
            got_s = v.scale.cpu().numpy() if hasattr(v.scale, "cpu") else np.asarray(v.scale)
            if not (np.array_equal(got_q, q) and np.array_equal(np.asarray(got_s, np.float32).view(np.uint32),
                                                                np.asarray(scale, np.float32).view(np.uint32))):
                mismatched[name + " int8"] = "values or scales differ"
    return {"checked": len(picked), "mismatched": mismatched}


def sample(impl: str, files: list[str], dev: str, timeout: float, env: dict | None = None) -> dict:
    """One fresh-process sample of ``impl``: its record, or ``{"error": why}`` (the exception's
    last line, the exit code, or the timeout)."""
    env = dict(os.environ, **(env or {}), **ENV.get(impl, {}))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--device", dev, "--files", *files]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit code {proc.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1])


def run_row(impl: str, files: list[str], dev: str, mode: str, runs: int, timeout: float,
            env: dict | None = None, path: list[str] | None = None, deadline: float | None = None) -> dict:
    """``runs`` samples of one row in one mode (``"warm"``: the caller warmed the files;
    ``"cold"``: the page cache is dropped before each), summarised.

    Returns ``{"status": "ok" | "failed" | "skipped", "reason", "seconds", "gbps",
    "host_peak_bytes", "device_peak_bytes", ..., "samples"}``: medians of the rates and
    times, maxima of the memory.  A failing sample ends the row; ``deadline``
    (``time.monotonic()``) caps each sample's timeout and stops starting new ones."""
    why = skip_reason(impl, dev, path)
    if why:
        return {"status": "skipped", "reason": why, "samples": []}
    samples: list[dict] = []
    how = ""
    for _ in range(runs):
        left = timeout if deadline is None else min(timeout, deadline - time.monotonic())
        if left < 1:
            if samples:
                break
            return {"status": "skipped", "reason": "its phase's time budget was spent", "samples": []}
        if mode == "cold":
            how = drop_cache(files)
        samples.append(sample(impl, files, dev, left, env))
        if "error" in samples[-1]:
            break
    return summarise(samples, how or mode)


#: a sample's host memory by kind (scripts/host_memory.py); a row keeps the largest of its samples
MEMORY_KINDS = ("anon_growth_bytes", "file_growth_bytes", "vmlck_growth_bytes", "locked_growth_bytes",
                "anon_locked_growth_bytes", "locked_peak_bytes", "file_after_bytes")


def summarise(samples: list[dict], cache: str) -> dict:
    """A row's result from its samples (see :func:`run_row`); failed if any sample failed."""
    bad = [s["error"] for s in samples if "error" in s]
    if bad or not samples:
        return {"status": "failed", "reason": bad[0] if bad else "no sample ran", "samples": samples}
    out: dict = {"status": "ok", "reason": None, "samples": samples, "cache": cache,
                 "seconds": statistics.median(s["seconds"] for s in samples),
                 "gbps": statistics.median(s["bytes"] / s["seconds"] / 1e9 for s in samples),
                 "bytes": samples[0]["bytes"],
                 "checksums": sorted({s["checksum"] for s in samples if s.get("checksum")})}
    for key in ("host_before_bytes", "host_peak_bytes", "device_peak_bytes", "device_used_bytes", *MEMORY_KINDS):
        values = [s[key] for s in samples if key in s]
        if values:
            out[key] = max(values)
    for key in ("tensors", "all_on_gpu", "stats", "host_peak_from", "engine_file", "memory_samples", "cpu_kernels"):
        if key in samples[-1]:
            out[key] = samples[-1][key]
    prepare = [s["prepare_s"] for s in samples if isinstance(s.get("prepare_s"), (int, float))]
    if prepare:
        out["prepare_s"] = statistics.median(prepare)
    if any("records" in s for s in samples):
        out["records"] = median_records([s.get("records") for s in samples])
    return out


def second_loads(samples: list[dict]) -> list[dict]:
    """The second loads of a :data:`TWICE` row's samples as samples of their own (seconds,
    bytes, checksum, records), for a row of their own."""
    return [{**s["second"], "second_of": i} for i, s in enumerate(samples) if isinstance(s.get("second"), dict)]


def parse_size(text: str) -> int:
    """``16.06GB``, ``64MB``, ``4G`` or a number of bytes (decimal units)."""
    size_text = text.upper().replace("B", "")
    scale = {"G": 10**9, "M": 10**6, "K": 10**3}
    if size_text[-1] in scale:
        return int(float(size_text[:-1]) * scale[size_text[-1]])
    return int(float(size_text))


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16.06GB", help="checkpoint size, e.g. 16.06GB or 4GB")
    ap.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "engine-bench-gpu"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--only", default="", help="comma-separated words; rows whose name contains one")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per sample")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--files", nargs="*", help=argparse.SUPPRESS)
    # print which engine a child of this script imports (scripts/gpu_check.py checks it is the checkout's)
    ap.add_argument("--where", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.where:
        where = {"engine_file": checkout_path.engine_origin(), "ring_file": checkout_path.engine_origin("engine.gpu._ring")}
        try:  # what the children will see: torch, and the device the GPU rows load to
            import torch

            cuda = torch.cuda.is_available()
            where.update(torch=torch.__version__, cuda=cuda,
                         name=torch.cuda.get_device_name(0) if cuda else "no CUDA device")
        except Exception as exc:
            where.update(torch=f"unavailable ({type(exc).__name__}: {exc})", cuda=False, name="no CUDA device")
        print(json.dumps(where))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.files, args.device)))
        return 0

    size = parse_size(args.size)
    folder = os.path.join(args.dir, f"llama3-shapes-{size}")
    t0 = time.perf_counter()
    files = make_checkpoint(folder, size)
    nbytes = tensor_bytes(files)
    print(f"checkpoint: {folder}: {len(files)} shards, {nbytes / 1e9:.2f} GB of tensors"
          f" (ready in {time.perf_counter() - t0:.0f} s)", flush=True)
    import torch

    print(f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'};"
          f" torch {torch.__version__}; python {sys.version.split()[0]}; cores {os.cpu_count()};"
          f" date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    rows = [n for n in [*IMPLEMENTATIONS, *LIMITS] if not words or any(w.lower() in n.lower() for w in words)]
    modes = [m for m in args.modes.split(",") if m in ("warm", "cold")]
    results: dict = {}
    print("| row | cache | s | GB/s | peak host GiB (before) | peak device GiB | checksum |")
    for mode in modes:
        if mode == "warm":
            warm(files)
        for impl in rows:
            if mode == "cold" and impl.startswith("limit: p") and "host-to-device" in impl:
                continue  # no file involved
            r = run_row(impl, files, args.device, mode, args.runs, args.timeout)
            results.setdefault(impl, {})[mode] = r["samples"] or [{"error": r["reason"]}]
            if r["status"] == "ok":
                print(f"| {impl} | {r['cache']} | {r['seconds']:.3f} | {r['gbps']:.1f} |"
                      f" {_gib(r.get('host_peak_bytes'))} ({_gib(r.get('host_before_bytes'))}) |"
                      f" {_gib(r.get('device_peak_bytes'))} | {','.join(r['checksums']) or '-'} |", flush=True)
            else:
                print(f"| {impl} | {mode} | - | - | - | - | {r['status']}: {r['reason']} |", flush=True)
    ref = {s["checksum"] for m in results.get("reference load_file(f, device) per shard", {}).values()
           for s in m if "checksum" in s}
    if ref:
        print(f"reference checksum: {', '.join(sorted(ref))}; rows with another checksum loaded other bytes")
    if args.json:
        with open(args.json, "a") as f:
            record = {"size": size, "device": args.device, "runs": args.runs, "results": results}
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
