"""Tensor-parallel loading, broadcast mode: the ranks of each node read the checkpoint once
between them, as a group load does (:func:`engine.apps.group_load.stream`: each rank an equal
share of each round of whole tensors, sent to the others round by round), and each rank keeps
only its shard of every tensor, the rounds' two blocks reused as each round is cut.  Over NCCL (device
tensors) the node's first rank reads every tensor and hands the shards out with ``scatter``
and ``broadcast``, one collective per tensor, moving raw bytes so that every dtype works.

Copies on the gloo path: the read or the collective's receive into the block, the cut into
the shard, and ``.to(device)`` where the device is not the CPU.

Importing this module imports torch.
"""

from __future__ import annotations

import os

import torch

from engine.apps.opener import is_checkpoint_path
from engine.base._files import is_url
from engine.errors import ShardingError
from engine.parallel.tp_slices import open_torch, pad
from engine.planning.sharding_plan import Replicate, shard_index, shard_shape

__all__ = ["load_broadcast"]


#: backends whose collectives take device tensors: the reader hands each tensor's shards out
PER_TENSOR_BACKENDS = frozenset({"nccl"})

#: node-local groups made so far: (the group's name, the node's global ranks) -> group
_NODES: dict[tuple[str, tuple[int, ...]], object] = {}


def _node_group(world_size: int, process_group):
    """(the group of this rank's node within ``process_group``, the global rank of its reader).

    Nodes are found by host name (one ``all_gather_object`` over a gloo group of the ranks),
    not by ``LOCAL_WORLD_SIZE`` or contiguous ranks, which SLURM's ``srun`` and ``mpirun`` do
    not give; a node's group is made once, by its members alone; the reader is the node's first
    rank, as a global rank."""
    import socket

    import torch.distributed as dist

    from engine.apps.group_load import _gloo_of

    control = _gloo_of(process_group)
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=control)
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else list(range(world_size))
    me = ranks[dist.get_rank(process_group)]
    node = tuple(r for r, h in zip(ranks, hosts, strict=True) if h == hosts[ranks.index(me)])
    if len(node) == len(ranks):
        return process_group, ranks[0]
    name = dist._get_process_group_name(process_group) if process_group is not None else "default"
    if (name, node) not in _NODES:
        _NODES[name, node] = dist.new_group(list(node), backend=dist.get_backend(process_group),
                                            use_local_synchronization=True)
    return _NODES[name, node], node[0]


def load_broadcast(path, plan, rank, world_size, process_group, device, names, remote=None):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ShardingError("mode='broadcast' needs an initialised torch.distributed", reason="NoProcessGroup")
    group, reader = _node_group(dist.get_world_size(process_group), process_group)
    local_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    local_rank = local_ranks.index(dist.get_rank())
    if dist.get_backend(group) in PER_TENSOR_BACKENDS:
        return _per_tensor(path, plan, group, reader, local_ranks, local_rank, device, names, remote)
    from engine.apps.group_load import stream

    meta: dict = {}  # name -> (dtype, the file's shape), filled before the first tensor comes
    out: dict[str, torch.Tensor] = {}
    for name, whole in stream(path, group, framework="pt", _select=names, _release=True, _meta=meta, **(remote or {})):
        out[name] = _shard(whole, name, meta[name][1], plan.action(name), local_rank, len(local_ranks)).to(device)
    return out


def _shard(whole: torch.Tensor, name: str, shape, action, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of ``whole`` (a view of a group load's block, given back once this
    returns) as a tensor of its own memory; ``shape``: the file's, which a packed sub-byte
    tensor's is not (it is cut along its rows only)."""
    if isinstance(action, Replicate):
        return whole.clone()
    if tuple(whole.shape) != tuple(shape) and action.dim % len(shape) == len(shape) - 1:
        raise ShardingError(f"tensor {name!r}: a packed sub-byte tensor cannot be split along its last dimension",
                            reason="InvalidSplit", tensors=(name,))
    parts = [pad(whole[index], action.dim, to) for index, to in shard_index(name, shape, action, rank, world)]
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=action.dim)


def _per_tensor(path, plan, group, reader, local_ranks, local_rank, device, names, remote):
    """Broadcast mode over NCCL: the node's first rank reads each tensor and scatters its
    shards from the device, one collective per tensor (the group load is host-side for now)."""
    import hashlib

    import torch.distributed as dist

    from engine.apps.group_load import _gloo_of, agree

    control = _gloo_of(group)  # the agreements, on host tensors
    out: dict[str, torch.Tensor] = {}
    handle = None
    try:
        try:  # every rank walks the same tensors in the same order; the reader reuses its open handle
            handle = open_torch(path, "pread", remote) if dist.get_rank() == reader else None
            keys, shapes, dtype_of = _catalogue(handle if handle is not None else path, remote)
            text = "|".join(f"{k}:{tuple(shapes[k])}:{dtype_of[k]}" for k in keys)
            fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
        except BaseException as exc:
            agree(control, path, exc)
            raise
        agree(control, path, None, fingerprint)
        for name in keys:
            if names is not None and not names(name):
                continue
            action = plan.action(name)
            shape, dt = shapes[name], dtype_of[name]
            pieces_of = [shard_index(name, shape, action, r, len(local_ranks)) for r in range(len(local_ranks))]
            failed = whole = None
            try:  # each rank's part of the step; the collective only once every rank's is done
                whole = handle.get_tensor(name).to(device) if handle is not None else None
                if isinstance(action, Replicate):
                    buf = _bytes_of(whole) if whole is not None else torch.empty(
                        _nbytes(shape, dt), dtype=torch.uint8, device=device)
                else:
                    mine_shape = shard_shape(shape, action, pieces_of[local_rank])
                    recv = torch.empty(_nbytes(mine_shape, dt), dtype=torch.uint8, device=device)
                    scatter_list = None
                    if whole is not None:
                        scatter_list = [_bytes_of(_assemble(whole, action, pieces)) for pieces in pieces_of]
            except BaseException as exc:
                failed = exc
            agree(control, path, failed)
            if isinstance(action, Replicate):
                dist.broadcast(buf, src=reader, group=group)
                out[name] = buf.view(dt).view(shape)
                continue
            dist.scatter(recv, scatter_list, src=reader, group=group)
            out[name] = recv.view(dt).view(mine_shape)
    finally:
        if handle is not None:
            handle.close()
    return out


def _catalogue(source, remote=None):
    """(names in file order, name -> shape, name -> torch dtype) of a path or an open handle."""
    from engine.base import dtypes

    opened = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not is_url(path) and not is_checkpoint_path(path):
            from engine.format.header import read_header

            header = read_header(path)
            keys = header.offset_keys()
            return keys, {k: header[k].shape for k in keys}, {k: dtypes.torch_dtype(header[k].code) for k in keys}
        source = opened = open_torch(path, "mmap", remote)
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


def _assemble(whole: torch.Tensor, action, pieces) -> torch.Tensor:
    parts = [pad(whole[index], action.dim, to) for index, to in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=action.dim)
