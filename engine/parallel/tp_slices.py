"""Tensor-parallel shards read through ``safe_open``'s slice handles: the general way, for
what the planned direct reads (:mod:`engine.parallel.tp_direct`) do not cover (packed sub-byte
tensors, column blocks of fused tensors) and for the reader of broadcast mode.

Importing this module imports torch.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.errors import ShardingError
from engine.planning.sharding_plan import Replicate, shard_index

__all__ = ["open_torch", "shard_of", "pad"]


def pad(t: torch.Tensor, dim: int, to: int | None) -> torch.Tensor:
    if to is None or t.shape[dim] == to:
        return t
    shape = list(t.shape)
    shape[dim] = to - t.shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=dim)


def open_torch(path, backend: str, remote=None):
    """A file or a whole checkpoint, torch framework (see :mod:`engine.apps.opener`); ``remote``,
    a URL's options (headers, timeout, cache_dir ...)."""
    from engine.apps.opener import safe_open

    return safe_open(os.fspath(path), framework="pt", backend=backend, **(remote or {}))


def shard_of(f, name: str, action, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of tensor ``name`` of the open handle ``f``, read through a slice
    handle; packed sub-byte tensors, which cannot be sliced before they are read, are read
    whole and cut in memory (not along their packed last dimension)."""
    from engine.base.dtypes import BY_NAME

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
    parts = [pad(source[index], action.dim, to) for index, to in shard_index(name, shape, action, rank, world_size)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=action.dim)
    return out.clone() if packed and len(parts) == 1 else out  # a view would keep the whole tensor alive
