"""Tensor-parallel loading on ``torch.distributed``: every rank reads only its own shard.

A :class:`ShardingPlan` says, per tensor name, whether a tensor is replicated or split along
a dimension into ``world_size`` equal parts (fused tensors such as ``qkv_proj`` split part
by part).  :func:`load_tensor_parallel` then reads, on each rank, only the bytes of that
rank's shard of each tensor: a block of rows is one contiguous range, a block of columns is a
set of strided ranges, both read by the threaded reader.  For shared storage that is slow
under many parallel readers, ``mode="broadcast"`` reads the checkpoint once per node, the
node's ranks each reading a share of every round and exchanging them as a group load does.

The plans are in :mod:`engine.planning.sharding_plan`, the direct reads in :mod:`engine.parallel.tp_direct`,
broadcast mode in :mod:`engine.parallel.tp_broadcast` and reads through ``safe_open``'s slices in
:mod:`engine.parallel.tp_slices`; their public names are importable from here.

Importing this module imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.errors import MissingDependencyError as _Missing

try:
    import torch
except ModuleNotFoundError as _exc:  # the ``torch`` extra
    raise _Missing.of(_exc, "engine.distributed (tensor-parallel loading on torch.distributed)") from None

from engine.base._files import is_url
from engine.errors import ShardingError
from engine.parallel.tp_broadcast import load_broadcast
from engine.parallel.tp_direct import STRIDED, DirectFile, direct_files, direct_read_bytes, load_files_direct
from engine.planning.sharding_plan import Fused, Replicate, ShardingPlan, Split, llama_plan, shard_index

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

#: Shard files a CPU load keeps open (and planned) at once: a checkpoint of hundreds of small
#: shards must not run the process out of file descriptors.
_FILES_AT_ONCE = 64


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
    **remote,
) -> dict[str, torch.Tensor]:
    """Load this rank's shard of every tensor of a checkpoint.

    Parameters
    ----------
    path_or_index : str or os.PathLike
        A ``.safetensors`` file, a ``model.safetensors.index.json`` or a directory holding one;
        or an ``http(s)://``, ``s3://`` or fsspec URL of a file, an index or a prefix, from
        which each rank requests only its own byte ranges (:mod:`engine.parallel.tp_remote`;
        ``threads`` is then the number of connections, ``backend`` and ``strided`` do not
        apply).
    plan : ShardingPlan
        E.g. :func:`llama_plan`.
    rank, world_size : int, optional
        Default: from ``torch.distributed`` (``process_group`` or the default group).
    device : default "cpu"
        Where the shards go ("cuda:N" on GPU servers; one host-to-device copy per shard).
    mode : {"direct", "broadcast"}
        ``"direct"``: each rank reads only its own bytes (see ``backend``).
        ``"broadcast"``: the ranks of each node read the checkpoint once between them and
        exchange it round by round (:mod:`engine.apps.group_load`; on an NCCL group between
        device blocks, the tensors on ``device``), each keeping its shard; needs an initialised
        process group.  Nodes are found by host name.
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
    **remote
        For a URL only, the options :func:`engine.torch.load_file` takes for one:
        ``headers``, ``timeout``, ``retry``, ``max_redirects``, ``s3``, ``storage_options``,
        ``cache_dir``, ``max_header_size``, ``max_shards`` (see
        :func:`engine.urls.remote_load.stream`); ``connections`` is ``threads``.  With
        ``cache_dir``, a rank that receives every byte of a file keeps its copy, and a later
        load reads the copies.

    Returns
    -------
    dict of str to torch.Tensor
        This rank's shards, contiguous, on ``device``.

    Raises
    ------
    ShardingError
        Uneven splits without padding, a split of a missing dimension, bad fused sizes.
    TypeError
        Remote options with a local path, or an option no load takes.

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
    if strided not in STRIDED:
        raise ShardingError(f"unknown strided {strided!r}; expected one of {STRIDED}", reason="InvalidMode")
    if backend not in ("pread", "mmap"):
        raise ShardingError(f"unknown backend {backend!r}; expected 'pread' or 'mmap'", reason="InvalidMode")
    if not copy and (backend != "mmap" or mode != "direct"):
        raise ShardingError("copy=False needs backend='mmap' and mode='direct'", reason="InvalidMode")
    url = is_url(path_or_index)
    if remote and not url:  # a URL's options are checked where the URL is opened
        raise TypeError(f"load_tensor_parallel() got options for a URL with a local path: {sorted(remote)}")
    rank, world_size = _rank_world(rank, world_size, process_group)
    device = torch.device(device if not isinstance(device, int) else f"cuda:{device}")
    if mode == "broadcast":
        return load_broadcast(path_or_index, plan, rank, world_size, process_group, device, names, remote)
    if url:  # each rank requests only its own byte ranges
        from engine.parallel.tp_remote import load_remote_direct

        return load_remote_direct(path_or_index, plan, rank, world_size, device=device, names=names,
                                  connections=threads, **remote)
    files = direct_files(path_or_index, names)

    def load(some: list[DirectFile]) -> dict[str, torch.Tensor]:
        return load_files_direct(some, plan, rank, world_size, "runs" if backend == "mmap" else strided, threads,
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
