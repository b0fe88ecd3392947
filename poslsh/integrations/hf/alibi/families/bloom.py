"""BLOOM (``BloomAttention``): slopes of ``_get_alibi_slopes`` (the non-power-of-two rule), logits
``q . k / sqrt(d) + m_h p_j`` (the bias is not scaled), positions from the mask's cumulative sum;
``pretraining_tp`` slices of ``slow_but_exact`` kept; dropout on the probabilities in training."""
from __future__ import annotations

import torch
from torch import Tensor

from ..layer import layer_attention
from .family import Family, arguments

__all__ = ["FAMILY", "bloom_slopes"]


def _forward(self, hidden_states, *args, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    a = arguments(self, (hidden_states, *args), kwargs)
    B, n, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    ctx = layer_attention(self, q, k, v, a.get("attention_mask"), a.get("cache"), self.attention_dropout.p)
    ctx = ctx.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * slices), int((i + 1) * slices)
            out = out + torch.nn.functional.linear(ctx[:, :, lo:hi], self.dense.weight[:, lo:hi])
        # as transformers' slow_but_exact path: the sliced products, without the dense bias
    else:
        out = self.dense(ctx)
    return dropout_add(out, a["residual"], self.hidden_dropout, self.training), None


def bloom_slopes(num_heads: int) -> Tensor:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, torch.device("cpu"))


def _check(config) -> None:
    """BLOOM has one ALiBi variant (``pretraining_tp`` / ``slow_but_exact`` are kept by the forward)."""


FAMILY = Family("bloom", "BloomModel", "BloomAttention", _forward, bloom_slopes, _check,
                heads=lambda m: (m.num_heads, m.head_dim), scale=lambda m: float(m.inv_norm_factor),
                kv_heads=lambda m: m.num_heads, unread_bias={"build_alibi_tensor": lambda mask, heads, *a, **k: (mask.shape[0] * heads, 1,
                                                                                  mask.shape[-1])})
