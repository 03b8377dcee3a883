"""Tensor-parallel loading on ``torch.distributed``: every rank reads only its own shard.

A :class:`ShardingPlan` says, per tensor name, whether a tensor is replicated or split along
a dimension into ``world_size`` equal parts (fused tensors such as ``qkv_proj`` split part
by part).  :func:`load_tensor_parallel` then reads, on each rank, only the bytes of that
rank's shard of each tensor: a block of rows is one contiguous range, a block of columns is a
set of strided ranges, both read by the threaded reader.  For shared storage that is slow
under many parallel readers, ``mode="broadcast"`` reads each tensor once per node and hands
the shards out with ``scatter`` / ``broadcast``.

Importing this module imports torch.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .errors import ShardingError
from .opener import is_checkpoint_path

__all__ = [
    "Replicate",
    "Split",
    "Fused",
    "ShardingPlan",
    "ShardingError",
    "llama_plan",
    "shard_index",
    "load_tensor_parallel",
    "direct_read_bytes",
]


class Replicate(NamedTuple):
    """Every rank gets the whole tensor."""


class Split(NamedTuple):
    """Split along ``dim`` into ``world_size`` equal parts; ``pad`` allows uneven sizes.

    With ``pad=True`` each part has ``ceil(size / world_size)`` entries along ``dim``; the
    ranks past the end get zeros where the tensor has no data.
    """

    dim: int
    pad: bool = False


class Fused(NamedTuple):
    """A fused tensor (``qkv_proj``, ``gate_up_proj``): ``sizes`` parts along ``dim``, each
    split separately; a rank's shard is its part of each, concatenated in order.

    ``replicate`` marks parts that are replicated rather than split (grouped-query
    attention with fewer key/value heads than ranks).
    """

    dim: int
    sizes: tuple[int, ...]
    replicate: tuple[bool, ...] = ()


Action = Replicate | Split | Fused


@dataclass
class ShardingPlan:
    """Rules from name patterns to actions; the first rule that matches wins.

    Parameters
    ----------
    rules : sequence of (pattern, action)
        ``pattern`` is an ``fnmatch`` glob (``"*.q_proj.weight"``) or a compiled regex.
    default : action, default Replicate()
        For names no rule matches.
    """

    rules: Sequence[tuple[str | re.Pattern[str], Action]] = field(default_factory=list)
    default: Action = field(default_factory=Replicate)

    def __post_init__(self) -> None:
        compiled = []
        for pattern, action in self.rules:
            rx = pattern if isinstance(pattern, re.Pattern) else re.compile(fnmatch.translate(pattern))
            compiled.append((rx, action))
        self._compiled = compiled

    def action(self, name: str) -> Action:
        for rx, action in self._compiled:
            if rx.match(name):
                return action
        return self.default


def llama_plan(
    config: Mapping[str, Any] | None = None,
    *,
    world_size: int | None = None,
    pad: bool = False,
) -> ShardingPlan:
    """The usual tensor-parallel layout of LLaMA-family checkpoints.

    q/k/v/gate/up projections are column-parallel (split dim 0 of the ``[out, in]`` weight,
    and their biases), o/down projections row-parallel (split dim 1), ``embed_tokens`` and
    ``lm_head`` along the vocabulary (dim 0), norms and everything else replicated.  With a
    ``config`` (Hugging Face ``config.json`` as a dict) and ``world_size``, grouped-query
    attention is handled: k/v are split by heads when the key/value heads divide evenly
    among the ranks, and replicated when there are fewer heads than ranks.  Fused
    ``qkv_proj`` and ``gate_up_proj`` tensors are described by their part sizes.
    """
    kv_split: Action = Split(0, pad)
    fused_qkv: Fused | None = None
    fused_gate_up: Fused | None = None
    if config is not None:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        replicate_kv = world_size is not None and kv_heads < world_size
        if replicate_kv:
            kv_split = Replicate()
        fused_qkv = Fused(0, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
                          (False, replicate_kv, replicate_kv))
        inter = int(config["intermediate_size"])
        fused_gate_up = Fused(0, (inter, inter))
    column = Split(0, pad)
    rules: list = [
        ("*.self_attn.q_proj.*", column),
        ("*.self_attn.k_proj.*", kv_split),
        ("*.self_attn.v_proj.*", kv_split),
        ("*.mlp.gate_proj.*", column),
        ("*.mlp.up_proj.*", column),
        ("*.self_attn.o_proj.weight", Split(1, pad)),
        ("*.mlp.down_proj.weight", Split(1, pad)),
        ("*embed_tokens.weight", Split(0, pad)),
        ("lm_head.weight", Split(0, pad)),
    ]
    if fused_qkv is not None:
        rules.append(("*.self_attn.qkv_proj.weight", fused_qkv))
        rules.append(("*.mlp.gate_up_proj.weight", fused_gate_up))
    return ShardingPlan(rules)


def _split_bounds(size: int, rank: int, world_size: int, pad: bool, what: str) -> tuple[int, int, int]:
    """(start, stop, padded part size) of ``rank``'s part of ``size`` entries."""
    if size % world_size and not pad:
        raise ShardingError(
            f"{what}: {size} entries do not split evenly into {world_size} ranks (ask for padding with pad=True)",
            reason="UnevenSplit",
        )
    part = -(-size // world_size)
    start = min(rank * part, size)
    return start, min(start + part, size), part


def shard_index(name: str, shape: Sequence[int], action: Action, rank: int, world_size: int):
    """The pieces of a tensor that ``rank`` gets.

    Returns
    -------
    list of (index, pad_to)
        ``index`` is a tuple of slices for :meth:`get_slice`; ``pad_to`` is the part size
        along the split dimension (larger than the slice only with padding).  Several pieces
        for a fused tensor, to be concatenated along its dimension.  ``[]`` never happens:
        a replicated tensor is one piece covering everything.
    """
    shape = tuple(shape)
    if isinstance(action, Replicate):
        return [((slice(None),) * len(shape), None)]
    if action.dim < -len(shape) or action.dim >= len(shape) or not shape:
        raise ShardingError(f"tensor {name!r} {list(shape)} has no dimension {action.dim} to split",
                            reason="InvalidDim", tensors=(name,))
    dim = action.dim % len(shape)
    if isinstance(action, Split):
        start, stop, part = _split_bounds(shape[dim], rank, world_size, action.pad, f"tensor {name!r} dim {dim}")
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
        return [(index, part if action.pad else None)]
    if sum(action.sizes) != shape[dim]:
        raise ShardingError(
            f"fused tensor {name!r}: parts {list(action.sizes)} do not add up to {shape[dim]} along dim {dim}",
            reason="InvalidFused", tensors=(name,),
        )
    pieces, offset = [], 0
    flags = action.replicate or (False,) * len(action.sizes)
    for size, replicated in zip(action.sizes, flags, strict=False):
        if replicated:
            start, stop = offset, offset + size
        else:
            a, b, _ = _split_bounds(size, rank, world_size, False, f"fused tensor {name!r} part of {size}")
            start, stop = offset + a, offset + b
        pieces.append((tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape))), None))
        offset += size
    return pieces


def _pad(t: torch.Tensor, dim: int, to: int | None) -> torch.Tensor:
    if to is None or t.shape[dim] == to:
        return t
    shape = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def _open(path, backend: str):
    """A file or a whole checkpoint, torch framework (see :mod:`engine.opener`)."""
    from .opener import safe_open

    return safe_open(os.fspath(path), framework="pt", backend=backend)


def _shard(f, name: str, action, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of tensor ``name`` of the open handle ``f``, read through a slice
    handle; packed sub-byte tensors, which cannot be sliced before they are read, are read
    whole and cut in memory (not along their packed last dimension)."""
    from .dtypes import BY_NAME

    sl = f.get_slice(name)
    shape = sl.get_shape()
    packed = BY_NAME[sl.get_dtype()].sub_byte
    source: Any = sl
    if packed:
        source = f.get_tensor(name)
        if isinstance(action, Replicate):
            return source
        if action.dim % len(shape) == len(shape) - 1:
            raise ShardingError(f"tensor {name!r}: a packed {sl.get_dtype()} tensor cannot be split along its "
                                f"last dimension", reason="InvalidSplit", tensors=(name,))
    elif isinstance(action, Replicate):
        return sl[...]
    parts = [_pad(source[index], action.dim, to) for index, to in shard_index(name, shape, action, rank, world_size)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=action.dim)
    return out.clone() if packed and len(parts) == 1 else out  # a view would keep the whole tensor alive


def _rank_world(rank, world_size, process_group):
    import torch.distributed as dist

    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ShardingError("give rank and world_size, or initialise torch.distributed first",
                                reason="NoProcessGroup")
        rank = dist.get_rank(process_group) if rank is None else rank
        world_size = dist.get_world_size(process_group) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is outside world size {world_size}", reason="InvalidRank")
    return rank, world_size


def load_tensor_parallel(
    path_or_index,
    plan: ShardingPlan,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    process_group=None,
    device: str | int | torch.device = "cpu",
    mode: str = "direct",
    names: Callable[[str], bool] | None = None,
    strided: str = "auto",
    threads: int | None = None,
    backend: str = "pread",
    copy: bool = True,
) -> dict[str, torch.Tensor]:
    """Load this rank's shard of every tensor of a checkpoint.

    Parameters
    ----------
    path_or_index : str or os.PathLike
        A ``.safetensors`` file, a ``model.safetensors.index.json`` or a directory holding one.
    plan : ShardingPlan
        E.g. :func:`llama_plan`.
    rank, world_size : int, optional
        Default: from ``torch.distributed`` (``process_group`` or the default group).
    device : default "cpu"
        Where the shards go ("cuda:N" on GPU servers; one host-to-device copy per shard).
    mode : {"direct", "broadcast"}
        ``"direct"``: each rank reads only its own bytes (see ``backend``).
        ``"broadcast"``: the first rank of each node reads every tensor once and hands out
        shards with ``scatter`` (split tensors) and ``broadcast`` (replicated ones); needs an
        initialised process group.  Node membership comes from ``LOCAL_WORLD_SIZE`` as set by
        torchrun (default: one node).
    names : callable, optional
        ``names(name) -> bool`` keeps only some tensors.
    strided : {"auto", "runs", "spans"}, default "auto"
        How a direct-mode rank reads a column block (a split along a dimension other than
        the first: one short run per row).  ``"runs"``: one read per run, exactly the
        shard's bytes.  ``"spans"``: one read per dense span of rows into a small bounce
        buffer (``SPAN_BOUNCE_BYTES``), the runs gathered from it: the rank also reads the
        bytes between its runs (for a split along the last dimension, about the whole
        tensor less the columns before its own in the first row and after them in the
        last), in hundreds of times fewer calls.  ``"auto"``: spans when the runs are
        shorter than ``SPAN_MAX_RUN_BYTES`` and the span is at most ``SPAN_MAX_RATIO``
        times the bytes wanted, runs otherwise; :func:`direct_read_bytes` says what a rank
        reads either way.
    threads : int, optional
        Reader threads per rank in direct mode (default: one per core, 2 to 8); the
        tensors are shared among them in file order, so several reads are in flight.
    backend : {"pread", "mmap"}, default "pread"
        Direct mode: how the bytes leave the page cache.  ``"pread"``:
        positional reads, and a file truncated during the load raises ``ReadError``.
        ``"mmap"``: copied out of a read-only mapping (column blocks gathered with one
        strided copy, ``strided`` unused), which can be faster on a warm page cache; as
        with ``safe_open(..., backend="mmap")``, a file truncated during the load then
        ends the process with ``SIGBUS``.
    copy : bool, default True
        ``False`` (with ``backend="mmap"``, direct mode): a shard that is one
        contiguous range of the file (a replicated tensor, a block of rows) is handed out
        as a view of a private copy-on-write mapping, with its own storage, as
        ``safe_open(..., framework="pt")`` hands out tensors: no copy on the CPU, and on a
        GPU one copy straight from the page cache.  Column blocks, padded and fused shards
        are copied as with ``True``.  The pages are read when first touched, and a file
        truncated while such a shard is alive ends the process with ``SIGBUS``.

    Returns
    -------
    dict of str to torch.Tensor
        This rank's shards, contiguous, on ``device``.

    Raises
    ------
    ShardingError
        Uneven splits without padding, a split of a missing dimension, bad fused sizes.

    Notes
    -----
    Copies of tensor bytes, direct mode: 0 for the shards ``copy=False`` maps, else 1 per
    byte (page cache to the shard), 2 for the
    column blocks read as spans (page cache to the bounce buffer, which stays in the CPU
    cache, then to the shard), plus the host-to-device copy for CUDA; fused tensors split
    along a dimension other than the first, and padding along one, one more (the
    concatenation).  Each file (one, or each shard file of a sharded checkpoint in turn) is
    read by this rank's own threads into host memory and then moved to ``device``, so peak
    host memory there is the rank's shard of one file.  Broadcast mode adds the collective's
    transfer; its peak host memory on the reading rank is one whole tensor at a time.
    """
    if mode not in ("direct", "broadcast"):
        raise ShardingError(f"unknown mode {mode!r}; expected 'direct' or 'broadcast'", reason="InvalidMode")
    if strided not in _STRIDED:
        raise ShardingError(f"unknown strided {strided!r}; expected one of {_STRIDED}", reason="InvalidMode")
    if backend not in ("pread", "mmap"):
        raise ShardingError(f"unknown backend {backend!r}; expected 'pread' or 'mmap'", reason="InvalidMode")
    if not copy and (backend != "mmap" or mode != "direct"):
        raise ShardingError("copy=False needs backend='mmap' and mode='direct'", reason="InvalidMode")
    rank, world_size = _rank_world(rank, world_size, process_group)
    device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if mode == "broadcast":
        return _load_broadcast(path_or_index, plan, rank, world_size, process_group, device, names)
    files = _direct_files(path_or_index, names)

    def load(some: list[_DirectFile]) -> dict[str, torch.Tensor]:
        return _load_files_direct(some, plan, rank, world_size, "runs" if backend == "mmap" else strided, threads,
                                  mapped=backend == "mmap", views=not copy)

    out: dict[str, torch.Tensor] = {}
    if device.type == "cpu":
        # files planned together and read by one set of threads, up to _FILES_AT_ONCE open at a time
        for i in range(0, len(files), _FILES_AT_ONCE):
            out.update(load(files[i : i + _FILES_AT_ONCE]))
        return out
    for file in files:  # one file at a time to the device: host memory holds one file's shards at most
        out.update({k: v.to(device) for k, v in load([file]).items()})
    return out


class _DirectFile(NamedTuple):
    """One file of a direct load, the ``names`` filter for it, and its header where the
    checkpoint's index check has read it already."""

    path: str
    names: Callable[[str], bool] | None
    header: Any = None


def _direct_files(path_or_index, names: Callable[[str], bool] | None) -> list[_DirectFile]:
    """The files a direct load reads: the file itself, or each shard file of a checkpoint
    keeping the tensors the index puts in it (index checked against the shards' headers,
    which come along so that no header is parsed twice)."""
    path = os.fspath(path_or_index)
    if not is_checkpoint_path(path):
        return [_DirectFile(path, names)]
    from .checkpoint import read_checkpoint_info

    info = read_checkpoint_info(path)
    return [_DirectFile(info.shard_path(shard), _in_shard(info.weight_map, shard, names), info.headers[shard])
            for shard in info.shards]


def _in_shard(weight_map: Mapping[str, str], shard: str, names: Callable[[str], bool] | None) -> Callable[[str], bool]:
    """A ``names`` filter for one shard file: the tensors the index puts in it (and ``names``)."""
    return lambda name: weight_map.get(name) == shard and (names is None or names(name))


_STRIDED = ("auto", "runs", "spans")
#: Shard files a CPU load keeps open (and planned) at once: a checkpoint of hundreds of small
#: shards must not run the process out of file descriptors.
_FILES_AT_ONCE = 64
#: A mapped copy maps its whole span in one call when the gaps between its runs average at
#: most this (a fault's read-ahead window); else the runs fault their own pages in.
_POPULATE_MAX_GAP = 128 << 10
#: Bounce buffer per reader thread for column blocks read as dense spans: fits in a core's
#: L2 cache next to the rows being copied out of it.
SPAN_BOUNCE_BYTES = 1 << 20
#: "auto" reads a column block as spans only when its runs are shorter than this...
SPAN_MAX_RUN_BYTES = 16 << 10
#: ...and the spans hold at most this many times the bytes the rank wants.
SPAN_MAX_RATIO = 8
#: Contiguous reads are cut into requests of this size, shared among the threads.
_CHUNK_BYTES = 8 << 20


class _Job(NamedTuple):
    """One read of a rank's direct load: runs ``src`` of ``run_bytes`` at file offset ``base``
    into ``dst`` (bytes), end to end; ``spans`` reads them through the bounce buffer."""

    dst: memoryview
    src: Any  # numpy int64 offsets, relative to ``base``
    run_bytes: int
    base: int
    spans: bool


class _MappedView(NamedTuple):
    """A shard that is one contiguous range of the file, handed out as a view of the mapping."""

    code: int
    shape: tuple
    offset: int  # absolute, in the file
    nbytes: int


def _direct_jobs(header, plan: ShardingPlan, rank: int, world_size: int, names, strided: str,
                 views: bool = False):
    """(name -> output tensor or, with ``views``, a :class:`_MappedView` for each shard that
    is one contiguous range of the file; jobs; names to load the slow way) for a direct load
    of one file."""
    import numpy as np

    from . import dtypes
    from .plan import plan_slice

    t = header.table
    outputs: dict[str, Any] = {}  # tensors, and _MappedView where views are asked for
    jobs: list[_Job] = []
    slow: list[str] = []
    codes, begins = t.codes.tolist(), t.begins.tolist()  # not a numpy scalar per tensor
    for row in t.file_order():
        name = t.names[row]
        if names is not None and not names(name):
            continue
        code = codes[row]
        d = dtypes.DTYPES[code]
        shape = tuple(t.shapes[row])
        action = plan.action(name)
        pieces = shard_index(name, shape, action, rank, world_size)
        begin = header.data_start + begins[row]
        if isinstance(action, Replicate):
            if d.sub_byte:
                slow.append(name)
                continue
            out_shape = shape
        else:
            dim = action.dim % len(shape)
            # pieces that land end to end in the output: one piece, or several stacked along dim 0;
            # padding only after the last piece along dim 0
            if d.sub_byte or (dim != 0 and (len(pieces) > 1 or pieces[0][1] is not None)):
                slow.append(name)
                continue
            out_shape = _shard_shape(shape, action, pieces)
        plans = [plan_slice(shape, d.itemsize, index) for index, _ in pieces]
        if views and len(pieces) == 1 and pieces[0][1] is None and plans[0].src.size <= 1:
            # one range of the file (or nothing): no bytes to move
            sp = plans[0]
            at = int(sp.src[0]) if sp.src.size else 0
            outputs[name] = _MappedView(code, tuple(out_shape), begin + at, sp.nbytes)
            continue
        out = (torch.zeros if any(to is not None for _, to in pieces) else torch.empty)(
            out_shape, dtype=dtypes.torch_dtype(code))
        outputs[name] = out
        raw = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        at = 0
        for sp in plans:
            nbytes = sp.nbytes
            if not nbytes:
                continue
            dst = raw[at : at + nbytes]
            at += nbytes
            if sp.src.size == 1 or sp.run_bytes * 2 >= _CHUNK_BYTES:
                # contiguous, or long runs: requests of about _CHUNK_BYTES
                per = max(1, _CHUNK_BYTES // sp.run_bytes) if sp.src.size > 1 else 1
                if sp.src.size == 1:
                    for lo in range(0, nbytes, _CHUNK_BYTES):
                        hi = min(lo + _CHUNK_BYTES, nbytes)
                        jobs.append(_Job(dst[lo:hi], np.array([sp.src[0] + lo], np.int64), hi - lo, begin, False))
                else:
                    for i in range(0, sp.src.size, per):
                        part = sp.src[i : i + per]
                        jobs.append(_Job(dst[i * sp.run_bytes : (i + part.size) * sp.run_bytes], part,
                                         sp.run_bytes, begin, False))
                continue
            spans = strided == "spans" or (strided == "auto" and _spans_pay(sp.src, sp.run_bytes))
            # a share of rows per job, a few bounce buffers' worth, so threads split a tensor
            stride = int(sp.src[1] - sp.src[0]) if sp.src.size > 1 else sp.run_bytes
            per = max(1, (4 * SPAN_BOUNCE_BYTES) // max(stride, sp.run_bytes))
            for i in range(0, sp.src.size, per):
                part = sp.src[i : i + per]
                jobs.append(_Job(dst[i * sp.run_bytes : (i + part.size) * sp.run_bytes], part, sp.run_bytes,
                                 begin, spans))
    return outputs, jobs, slow


def _copy_mapped(source, job: _Job) -> None:
    """Copy a job's runs out of the mapped file ``source`` (uint8) into ``job.dst``: one
    strided copy when the runs are evenly spaced (a column block), else run by run.  numpy
    releases the GIL for the copy."""
    import numpy as np

    from .reader import populate_mapping

    dst = np.frombuffer(job.dst, np.uint8)
    n, run = job.src.size, job.run_bytes
    first = job.base + int(job.src[0])
    last = job.base + int(job.src[-1]) + run
    if n == 1 or (last - first) - n * run <= _POPULATE_MAX_GAP * (n - 1):
        # the pages the copy touches, mapped in one call rather than one fault each (the
        # gaps between runs are short: the kernel's read-ahead would read them anyway)
        populate_mapping(source, first, last)
    if n == 1:
        dst[:] = source[first : first + run]
        return
    steps = np.diff(job.src)
    if (steps == steps[0]).all() and steps[0] >= run:
        rows = np.lib.stride_tricks.as_strided(source[first:], shape=(n, run), strides=(int(steps[0]), 1),
                                               writeable=False)
        dst.reshape(n, run)[...] = rows
        return
    for i, off in enumerate(job.src.tolist()):
        lo = job.base + off
        dst[i * run : (i + 1) * run] = source[lo : lo + run]


def _spans_pay(src, run_bytes: int) -> bool:
    """Whether "auto" reads these runs as dense spans: short runs, spans not much larger."""
    from .reader import spans_bytes

    if run_bytes >= SPAN_MAX_RUN_BYTES or src.size < 2:
        return False
    return spans_bytes(src, run_bytes, SPAN_BOUNCE_BYTES) <= SPAN_MAX_RATIO * run_bytes * src.size


def direct_read_bytes(path, plan: ShardingPlan, *, rank: int, world_size: int, strided: str = "auto",
                      names: Callable[[str], bool] | None = None) -> int:
    """Bytes of tensor data one rank's direct-mode load of a file or a sharded checkpoint
    reads (the headers aside): its shard exactly with ``strided="runs"``, more where column
    blocks are read as spans.  From the headers alone; reads no tensor byte."""
    from .header import read_header
    from .reader import spans_bytes

    if strided not in _STRIDED:
        raise ShardingError(f"unknown strided {strided!r}; expected one of {_STRIDED}", reason="InvalidMode")
    total = 0
    for file, keep, header in _direct_files(path, names):
        _, jobs, slow = _direct_jobs(header if header is not None else read_header(file), plan, rank, world_size, keep, strided)
        if slow:
            raise ShardingError(f"{len(slow)} tensor(s) are read the slow way; no byte count for them",
                                reason="InvalidMode", tensors=tuple(slow), path=file)
        total += sum(spans_bytes(j.src, j.run_bytes, SPAN_BOUNCE_BYTES) if j.spans else j.src.size * j.run_bytes
                     for j in jobs)
    return total


class _FileLoad:
    """One file of a direct load: its descriptor and header, this rank's outputs (views made
    here), its planned jobs and, for mapped copies, the mapping they read."""

    def __init__(self, file: _DirectFile, plan: ShardingPlan, rank: int, world_size: int, strided: str,
                 mapped: bool, views: bool) -> None:
        from ._files import open_regular
        from .header import read_header_fd

        path, names, header = file
        self.path = path
        self.fd = open_regular(path)  # a FIFO or device is refused, never waited on
        try:
            size = os.fstat(self.fd).st_size
            if header is None or header.file_size != size:
                # not read yet, or the file changed since: read the header of the file now open
                header = read_header_fd(self.fd, path=path, file_size=size)
            self.header = header
            self.outputs, self.jobs, self.slow = _direct_jobs(self.header, plan, rank, world_size, names, strided,
                                                              views)
            wanted = {n: v for n, v in self.outputs.items() if isinstance(v, _MappedView)}
            mm = None
            if wanted:
                from .sinks import map_file
                from .sinks.torch import TorchSink

                # a private (copy-on-write) mapping, as safe_open(..., framework="pt") makes: the
                # shards are writable, and writes never reach the file; the copies below read it too
                sink = TorchSink()
                mm = map_file(sink, self.fd)
                base = sink.map(mm)
                for n, v in wanted.items():
                    self.outputs[n] = sink.view(base, v.code, v.shape, v.offset, v.nbytes)
            self.source = None
            if mapped and self.jobs:
                import mmap

                import numpy as np

                if mm is None:
                    mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                self.source = np.frombuffer(mm, np.uint8)
        except BaseException:
            os.close(self.fd)
            raise

    def run(self, job: _Job, bounce: list) -> None:
        """Do one job; ``bounce`` holds the calling thread's span buffer once it has one."""
        from .reader import pread_into, pread_runs, pread_spans

        if self.source is not None:
            _copy_mapped(self.source, job)
        elif job.src.size == 1:
            pread_into(self.fd, job.base + int(job.src[0]), [job.dst], path=self.path)
        elif job.spans:
            if not bounce:
                bounce.append(bytearray(SPAN_BOUNCE_BYTES))
            pread_spans(self.fd, job.dst, job.src, job.run_bytes, job.base, bounce[0], path=self.path)
        else:
            pread_runs(self.fd, job.dst, job.src, job.run_bytes, job.base, path=self.path)

    def finish(self, plan: ShardingPlan, rank: int, world_size: int) -> dict[str, torch.Tensor]:
        """The outputs, the tensors planned the slow way added, in file order."""
        if self.slow:
            with _open(self.path, "pread") as f:
                for name in self.slow:
                    self.outputs[name] = _shard(f, name, plan.action(name), rank, world_size)
        order = {n: i for i, n in enumerate(self.header.offset_keys())}
        return dict(sorted(self.outputs.items(), key=lambda kv: order[kv[0]]))

    def close(self) -> None:
        os.close(self.fd)


def _load_files_direct(files: list[_DirectFile], plan: ShardingPlan, rank: int, world_size: int,
                       strided: str, threads: int | None, mapped: bool = False,
                       views: bool = False) -> dict[str, torch.Tensor]:
    """Direct mode on ``files``: every read of this rank in every
    file planned up front, then shared among one set of threads in file order (several reads
    in flight), column blocks by runs or spans, or (``mapped``) copied out of a read-only
    mapping; with ``views`` (and ``mapped``), shards that are one range of a file are views
    of a private mapping instead.  The outputs come file by file, in file order."""
    import threading

    from .reader import default_threads, run_threads

    loads: list[_FileLoad] = []
    try:
        for file in files:
            loads.append(_FileLoad(file, plan, rank, world_size, strided, mapped, views))
        items = [(load, job) for load in loads for job in load.jobs]
        todo = iter(items)
        lock = threading.Lock()

        def work() -> None:
            bounce: list = []
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                item[0].run(item[1], bounce)

        if items:
            run_threads([work] * min(threads or default_threads(), len(items)), name="engine-tp")
        out: dict[str, torch.Tensor] = {}
        for load in loads:
            out.update(load.finish(plan, rank, world_size))
        return out
    finally:
        for load in loads:
            load.close()


def _node_group(world_size: int, process_group):
    """(group of this node, global rank of its reader) from LOCAL_WORLD_SIZE."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local >= world_size or world_size % local:
        return process_group, 0
    me = dist.get_rank(process_group)
    mine = None
    for node in range(world_size // local):
        ranks = list(range(node * local, (node + 1) * local))
        group = dist.new_group(ranks)  # every rank must create every group, in the same order
        if me in ranks:
            mine = (group, ranks[0])
    return mine


def _load_broadcast(path, plan, rank, world_size, process_group, device, names):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ShardingError("mode='broadcast' needs an initialised torch.distributed", reason="NoProcessGroup")
    group, reader = _node_group(world_size, process_group)
    local_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    local_rank = local_ranks.index(dist.get_rank())
    comm_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    # collectives move raw bytes (uint8): see _bytes_of
    out: dict[str, torch.Tensor] = {}
    handle = _open(path, "pread") if dist.get_rank() == reader else None
    try:
        # every rank walks the same tensors in the same order; the reader reuses its open handle
        keys, shapes, dtype_of = _catalogue(handle if handle is not None else path)
        for name in keys:
            if names is not None and not names(name):
                continue
            action = plan.action(name)
            shape, dt = shapes[name], dtype_of[name]
            pieces_of = [shard_index(name, shape, action, r, len(local_ranks)) for r in range(len(local_ranks))]
            whole = handle.get_tensor(name).to(comm_device) if handle is not None else None
            if isinstance(action, Replicate):
                buf = _bytes_of(whole) if whole is not None else torch.empty(
                    _nbytes(shape, dt), dtype=torch.uint8, device=comm_device)
                dist.broadcast(buf, src=reader, group=group)
                out[name] = buf.view(dt).view(shape).to(device)
                continue
            mine_shape = _shard_shape(shape, action, pieces_of[local_rank])
            recv = torch.empty(_nbytes(mine_shape, dt), dtype=torch.uint8, device=comm_device)
            scatter_list = None
            if whole is not None:
                scatter_list = [_bytes_of(_assemble(whole, action, pieces)) for pieces in pieces_of]
            dist.scatter(recv, scatter_list, src=reader, group=group)
            out[name] = recv.view(dt).view(mine_shape).to(device)
    finally:
        if handle is not None:
            handle.close()
    return out


def _catalogue(source):
    """(names in file order, name -> shape, name -> torch dtype) of a path or an open handle."""
    from . import dtypes

    opened = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not is_checkpoint_path(path):
            from .header import read_header

            header = read_header(path)
            keys = header.offset_keys()
            return keys, {k: header[k].shape for k in keys}, {k: dtypes.torch_dtype(header[k].code) for k in keys}
        source = opened = _open(path, "mmap")
    try:
        keys = source.offset_keys()
        slices = {k: source.get_slice(k) for k in keys}
        shapes = {k: tuple(sl.get_shape()) for k, sl in slices.items()}
        dts = {k: dtypes.torch_dtype(dtypes.code_of(sl.get_dtype())) for k, sl in slices.items()}
        return keys, shapes, dts
    finally:
        if opened is not None:
            opened.close()


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor: collectives move bytes, so every dtype
    works on every backend (gloo has no bfloat16 or float8)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(shape, dt) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dt).element_size()


def _shard_shape(shape, action, pieces):
    dim = action.dim % len(shape)
    out = list(shape)
    total = 0
    for index, to in pieces:
        s = index[dim]
        total += to if to is not None else s.stop - s.start
    out[dim] = total
    return tuple(out)


def _assemble(whole: torch.Tensor, action, pieces) -> torch.Tensor:
    parts = [_pad(whole[index], action.dim, to) for index, to in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=action.dim)
