"""Torch state dicts and byte comparisons shared by the remote-loading tests."""

from __future__ import annotations

import numpy as np
import torch


def llama(n_layers: int = 4, width: int = 128, vocab: int = 1024) -> dict[str, torch.Tensor]:
    """A small Llama-shaped state dict: BF16 weights, F32 norms, an F16 and an I64 buffer,
    and a tensor of 0 bytes."""
    g = torch.Generator().manual_seed(0)

    def w(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": w(vocab, width)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for proj in ("q", "k", "v", "o"):
            sd[p + f"self_attn.{proj}_proj.weight"] = w(width, width)
        for proj, shape in (("gate", (4 * width, width)), ("up", (4 * width, width)), ("down", (width, 4 * width))):
            sd[p + f"mlp.{proj}_proj.weight"] = w(*shape)
        sd[p + "input_layernorm.weight"] = w(width, dtype=torch.float32)
        sd[p + "post_attention_layernorm.weight"] = w(width, dtype=torch.float32)
    sd["model.norm.weight"] = w(width, dtype=torch.float32)
    sd["model.rotary_emb.inv_freq"] = w(width // 2, dtype=torch.float16)
    sd["model.position_ids"] = torch.arange(vocab, dtype=torch.int64)
    sd["model.empty"] = torch.empty(0, width, dtype=torch.bfloat16)
    sd["lm_head.weight"] = w(vocab, width)
    return sd


def raw(t) -> bytes:
    t = torch.as_tensor(t) if isinstance(t, np.ndarray) else t
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == sorted(want)
    for k in want:
        g, w = got[k], want[k]
        if isinstance(g, np.ndarray):
            assert tuple(g.shape) == tuple(w.shape), k
            assert g.tobytes() == raw(w), k
        else:
            assert g.dtype == w.dtype and g.shape == w.shape and g.device.type == "cpu", k
            assert raw(g) == raw(w), k
