"""Tensor-parallel sharding plans: per tensor name, whether a tensor is replicated or split
along a dimension into ``world_size`` equal parts (fused tensors such as ``qkv_proj`` split
part by part), and which index of a tensor each rank holds (:func:`shard_index`).

Plain Python, no torch: :mod:`engine.distributed` loads what a plan says.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.errors import ShardingError

__all__ = ["Replicate", "Split", "Fused", "Action", "ShardingPlan", "llama_plan", "shard_index", "shard_shape"]


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


def shard_shape(shape, action, pieces):
    dim = action.dim % len(shape)
    out = list(shape)
    total = 0
    for index, to in pieces:
        s = index[dim]
        total += to if to is not None else s.stop - s.start
    out[dim] = total
    return tuple(out)
