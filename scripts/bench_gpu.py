"""File to GPU: every engine entry point against the reference and the peer loaders, in one run.

A Llama-3-8B-shaped checkpoint (BF16, 16.06 GB in 4 shards and an index; ``--size`` scales it) is made
once in ``--dir``.  Each row (an entry point, the reference, a peer, or a limit: host-to-device copies,
page cache to pinned memory) takes ``--runs`` samples per page-cache mode, interleaved, each in a fresh
process with the CUDA context up before the clock, which stops after ``torch.cuda.synchronize()``.  A
sample also reports the tensors' checksum, host memory peak and growth by kind (host_memory.py), device
memory peak and the chunk ring's records.  Cold samples drop the page cache (``drop_caches`` as root, else
``POSIX_FADV_DONTNEED``).  Peers (fastsafetensors, instanttensor, runai_model_streamer) are optional.

    PYTHONPATH=/tmp/site python3 scripts/bench_gpu.py --runs 3 --modes warm,cold --json gpu.json
    python scripts/bench_gpu.py --device cpu --size 16MB --runs 1 --modes warm --only "load_file(directory)"
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import harness

# isort: split
import checkout_path
import host_memory
from benchmarks import common

GiB = 1 << 30
DIR = os.path.join(tempfile.gettempdir(), "engine-bench-gpu")
#: passes over the checkpoint in one page cache -> pinned limit sample (their median is its figure)
LIMIT_PASSES = 3
#: Llama-3-8B: hidden, MLP, K/V width, vocabulary
LLAMA3 = (4096, 14336, 1024, 128256)


def model_shapes(total_bytes: int) -> list[tuple[str, str, tuple]]:
    """(name, "BF16", shape) of a Llama-3-8B-like model of about ``total_bytes``, each layer in name order:
    Llama-3-8B's tensors from about 2.5 GB up, below that every dimension scaled down alike."""
    hidden, inter, kv, vocab = LLAMA3
    per_layer = common.entries_bytes(common.model_entries(1, *LLAMA3[:2], 0, kv)[1:-2])
    if total_bytes < 4 * vocab * hidden + per_layer:
        # bytes per hidden**2 of 4 layers and the two vocabulary tables (vocab = 8 * hidden)
        hidden = max(64, int((total_bytes / (4 * per_layer / LLAMA3[0] ** 2 + 32)) ** 0.5) // 64 * 64)
        inter, kv, vocab = hidden * LLAMA3[1] // LLAMA3[0] // 64 * 64, max(64, hidden // 4), 8 * hidden
    per_layer = common.entries_bytes(common.model_entries(1, hidden, inter, 0, kv)[1:-2])
    layers = max(1, round((total_bytes - 4 * vocab * hidden) / per_layer))
    out = common.model_entries(layers, hidden, inter, vocab, kv)
    return [out[0], *sorted(out[1:-2], key=lambda e: (int(e[0].split(".")[2]), e[0])), *out[-2:]]


def make_checkpoint(folder: str, total_bytes: int, shards: int = 4) -> list[str]:
    """The shard paths of the checkpoint, written once through the engine's streaming writer (no
    ``fsync``), its values random finite BF16 bit patterns."""
    import ml_dtypes
    import numpy as np

    from engine.writing.writer import open_writer

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    os.makedirs(folder, exist_ok=True)
    shapes = model_shapes(total_bytes)
    total = common.entries_bytes(shapes)
    pool = np.random.default_rng(0).integers(0, 1 << 14, min(96 << 20, total // 2 + 1), dtype=np.uint16)
    groups: list[list] = [[]]
    size = 0
    for e in shapes:
        if size >= total / shards * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(e)
        size += common.entries_bytes([e])
    weight_map, files = {}, []
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        with open_writer(os.path.join(folder, fname), group, fsync=False) as w:
            for j, (name, _, shape) in enumerate(group):
                start = (j * 7919 + k * 104729) % pool.size
                n = common.entries_bytes([group[j]]) // 2
                w.write(name, np.resize(pool[start:], n).view(ml_dtypes.bfloat16).reshape(shape))
                weight_map[name] = fname
        files.append(os.path.join(folder, fname))
    with open(index + ".tmp", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    os.replace(index + ".tmp", index)
    return files


def tensor_bytes(files: list[str]) -> int:
    import engine

    return sum(int(t.ends.sum() - t.begins.sum()) for t in (engine.read_header(p).table for p in files))


def made(folder: str, size: int) -> dict:
    """:func:`make_checkpoint` and its tensor bytes (in a child: the parent imports no engine)."""
    files = make_checkpoint(folder, size)
    return {"files": files, "bytes": tensor_bytes(files)}


def checkpoint(directory: str, size: int) -> tuple[list[str], int]:
    """The shards of the checkpoint of ``size`` bytes in ``directory`` (made in a child), its tensor bytes."""
    got = harness.call(made, os.path.join(directory, f"llama3-shapes-{size}"), size)
    return got["files"], got["bytes"]


def warm(files: list[str]) -> None:
    for f in files:
        common.warm_cache(f)


def drop_cache(files: list[str]) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            common.evict_cache(p)
        return "fadvise"


# -- implementations (each in a fresh child: what they import, they import on the clock) -----------


def _m(name: str):
    return importlib.import_module(name)


def _each(load):
    """``load(f, dev)`` for every shard, the results merged."""

    def run(files, dev):
        out: dict = {}
        for f in files:
            out.update(load(f, dev))
        return out

    return run


def _dir(files: list[str]) -> str:
    return os.path.dirname(files[0])


def _stream_each(**kw):
    """stream(f) one shard at a time; with ``stats`` each tensor's statistics kept as ``<name> stats``."""

    def load(f, dev):
        out = {}
        for name, t, *st in _m("engine").stream(f, framework="pt", device=dev, **kw):
            out[name] = t
            if st:
                out[name + " stats"] = st[0]
        return out

    return _each(load)


def _safe_open(index: bool):
    def load(files, dev):
        where = os.path.join(_dir(files), "model.safetensors.index.json") if index else _dir(files)
        with _m("engine").safe_open(where, framework="pt", device=dev) as f:
            return f.get_tensors()

    return load


def _dst(files, dev) -> tuple[dict, dict]:
    """load_into's destinations, made before the clock (and fields for the sample's record)."""
    import torch

    engine = _m("engine")
    return {n: torch.empty(i.shape, dtype=torch.bfloat16, device=dev)
            for f in files for n, i in engine.read_header(f).items()}, {}


def _prepare_device(files, dev):
    """The destinations, then ``engine.prepare_device(dev)`` timed before the load's clock (a server
    that warms the ring at start)."""
    dst, _ = _dst(files, dev)
    _sync(dev)
    t0 = time.perf_counter()
    locked = _m("engine").prepare_device(dev)
    _sync(dev)
    return dst, {"prepare_s": time.perf_counter() - t0, "prepare_lock_s": locked}


def _reload(files, dev):
    """A server reloading its weights: staging and mappings kept, one untimed load first."""
    engine = _m("engine")
    engine.keep_staging(True)
    engine.keep_mappings(True)
    dst, _ = _dst(files, dev)
    return _into_dir(files, dev, dst), {}


def _into_dir(files, dev, dst):
    _m("engine").load_into(_dir(files), dst, strict=True)  # every shard, one load
    return dst


def _into_each(files, dev, dst):
    engine = _m("engine")
    for f in files:
        engine.load_into(f, {k: dst[k] for k in engine.read_header(f).keys()})
    return dst


def validator_config(files: list[str]) -> dict:
    """A LLaMA ``config.json`` for the checkpoint, read from its headers (heads of 64)."""
    engine = _m("engine")
    shapes = {n: tuple(int(d) for d in t.shapes[i]) for f in files
              for t in [engine.read_header(f).table] for i, n in enumerate(t.names)}
    vocab, hidden = shapes["model.embed_tokens.weight"]
    return {"hidden_size": hidden, "intermediate_size": shapes["model.layers.0.mlp.up_proj.weight"][0],
            "num_hidden_layers": sum(n.endswith(".mlp.up_proj.weight") for n in shapes),
            "num_attention_heads": hidden // 64, "head_dim": 64,
            "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // 64, "vocab_size": vocab}


def _validator(files, dev):
    """``WeightValidator(config).validate(directory)``: statistics on the CPU (no device path)."""
    report = _m("engine").WeightValidator(validator_config(files)).validate(_dir(files))
    return {t.name + " stats": t for t in report.tensors}


def _fastsafetensors(files, dev):
    names = [n for f in files for n in _m("engine").read_header(f).keys()]  # outside fastsafetensors' work
    loader = _m("fastsafetensors").SafeTensorsFileLoader(None, dev, nogds=True)
    loader.add_filenames({0: files})
    fb = loader.copy_files_to_device()  # fb and loader stay open: their buffers back the tensors
    return {k: fb.get_tensor(k) for k in names}


def _instanttensor(policy):
    def load(files, dev):
        it = _m("instanttensor")
        kw = {"backend": getattr(getattr(it, policy[0]), policy[1])} if policy else {}
        with it.safe_open(files, framework="pt", device=int(dev.split(":")[1]), **kw) as f:
            got = f.tensors()
            return dict(got.items() if hasattr(got, "items") else got)

    return load


def _runai(files, dev):
    out = {}
    with _m("runai_model_streamer").SafetensorsStreamer() as s:
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

        def copy():
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()

        return GiB, statistics.median(harness.times(copy, reps=5))  # the first copy off the clock

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

        def one_pass():
            for fd in fds:
                size = os.fstat(fd).st_size
                for off in range(0, size, slot):
                    n = min(slot, size - off)
                    assert reader.copy(fd, None, np.array([off], np.int64), [memoryview(out)[:n]])[0] == 0

        seconds = statistics.median(harness.times(one_pass, reps=LIMIT_PASSES, warmup=0))
        reader.close()
        for fd in fds:
            os.close(fd)
        return sum(os.path.getsize(f) for f in files), seconds

    return run


IMPLEMENTATIONS: dict = {
    "engine load_file(f) per shard": _each(lambda f, dev: _m("engine.torch").load_file(f, device=dev)),
    "engine load_file(directory)": lambda files, dev: _m("engine.torch").load_file(_dir(files), device=dev),
    "engine safe_open(directory).get_tensors()": _safe_open(False),
    "engine safe_open(index).get_tensors()": _safe_open(True),
    "engine stream(shards) auto": lambda files, dev: dict(_m("engine").stream(files, framework="pt", device=dev)),
    # one allocation for the load: what the default's allocation per tensor (record_stream holds) costs
    "engine stream(shards) per_tensor=False": lambda files, dev: dict(
        _m("engine").stream(files, framework="pt", device=dev, per_tensor=False)),
    "engine stream(f) per shard": _stream_each(),
    "engine load_into(f) per shard": (_dst, _into_each),
    "engine load_into(directory)": (_dst, _into_dir),
    "engine load_into(directory) first load after engine.prepare_device": (_prepare_device, _into_dir),
    "engine load_into(directory) reload, staging and mappings kept": (_reload, _into_dir),
    "engine stream(f) stats=True per shard": _stream_each(stats=True),
    "engine stream(f) quantize=int8 per shard": _stream_each(quantize="int8"),
    "engine stream(f) stats=True quantize=int8 per shard": _stream_each(stats=True, quantize="int8"),
    "engine WeightValidator(config).validate(directory)": _validator,
    "engine safe_open(f, device) get_tensor per key": lambda files, dev: common.per_key_load(
        _m("engine").safe_open, files, dev),
    "reference load_file(f, device) per shard": _each(lambda f, dev: _m("safetensors.torch").load_file(f, device=dev)),
    "reference safe_open(f, device) get_tensor per key": lambda files, dev: common.per_key_load(
        _m("safetensors").safe_open, files, dev),
    "reference load_file(f) then .to(device)": _each(
        lambda f, dev: {k: v.to(dev) for k, v in _m("safetensors.torch").load_file(f).items()}),
    "fastsafetensors (nogds, buffered)": _fastsafetensors,
    "InstantTensor default": _instanttensor(None),
    "InstantTensor BackendPolicy.BUFFERED": _instanttensor(("BackendPolicy", "BUFFERED")),
    "InstantTensor Backend.MMAP": _instanttensor(("Backend", "MMAP")),
    "Run:ai streamer": _runai,
    "Run:ai streamer (io_uring_buffered)": _runai,
}
ENV = {"fastsafetensors (nogds, buffered)": {"FASTSAFETENSORS_ODIRECT": "0"},
       "Run:ai streamer (io_uring_buffered)": {"RUNAI_STREAMER_FS_STRATEGY": "io_uring_buffered"}}
LIMITS = {
    "limit: pinned host-to-device 1 GiB": _limit_h2d(True),
    "limit: pageable host-to-device 1 GiB": _limit_h2d(False),
    **{f"limit: page cache to pinned, split read, {n} thread{'s' * (n > 1)}": _limit_page_cache_to_pinned(n)
       for n in (1, 8, 16)},
}
#: rows whose rate counts the file's tensor bytes (what they produce differs from what they read)
SOURCE_BYTES = {"engine stream(f) stats=True per shard", "engine stream(f) quantize=int8 per shard",
                "engine stream(f) stats=True quantize=int8 per shard",
                "engine WeightValidator(config).validate(directory)"}
#: loads with device kernels: a few of their results are checked against the CPU kernels'
HOOKED = SOURCE_BYTES - {"engine WeightValidator(config).validate(directory)"}
#: tensors checked per hooked sample (spread over the checkpoint; each costs a CPU pass)
CPU_CHECKS = 6
#: rows whose child times a second load in the same process (``record["second"]``): a warm ring's
TWICE = {"engine load_into(directory)"}
#: the package a row needs beyond torch and the engine
REQUIRES = {**{n: "instanttensor" for n in IMPLEMENTATIONS if n.startswith("InstantTensor")},
            **{n: "runai_model_streamer" for n in IMPLEMENTATIONS if n.startswith("Run:ai")},
            "fastsafetensors (nogds, buffered)": "fastsafetensors", **{n: "numba" for n in SOURCE_BYTES}}
#: rows that mean nothing without a CUDA device (pinned memory, a device ordinal, GPU-only peers)
NEEDS_CUDA = {*(n for n, m in REQUIRES.items() if m != "numba"),
              *(n for n in LIMITS if "pinned" in n or "host-to-device" in n),
              "engine load_into(directory) first load after engine.prepare_device"}


def skip_reason(impl: str, dev: str, path: list[str] | None = None) -> str | None:
    """Why ``impl`` cannot run on ``dev`` (a package missing, or no CUDA), or None; ``path``: more
    folders the children look for packages in."""
    module = REQUIRES.get(impl)
    if module is not None:
        saved = sys.path[:]
        sys.path[:0] = path or []
        try:
            why = harness.missing(module)
        finally:
            sys.path[:] = saved
        if why:
            return why
    if impl in NEEDS_CUDA and not dev.startswith("cuda"):
        return f"no CUDA device (--device {dev})"
    return None


# -- the child's sample ------------------------------------------------------------------------------


def checksum(tensors: dict) -> str:
    """Every tensor in name order, each word weighted by its position (a swapped tensor or shifted bytes
    change it), computed where the tensors are."""
    import torch

    mod, acc = (1 << 61) - 1, 0
    for name in sorted(tensors):
        t = tensors[name].contiguous().view(-1).view(torch.uint8)
        n = t.numel() // 4 * 4
        words = t[:n].view(torch.int32)
        s = int(t[n:].to(torch.int64).sum().item())
        for lo in range(0, words.numel(), 64 << 20):
            w = words[lo: lo + (64 << 20)].to(torch.int64)
            weights = torch.arange(lo + 1, lo + 1 + w.numel(), device=t.device, dtype=torch.int64) % 65521
            s += int((w * weights).sum().item())
        acc = (acc * 1000003 + s % mod) % mod
    return f"{acc:016x}"


def _sync(dev: str) -> None:
    if dev != "cpu":
        _m("torch").cuda.synchronize()


def _flatten(out: dict) -> tuple[dict, int]:
    """Tensors only (a quantized tensor as its values and scales), and how many statistics came back."""
    tensors, stats = {}, 0
    for name, v in out.items():
        if name.endswith(" stats"):
            stats += v is not None
        elif hasattr(v, "q") and hasattr(v, "scale"):
            tensors[name + ".q"], tensors[name + ".scale"] = v.q, v.scale
        else:
            tensors[name] = v
    return tensors, stats


#: the records' fields summed over a sample's loads (one per shard in a per-shard row), and the ring's
#: shape (the first load's)
RECORD_SUMS = ("chunks", "bytes", "seconds", "fill_wait_s", "slot_wait_s", "fill_s", "lock_s", "lock_calls",
               "pread_bytes", "mmap_bytes", "network_bytes", "reported", "report_s")
RECORD_SHAPE = ("chunk_bytes", "slots", "threads")


@contextlib.contextmanager
def ring_records():
    """A dict that holds, after the block, ``engine.load_records()`` of its loads as one: counts of
    ``loads``, ``cold``, ``pageable``, ``hooked``; :data:`RECORD_SUMS` summed; :data:`RECORD_SHAPE`;
    every ``source`` and ``unmap`` seen."""
    out: dict = {}
    with _m("engine").load_records() as got:
        yield out
    records = [r.as_dict() for r in got]
    out.update({k: sum(bool(r.get(k)) for r in records) for k in ("cold", "pageable", "hooked")}, loads=len(records))
    for key in RECORD_SUMS:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        out[key] = sum(values) if values else None
    out.update({k: records[0].get(k) if records else None for k in RECORD_SHAPE})
    out.update({k: "/".join(sorted({str(r[k]) for r in records if r.get(k) is not None})) or None
                for k in ("source", "unmap")})


def median_records(summaries: list[dict | None]) -> dict | None:
    """The samples' records as one: the median of each number, the last sample's text."""
    got = [s for s in summaries if s]
    out: dict = {}
    for k in got[-1] if got else []:
        values = [s[k] for s in got if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)]
        out[k] = statistics.median(values) if values else got[-1][k]
    return out or None


def _timed_load(fn, files, dev, dst, engine_row: bool) -> tuple[dict, float, dict | None]:
    """One load on the clock: its output, seconds, and for the engine's rows the ring's records."""
    with ring_records() if engine_row else contextlib.nullcontext() as records:
        t0 = time.perf_counter()
        out = fn(files, dev) if dst is None else fn(files, dev, dst)
        _sync(dev)
        seconds = time.perf_counter() - t0
    return out, seconds, records


def child(impl: str, files: list[str], dev: str) -> dict:
    """One sample of ``impl`` in this (fresh) process: its record."""
    import torch

    cuda = dev != "cpu"
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=dev)  # the CUDA context is up before the clock
    _sync(dev)
    if impl in LIMITS:
        nbytes, seconds = LIMITS[impl](files, dev)
        return {"seconds": seconds, "bytes": nbytes, "checksum": "", "host_peak_bytes": common.hwm_bytes(),
                "engine_file": checkout_path.engine_origin()}
    fn, dst, record = IMPLEMENTATIONS[impl], None, {}
    if isinstance(fn, tuple):  # load_into: the destinations exist before the clock
        dst, record = fn[0](files, dev)
        fn = fn[1]
        _sync(dev)
    reset = common.reset_hwm()  # the peak from here: VmHWM of this address space, not ru_maxrss (fork, exec)
    host_before = common.rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        free_before = torch.cuda.mem_get_info()[0]
    with host_memory.Sampler() as kinds:  # memory by kind, sampled on a thread while the load runs
        out, seconds, records = _timed_load(fn, files, dev, dst, impl.startswith("engine"))
    record.update({"seconds": seconds, "host_before_bytes": host_before, "host_peak_bytes": common.hwm_bytes(),
                   "host_peak_from": "clock" if reset else "process start", **kinds.result(),
                   "file_after_bytes": kinds.file_now(), "records": records})
    if cuda:  # torch's allocator; peers with their own show in device_used_bytes
        record["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        record["device_used_bytes"] = free_before - torch.cuda.mem_get_info()[0]
    tensors, stats = _flatten(out)
    record.update(bytes=tensor_bytes(files) if impl in SOURCE_BYTES else
                  sum(t.numel() * t.element_size() for t in tensors.values()),
                  checksum=checksum(tensors), tensors=len(tensors), engine_file=checkout_path.engine_origin(),
                  all_on_gpu=all(t.device.type == "cuda" for t in tensors.values()))
    if impl in SOURCE_BYTES:
        record["stats"] = stats
    if impl in HOOKED:  # off the clock: the results against the CPU kernels'
        record["cpu_kernels"] = against_cpu_kernels(out, files)
    if impl in TWICE:  # the same load again in this process: what a warm ring gives
        for t in tensors.values():
            t.zero_()
        _sync(dev)
        again, seconds2, records2 = _timed_load(fn, files, dev, dst, True)
        tensors2, _ = _flatten(again)
        record["second"] = {"seconds": seconds2, "records": records2, "checksum": checksum(tensors2),
                            "bytes": sum(t.numel() * t.element_size() for t in tensors2.values())}
    return record


def against_cpu_kernels(out: dict, files: list[str]) -> dict:
    """A few tensors of a hooked load against ``engine.stats`` and ``engine.quantize_int8`` on the CPU:
    counts, min, max, absmax, int8 values and scale bits exactly, mean and std to 1e-6."""
    import math

    import numpy as np

    engine = _m("engine")
    names = sorted(n for n in out if not n.endswith(" stats"))
    picked = names[:: max(1, len(names) // CPU_CHECKS)][:CPU_CHECKS]
    where = {n: f for f in files for n in engine.read_header(f).table.names}
    mismatched: dict = {}
    for name in picked:
        with engine.safe_open(where[name], framework="np") as h:
            x = h.get_tensor(name)
        st = out.get(name + " stats")
        if st is not None:
            cpu = engine.stats(x)
            bad = [k for k in ("count", "nan_count", "posinf_count", "neginf_count", "zero_count", "min", "max",
                               "absmax") if float(getattr(st, k)) != float(getattr(cpu, k))]
            bad += [k for k in ("mean", "std") if not math.isclose(getattr(st, k), getattr(cpu, k), rel_tol=1e-6)]
            if bad:
                mismatched[name + " stats"] = bad
        v = out[name]
        if hasattr(v, "q"):
            q, scale = engine.quantize_int8(x, v.axis, on_nonfinite="clamp")
            got_q, got_s = (np.asarray(a.cpu().numpy() if hasattr(a, "cpu") else a) for a in (v.q, v.scale))
            if not (np.array_equal(got_q, q) and np.array_equal(np.asarray(got_s, np.float32).view(np.uint32),
                                                                np.asarray(scale, np.float32).view(np.uint32))):
                mismatched[name + " int8"] = "values or scales differ"
    return {"checked": len(picked), "mismatched": mismatched}


def where() -> dict:
    """Which engine and ring extension a child imports, and what it sees (torch, the device)."""
    out: dict = {"engine_file": checkout_path.engine_origin(),
                 "ring_file": checkout_path.engine_origin("engine.gpu._ring")}
    try:
        import torch

        cuda = torch.cuda.is_available()
        out.update(torch=torch.__version__, cuda=cuda, name=torch.cuda.get_device_name(0) if cuda else "no CUDA device")
    except Exception as exc:
        out.update(torch=f"unavailable ({type(exc).__name__}: {exc})", cuda=False, name="no CUDA device")
    return out


# -- the parent ----------------------------------------------------------------------------------------


def sample(impl: str, files: list[str], dev: str, timeout: float, env: dict | None = None) -> dict:
    """One fresh-process sample of ``impl``: its record, or ``{"error": why}``."""
    t0 = time.monotonic()
    got = harness.call(child, impl, files, dev, env={**(env or harness.child_env()), **ENV.get(impl, {})},
                       timeout=timeout, check=False)
    if "error" in got and time.monotonic() - t0 >= timeout:
        got["error"] = f"timed out after {timeout:.0f} s"
    return got


#: a sample's host memory by kind (scripts/host_memory.py); a row keeps the largest of its samples
MEMORY_KINDS = ("anon_growth_bytes", "file_growth_bytes", "vmlck_growth_bytes", "locked_growth_bytes",
                "anon_locked_growth_bytes", "locked_peak_bytes", "file_after_bytes")


def summarise(samples: list[dict], cache: str) -> dict:
    """A row from its samples: ``status`` (failed if any failed), ``reason``, medians of the rates,
    times and ring records, maxima of the memory, the checksums seen."""
    bad = [s["error"] for s in samples if "error" in s]
    if bad or not samples:
        return {"status": "failed", "reason": bad[0] if bad else "no sample ran", "samples": samples}
    out: dict = {"status": "ok", "reason": None, "samples": samples, "cache": cache,
                 "seconds": statistics.median(s["seconds"] for s in samples),
                 "gbps": statistics.median(s["bytes"] / s["seconds"] / 1e9 for s in samples),
                 "bytes": samples[0]["bytes"],
                 "checksums": sorted({s["checksum"] for s in samples if s.get("checksum")})}
    for key in ("host_before_bytes", "host_peak_bytes", "device_peak_bytes", "device_used_bytes", *MEMORY_KINDS):
        if values := [s[key] for s in samples if key in s]:
            out[key] = max(values)
    out.update({k: samples[-1][k] for k in ("tensors", "all_on_gpu", "stats", "host_peak_from", "engine_file",
                                            "memory_samples", "cpu_kernels") if k in samples[-1]})
    if prepare := [s["prepare_s"] for s in samples if isinstance(s.get("prepare_s"), (int, float))]:
        out["prepare_s"] = statistics.median(prepare)
    if any("records" in s for s in samples):
        out["records"] = median_records([s.get("records") for s in samples])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--size", default="16.06GB", help="checkpoint size, e.g. 16.06GB or 4GB")
    ap.add_argument("--dir", default=DIR, help="where the checkpoint is made (and reused)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--only", default="", help="comma-separated words; rows whose name contains one")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for the dry run")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per sample")
    a = ap.parse_args(argv)
    size = harness.parse_size(a.size)
    files, nbytes = checkpoint(a.dir, size)
    seen = harness.call(where)  # what the children see: torch and the device
    print(f"checkpoint: {len(files)} shards, {nbytes / 1e9:.2f} GB of tensors in {_dir(files)}; {seen['name']};"
          f" torch {seen['torch']}", file=sys.stderr)
    words = [w.strip().lower() for w in a.only.split(",") if w.strip()]
    rows = [n for n in [*IMPLEMENTATIONS, *LIMITS] if not words or any(w in n.lower() for w in words)]
    report = harness.Report()
    for mode in [m for m in a.modes.split(",") if m in ("warm", "cold")]:
        if mode == "warm":
            warm(files)
        todo = [n for n in rows if mode == "warm" or "host-to-device" not in n]  # no file in those
        skipped = {n: skip_reason(n, a.device) for n in todo}
        cache = {"how": mode}

        def one(impl: str, mode=mode, cache=cache) -> dict:
            if mode == "cold":
                cache["how"] = drop_cache(files)
            return sample(impl, files, a.device, a.timeout)

        got = harness.rounds([n for n in todo if not skipped[n]], a.runs, one)
        for impl in todo:
            r: dict = summarise(got[impl], cache["how"]) if impl in got else {"status": "skipped",
                                                                               "reason": skipped[impl]}
            ok = [s["seconds"] for s in r.get("samples", []) if "error" not in s]
            extra = {k: v for k, v in r.items() if k not in ("samples", "seconds", "gbps", "bytes", "checksums")}
            report.add(f"checkpoint -> {a.device}, {mode} cache", impl, ok, r.get("bytes"),
                       checksum=",".join(r.get("checksums", [])) or None, **extra)
    ref = {r["checksum"] for r in report.rows if r["impl"] == "reference load_file(f, device) per shard"} - {None}
    if ref:
        report.note(f"reference checksum: {', '.join(sorted(ref))}; rows with another checksum loaded other bytes")
    report.ratio("x_reference", lambda r: report.seconds(r["case"], "reference load_file(f, device) per shard"))
    return report.finish(a.json, "case", "impl", "median_s", "gbps", "x_reference", "host_peak_bytes",
                         "device_peak_bytes", "checksum", "status", size=size, device=a.device, runs=a.runs,
                         device_name=seen["name"], torch=seen["torch"])


if __name__ == "__main__":
    sys.exit(main())
