"""Tensor-parallel loading, broadcast mode: the ranks of each node read the checkpoint once
between them, as a group load does (:func:`engine.apps.group_load.stream`: each rank an equal
share of each round of whole tensors, sent to the others round by round), and each rank keeps
only its shard of every tensor, the rounds' two blocks reused as each round is cut.  On a gloo
group the rounds land in host blocks; on an NCCL group (CUDA tensors) in device blocks, the
shares sent between the GPUs over NCCL.

Copies: the read or the collective's receive into the block, the cut into the shard, and
``.to(device)`` where the device is not the CPU (on the host path); on the device path, the
reader's share up to the device block, then the cut on the device.

Importing this module imports torch.
"""

from __future__ import annotations

import torch

from engine.errors import ShardingError
from engine.parallel.tp_slices import pad
from engine.planning.sharding_plan import Replicate, shard_index

__all__ = ["load_broadcast"]


def _node_group(world_size: int, process_group):
    """The group of this rank's node within ``process_group``, in its backend.

    Nodes are found by host name (one ``all_gather_object`` over a gloo group of the ranks),
    not by ``LOCAL_WORLD_SIZE`` or contiguous ranks, which SLURM's ``srun`` and ``mpirun`` do
    not give; a node's group is made once, by its members alone (``group_load._subgroup``)."""
    import socket

    import torch.distributed as dist

    from engine.apps.group_load import _gloo_of, _subgroup

    control = _gloo_of(process_group)
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=control)
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else list(range(world_size))
    me = ranks[dist.get_rank(process_group)]
    node = tuple(r for r, h in zip(ranks, hosts, strict=True) if h == hosts[ranks.index(me)])
    return _subgroup(process_group, list(node), dist.get_backend(process_group))


def load_broadcast(path, plan, rank, world_size, process_group, device, names, remote=None):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ShardingError("mode='broadcast' needs an initialised torch.distributed", reason="NoProcessGroup")
    group = _node_group(dist.get_world_size(process_group), process_group)
    local_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
    local_rank = local_ranks.index(dist.get_rank())
    from engine.apps.group_load import stream

    meta: dict = {}  # name -> (dtype, the file's shape), filled before the first tensor comes
    out: dict[str, torch.Tensor] = {}
    for name, whole in stream(path, group, framework="pt", _select=names, _release=True, _meta=meta,
                              _device=torch.device(device), **(remote or {})):
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
