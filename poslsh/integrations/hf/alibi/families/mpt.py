"""MPT (``MptAttention``): slopes of ``build_mpt_alibi_tensor`` with ``alibi_bias_max = 8`` (what ``MptModel``
passes, whatever the config says: another value is refused), ``softmax_scale`` and ``clip_qkv``, positions by
index; no limit at ``max_seq_len`` (the model's bias buffer is not read)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..layer import layer_attention
from .family import Family, arguments

__all__ = ["FAMILY"]


def _forward(self, hidden_states, *args, **kwargs):
    a = arguments(self, (hidden_states, *args), kwargs)
    B, n = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, n, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    ctx = layer_attention(self, q, k, v, a.get("attention_mask"), a.get("cache"), self.attn_dropout_p)
    return self.out_proj(ctx.transpose(1, 2).reshape(B, n, -1)), None


def _slopes(num_heads: int) -> Tensor:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    # [H, 1, 2] = slopes * (-1, 0): MptModel calls it with the default alibi_bias_max = 8
    return -build_mpt_alibi_tensor(num_heads, 2, device=torch.device("cpu"))[:, 0, 0]


def _check(config) -> None:
    a = config.attn_config
    if not getattr(a, "alibi", True):
        raise ValueError("model: this MPT's attn_config.alibi is False, but transformers' MptModel adds ALiBi anyway; "
                         "patch_alibi refuses a model whose config and code disagree")
    if float(getattr(a, "alibi_bias_max", 8)) != 8.0:
        raise ValueError(f"model: attn_config.alibi_bias_max={a.alibi_bias_max}, but transformers' MptModel computes "
                         "its slopes with 8; patch_alibi refuses a model whose config and code disagree")
    for flag in ("qk_ln", "prefix_lm", "attn_uses_sequence_id"):
        if getattr(a, flag, False):
            raise ValueError(f"model: attn_config.{flag}=True is an MPT variant transformers does not run; "
                             "patch_alibi refuses it")


FAMILY = Family("mpt", "MptModel", "MptAttention", _forward, _slopes, _check,
                heads=lambda m: (m.n_heads, m.head_dim), scale=lambda m: float(m.softmax_scale),
                kv_heads=lambda m: m.n_heads, positions="index", unread_bias={"build_mpt_alibi_tensor": lambda heads, n, *a, **k: (heads, 1, n)})
