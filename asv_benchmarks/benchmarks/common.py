"""Benchmark data shared by the asv suites and the scripts (``scripts/harness.py`` builds on it).

Files are written directly (header JSON + bytes), with numpy only: the data does not
depend on the code under test, so every commit is measured on the same bytes.  The layout
is the one a writer produces: 8-byte padded header, tensors ordered by decreasing dtype
size so that every tensor is aligned to its item size.

Generated files are cached on disk, keyed by their parameters and :data:`GEN_VERSION`,
under ``$ENGINE_BENCH_DIR`` or ``<tmp>/engine-bench-cache``; a file appears under its
final name only once complete, so an interrupted run never leaves a truncated cache entry.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Iterable

import numpy as np

__all__ = [
    "GEN_VERSION",
    "REPO_ROOT",
    "cache_dir",
    "many_tensor_entries",
    "model_entries",
    "write_file",
    "many_tensors_file",
    "small_model_file",
    "checkpoint_file",
    "checkpoint_tensors",
    "tiny_file",
    "prepare",
    "warm_up",
    "touch_all",
    "drop_file",
    "warm_cache",
    "checkpoint_files",
    "sharded_copy",
    "rss_bytes",
    "hwm_bytes",
    "reset_hwm",
    "ensure_engine_importable",
    "compile_engine",
    "first_open_code",
    "TORCH_SETUP",
    "entries_bytes",
]

#: Bump when the generated content or layout changes: old cache entries are then ignored.
GEN_VERSION = 1

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "U8": 1}


def ensure_engine_importable() -> None:
    """Under asv's ``existing`` environment (``--python=same``) benchmark the working tree.

    asv installs nothing into an existing environment; when ``engine`` is not installed,
    the checkout that holds these benchmarks is put first on ``sys.path``.  Its Cython
    extension must have been built in place (see ``asv_benchmarks/README.md``).  In a
    virtualenv built by asv the installed commit is always used.
    """
    try:
        import engine  # noqa: F401
    except ImportError:
        if os.environ.get("ASV_ENV_TYPE", "existing") == "existing" and REPO_ROOT not in sys.path:
            sys.path.insert(0, REPO_ROOT)


def compile_engine() -> None:
    """Write the engine's bytecode now, so that no fresh-process sample compiles it.

    An editable install whose ``.pyc`` files are older than the sources, with
    ``PYTHONDONTWRITEBYTECODE`` set, recompiles every module it imports in every process:
    milliseconds inside a timed load whose lazy imports (the planner, a sink) come with it.
    An installed package has its bytecode, and so do the reference's modules.
    """
    import compileall

    import engine

    compileall.compile_dir(os.path.dirname(engine.__file__), quiet=2)


#: Untimed setup of the torch rows of the first-open measurement: a process that has torch.
TORCH_SETUP = "import torch\n"


def first_open_code(impl: str, path: str, first_tensor: bool = False, framework: str = "np") -> str:
    """Python source of what a short-lived tool does first: import the library (``engine``
    or, for ``impl="reference"``, ``safetensors``), open ``path`` with ``framework``
    and read every dtype and shape into ``rows``; with ``first_tensor`` also one
    ``get_tensor``.  One text for asv's ``FirstOpen`` and ``scripts/bench_core.py``.

    For ``framework="pt"`` the process is one that has torch already (transformers, vLLM,
    accelerate): the caller runs :data:`TORCH_SETUP` first, untimed."""
    lib = "safetensors" if impl == "reference" else "engine"
    code = (f"import {lib} as lib\n"
            f"with lib.safe_open({path!r}, framework={framework!r}) as f:\n"
            "    rows = [(k, f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()]\n")
    if first_tensor:
        code += "    rows.append(('~tensor', rows[0][0], list(f.get_tensor(rows[0][0]).shape)))\n"
    return code


def cache_dir(base: str | None = None) -> str:
    """The directory generated files live in (created on first use)."""
    path = base or os.environ.get("ENGINE_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "engine-bench-cache")
    os.makedirs(path, exist_ok=True)
    return path


# --------------------------------------------------------------------------- layouts


def many_tensor_entries(n: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """``n`` small tensors named ``model.layers.{i}.block.{j}.weight``, mixed F32/BF16/I64.

    100,000 entries give a header of about 10 MB, the size of the giant headers that
    motivated the engine (sharded MoE checkpoints, per-expert tensors).
    """
    shapes = [(4,), (2, 3), (8, 4), (3, 2, 2), (16,), (1, 5), (6, 6), (2, 2, 2, 2)]
    kinds = ("F32", "BF16", "I64")
    blocks = 100
    out = []
    for k in range(n):
        i, j = divmod(k, blocks)
        out.append((f"model.layers.{i}.block.{j}.weight", kinds[k % 3], shapes[(i + j) % len(shapes)]))
    return out


def model_entries(
    layers: int, hidden: int, intermediate: int, vocab: int, kv_dim: int | None = None, dtype: str = "BF16"
) -> list[tuple[str, str, tuple[int, ...]]]:
    """A Llama-style decoder checkpoint (grouped-query attention), all tensors in ``dtype``."""
    kv = kv_dim or max(hidden // 8, 1)
    out = [("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", dtype, (hidden,)),
            (p + "self_attn.q_proj.weight", dtype, (hidden, hidden)),
            (p + "self_attn.k_proj.weight", dtype, (kv, hidden)),
            (p + "self_attn.v_proj.weight", dtype, (kv, hidden)),
            (p + "self_attn.o_proj.weight", dtype, (hidden, hidden)),
            (p + "post_attention_layernorm.weight", dtype, (hidden,)),
            (p + "mlp.gate_proj.weight", dtype, (intermediate, hidden)),
            (p + "mlp.up_proj.weight", dtype, (intermediate, hidden)),
            (p + "mlp.down_proj.weight", dtype, (hidden, intermediate)),
        ]
    out += [("model.norm.weight", dtype, (hidden,)), ("lm_head.weight", dtype, (vocab, hidden))]
    return out


def checkpoint_entries(target_bytes: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """A BF16 Llama-style checkpoint of about ``target_bytes``.

    Dimensions follow TinyLlama (hidden 2048, MLP 5632, vocab 32000, 256-wide K/V) from
    1 GB up, and shrink by powers of two for smaller targets, so the tensor sizes stay
    realistic for the total.  2 GB -> 21 layers, 2.11e9 bytes, 191 tensors.
    """
    hidden, inter, vocab, kv = 2048, 5632, 32000, 256
    while hidden > 128 and entries_bytes(model_entries(4, hidden, inter, vocab, kv)) > target_bytes:
        hidden, inter, vocab, kv = hidden // 2, inter // 2, vocab // 2, kv // 2
    fixed = entries_bytes(model_entries(0, hidden, inter, vocab, kv))
    per_layer = entries_bytes(model_entries(1, hidden, inter, vocab, kv)) - fixed
    layers = max(1, round((target_bytes - fixed) / per_layer))
    return model_entries(layers, hidden, inter, vocab, kv)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]


def entries_bytes(entries) -> int:
    """Tensor bytes of ``entries`` ([(name, dtype, shape)])."""
    return sum(_nbytes(d, s) for _, d, s in entries)


# --------------------------------------------------------------------------- writing


def write_file(path: str, entries: Iterable[tuple[str, str, tuple[int, ...]]], seed: int = 0,
               metadata: dict | None = None) -> int:
    """Write a safetensors file holding ``entries`` filled with random bytes; returns its size.

    Tensors are laid out by decreasing item size (then in the given order) so each is
    aligned; the content is a 16 MiB random block repeated, which costs nothing to make
    and is as good as any other bytes for I/O.  Written to a temporary name and renamed.
    """
    entries = list(entries)
    order = sorted(range(len(entries)), key=lambda k: -_ITEMSIZE[entries[k][1]])
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for k in order:
        name, dtype, shape = entries[k]
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    block = np.random.default_rng(seed).integers(0, 256, size=16 << 20, dtype=np.uint8).tobytes()
    tmp = f"{path}.{os.getpid()}.partial"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        left = offset
        while left:
            piece = min(left, len(block))
            f.write(block[:piece])
            left -= piece
    os.replace(tmp, path)
    return 8 + len(text) + offset


def _cached(name: str, entries_fn, base: str | None, **kw) -> str:
    path = os.path.join(cache_dir(base), f"v{GEN_VERSION}-{name}.safetensors")
    if not os.path.exists(path):
        write_file(path, entries_fn(), **kw)
    return path


def many_tensors_file(n: int = 100_000, base: str | None = None) -> str:
    """Path of the cached file of ``n`` tiny tensors (see :func:`many_tensor_entries`)."""
    return _cached(f"many-{n}", lambda: many_tensor_entries(n), base, metadata={"format": "pt"})


def small_model_file(layers: int = 32, base: str | None = None, dtype: str = "BF16") -> str:
    """A few hundred tensors (32 layers -> 291) with tiny dimensions: a small header."""
    name = f"small-{layers}" if dtype == "BF16" else f"small-{layers}-{dtype}"
    return _cached(name, lambda: model_entries(layers, 64, 176, 256, 16, dtype=dtype), base,
                   metadata={"format": "pt"})


def llama_file(config: dict, base: str | None = None) -> str:
    """A BF16 Llama checkpoint with the shapes of a Hugging Face ``config`` (hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    vocab_size), for the tensor-parallel plans built from the same config."""
    c = config
    kv = c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    name = "llama-" + "-".join(str(c[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                    "num_attention_heads", "num_key_value_heads", "vocab_size"))
    return _cached(name, lambda: model_entries(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"],
                                               c["vocab_size"], kv_dim=kv), base, metadata={"format": "pt"})


def checkpoint_file(target_bytes: int, base: str | None = None) -> str:
    """Path of the cached BF16 checkpoint of about ``target_bytes`` bytes."""
    return _cached(f"ckpt-{target_bytes}", lambda: checkpoint_entries(target_bytes), base,
                   metadata={"format": "pt"})


def checkpoint_tensors(target_bytes: int, seed: int = 0) -> dict:
    """The tensors of :func:`checkpoint_entries` as torch BF16 tensors, every page touched.

    Filled in place by copying one 16 MiB random block over and over (``random_`` on 2 GB
    takes ~10 s; a copy runs at memory speed), so making them holds at most 16 MiB more
    than the tensors themselves.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    block = torch.empty(8 << 20, dtype=torch.int16).random_(generator=g)
    out = {}
    for name, dtype, shape in checkpoint_entries(target_bytes):
        assert dtype == "BF16"
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat = t.view(-1).view(torch.int16)
        for pos in range(0, flat.numel(), block.numel()):
            piece = flat[pos : pos + block.numel()]
            piece.copy_(block[: piece.numel()])
        out[name] = t
    return out


# --------------------------------------------------------------------------- measuring


def tiny_file(base: str | None = None) -> str:
    """A one-tensor file, for warm-up calls."""
    return _cached("tiny", lambda: [("warm.weight", "F32", (4, 4))], base, metadata={"format": "pt"})


def prepare(impl: str, base: str | None = None) -> None:
    """Untimed set-up before a measurement: one torch thread, then :func:`warm_up`.

    One intra-op thread keeps the read loop (:func:`touch_all`) from spin-waiting on a
    core a neighbour holds, which made samples on a busy 2-core machine vary by 5x; the
    loaders' own reads use their own threads (pread) or page faults (mmap), unaffected.
    """
    import torch

    torch.set_num_threads(1)
    warm_up(impl, base)


def warm_up(impl: str, base: str | None = None) -> None:
    """Pay imports and first-use costs on a one-tensor file, alike for both libraries.

    ``impl`` is ``"reference"`` or an engine variant.  The engine resolves its public
    names, sinks and torch lazily; the reference imports most at ``import safetensors``
    and torch on the first ``framework="pt"``.  Touches get_slice, slicing, get_tensor,
    both backends, load_file and save_file; writes and removes one small file.
    """
    tiny = tiny_file(base)
    if impl == "reference":
        import safetensors
        import safetensors.torch as mod

        opener = safetensors.safe_open
    else:
        import engine
        import engine.torch as mod

        opener = engine.safe_open
        _ = engine.read_header(tiny).table  # pays the first-use costs
    for backend in ("mmap", "pread"):
        with opener(tiny, framework="pt", backend=backend) as f:
            for k in f.keys():
                s = f.get_slice(k)
                s.get_shape(), s.get_dtype(), s[:1], f.get_tensor(k)
        mod.load_file(tiny, backend=backend)
    out = f"{tiny}.{os.getpid()}.out"
    mod.save_file(mod.load_file(tiny), out)
    drop_file(out)


def touch_all(tensors) -> int:
    """Read every byte of every torch tensor; returns a checksum (wrapping int64 sum).

    ``torch.sum(t.view(torch.int16), dtype=torch.int64)`` would also do, but torch runs
    that widening reduction at ~60 MB/s; an int64 view sums at memory speed, so the read
    loop measures the loader's memory, not torch's cast.
    """
    import torch

    total = 0
    for t in tensors.values() if isinstance(tensors, dict) else tensors:
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        if flat.nbytes % 8 == 0:
            # the checksum depends on the bytes only, never on where they sit: a tensor
            # not 8-byte aligned (possible in files of small tensors) is copied first
            if (flat.storage_offset() * flat.element_size()) % 8:
                flat = flat.clone()
            total += int(torch.sum(flat.view(torch.int64)))
        else:  # a size that is not a multiple of 8 bytes: sum the bytes (tiny tensors only)
            total += int(torch.sum(flat.view(torch.uint8), dtype=torch.int64))
    return total & 0xFFFFFFFFFFFFFFFF


def checkpoint_files(path: str) -> list[str]:
    """``path``, or the ``.safetensors`` files of the directory ``path`` (a sharded checkpoint)."""
    if not os.path.isdir(path):
        return [path]
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


def per_key_load(safe_open, files: list[str], device) -> dict:
    """The loop of accelerate's ``load_state_dict``: ``safe_open(f, framework="pt",
    device=device)``, then ``get_tensor(k)`` for every key, file after file; ``safe_open``
    the engine's or the reference's (also scripts/bench_gpu.py's per-key rows)."""
    out = {}
    for f in files:
        with safe_open(f, framework="pt", device=device) as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def warm_cache(path: str) -> None:
    """Read ``path`` (a file, or each file of a checkpoint directory) once so that it sits in
    the page cache."""
    buf = bytearray(16 << 20)
    for file in checkpoint_files(path):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def evict_cache(path: str) -> None:
    """Drop ``path`` (a file, or each file of a checkpoint directory) from the page cache
    (written back first, so that no dirty page stays)."""
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sharded_copy(path: str, shards: int) -> str:
    """The tensors of the file ``path`` as a sharded checkpoint beside it: ``shards`` files of
    about equal size and ``model.safetensors.index.json`` (``save_sharded``), made once."""
    directory = path[: -len(".safetensors")] + f"-{shards}shards"
    if not os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        import engine.numpy
        from engine.checkpoints.shards import save_sharded

        arrays = engine.numpy.load_file(path)
        total = sum(a.nbytes for a in arrays.values())
        save_sharded(arrays, directory, max_shard_size=-(-total // shards), fsync=False)
    return directory


def drop_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident set size (VmRSS), bytes."""
    v = _status("VmRSS")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def hwm_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_hwm` (VmHWM), bytes."""
    v = _status("VmHWM")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> bool:
    """Reset the peak-RSS counter to the current RSS (Linux ``clear_refs`` 5); True if done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class OneCallPerSample:
    """asv defaults for file benchmarks: one call per sample (``setup`` runs before each
    one, eviction included), a few samples, no warm-up loop."""

    number = 1
    repeat = (3, 10, 20.0)
    warmup_time = 0
    timeout = 600


def reference_shards(path: str, plan, rank: int, world: int, opener=None) -> dict:
    """One rank's tensor-parallel shards read the reference's way: ``safetensors.safe_open``
    + ``get_slice(name)[index]`` per piece, concatenated for fused tensors, made contiguous.
    Contiguous slices stay views of the reference's mapping; column blocks are copies.
    ``path`` is a file, or a directory holding ``model.safetensors.index.json``: its shard
    files are opened one after the other, as ``transformers`` reads the index (plain JSON).
    ``opener``: a drop-in ``safe_open`` to run the same code on (default the reference's)."""
    import safetensors
    import torch

    from engine.distributed import Replicate, shard_index

    files = [path]
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
    got = {}
    for file in files:
        with (opener or safetensors.safe_open)(file, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                action = plan.action(name)
                if isinstance(action, Replicate):
                    got[name] = sl[:]
                    continue
                parts = [sl[index] for index, _ in shard_index(name, sl.get_shape(), action, rank, world)]
                got[name] = (parts[0] if len(parts) == 1 else torch.cat(parts, action.dim)).contiguous()
    return got


def best_time(fn, n: int = 5) -> float:
    """The shortest of ``n`` timed calls of ``fn``, seconds."""
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out
