"""Falcon (``FalconAttention``, ``config.alibi=True``): the BLOOM rule's slopes, scaled with the logits
(``(q . k + m_h p_j) / sqrt(d)``, as Falcon's default sdpa path and Falcon-RW compute it; the explicit eager
path adds the bias twice), multi-query and grouped keys; ``falcon_bias="bfloat16"`` adds back the rounding of
transformers' ``bf16(bf16(m_h) p_j)`` (:func:`falcon_bf16_bias`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..layer import layer_attention
from .bloom import bloom_slopes
from .family import Family, arguments

__all__ = ["FAMILY", "falcon_kv_heads", "falcon_bf16_bias"]


def falcon_kv_heads(config) -> int:
    """Key/value heads of a Falcon checkpoint's fused projection: grouped (the new decoder architecture),
    one (multi-query) or one per head."""
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else int(config.num_attention_heads)


def _qkv(self, hidden_states):
    """Queries ``[B, H, n, d]``, keys and values ``[B, Hkv, n, d]`` from Falcon's fused projection, split as the
    checkpoint lays it out (the weights' format, not a transformers release's helper)."""
    cfg, d = self.config, self.head_dim
    H, Hkv = cfg.num_attention_heads, falcon_kv_heads(cfg)
    B, n = hidden_states.shape[:2]
    fused = self.query_key_value(hidden_states)
    if cfg.new_decoder_architecture:        # per key/value group: its queries, then its key and its value
        grouped = fused.view(B, n, Hkv, H // Hkv + 2, d)
        q, k, v = grouped[..., :-2, :].flatten(2, 3), grouped[..., -2, :], grouped[..., -1, :]
    elif cfg.multi_query:                   # every query head, then one key and one value
        q, k, v = fused.view(B, n, H + 2, d).split([H, 1, 1], dim=2)
    else:                                   # per head: query, key, value
        q, k, v = fused.view(B, n, H, 3, d).unbind(3)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _forward(self, hidden_states, *args, **kwargs):
    a = arguments(self, (hidden_states, *args), kwargs)
    q, k, v = _qkv(self, hidden_states)
    B, n = hidden_states.shape[:2]
    p = getattr(self.attention_dropout, "p", self.attention_dropout)      # a Dropout module, or its rate
    ctx = layer_attention(self, q, k, v, a.get("attention_mask"), a.get("cache"), float(p))
    return self.dense(ctx.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim)), None


def _check(config) -> None:
    if not config.alibi:
        raise ValueError("model: this Falcon has config.alibi=False (rotary positions, not ALiBi); patch_alibi "
                         "patches ALiBi models only")


def falcon_bf16_bias(slopes32: Tensor, head_dim: int) -> Callable[[Tensor], Tensor]:
    """Falcon's bias as transformers computes it, ``bf16(bf16(m_h) p_j) / sqrt(head_dim)``, minus the exact
    ALiBi part ``bf16(m_h) p_j / sqrt(head_dim)`` the op adds: ``positions [m] -> [H, m]`` (float64), the
    rounding error of the product per key."""
    m = slopes32.to(torch.float32).to(torch.bfloat16)
    m64 = m.to(torch.float64)
    root = float(head_dim) ** 0.5

    def bias(positions: Tensor) -> Tensor:
        p = positions.to(torch.int64)
        rounded = (m.to(p.device)[:, None] * p[None, :]).to(torch.float64)           # bfloat16 product, as Falcon
        return (rounded - m64.to(p.device)[:, None] * p[None, :].to(torch.float64)) / root

    return bias


FAMILY = Family("falcon", "FalconModel", "FalconAttention", _forward, bloom_slopes, _check,
                heads=lambda m: (m.num_heads, m.head_dim), scale=lambda m: float(m.inv_norm_factor),
                kv_heads=lambda m: falcon_kv_heads(m.config), bias_scaled=True, rounded_bias=falcon_bf16_bias)
