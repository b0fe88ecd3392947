"""The three ALiBi families of transformers as they are: which modules attend, their slopes as the
model's code computes them, the logit scale, what each refuses, and each attention module's patched
forward (its own projections, then :func:`~poslsh.integrations.hf_alibi_layer.layer_attention`).

* BLOOM (``BloomAttention``): slopes of ``_get_alibi_slopes`` (the non-power-of-two rule), logits
  ``q . k / sqrt(d) + m_h p_j`` (the bias is not scaled), positions from the mask's cumulative sum;
  ``pretraining_tp`` slices of ``slow_but_exact`` kept; dropout on the probabilities in training.
* MPT (``MptAttention``): slopes of ``build_mpt_alibi_tensor`` with ``alibi_bias_max = 8`` (what
  ``MptModel`` passes, whatever the config says: another value is refused), ``softmax_scale`` and
  ``clip_qkv``, positions by index; no limit at ``max_seq_len`` (the model's bias buffer is not read).
* Falcon (``FalconAttention``, ``config.alibi=True``): the BLOOM rule's slopes, scaled with the logits
  (``(q . k + m_h p_j) / sqrt(d)``, as Falcon's default sdpa path and Falcon-RW compute it; the explicit
  eager path adds the bias twice), multi-query and grouped keys; ``falcon_bias="bfloat16"`` adds back
  the rounding of transformers' ``bf16(bf16(m_h) p_j)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
from torch import Tensor

from .hf_alibi_layer import falcon_bf16_bias, layer_attention

__all__ = ["Family", "family_of", "FAMILIES"]


def _refuse_outputs(output_attentions) -> None:
    if output_attentions:
        raise ValueError("output_attentions=True: a patched ALiBi model never forms the n x n attention weights; "
                         "call it with output_attentions=False")


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    _refuse_outputs(output_attentions)
    B, n, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    ctx = layer_attention(self, q, k, v, attention_mask, layer_past, self.attention_dropout.p)
    ctx = ctx.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        out = torch.zeros_like(ctx)
        for i in range(self.pretraining_tp):
            a, b = int(i * slices), int((i + 1) * slices)
            out = out + torch.nn.functional.linear(ctx[:, :, a:b], self.dense.weight[:, a:b])
        # as transformers' slow_but_exact path: the sliced products, without the dense bias
    else:
        out = self.dense(ctx)
    return dropout_add(out, residual, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
    _refuse_outputs(kwargs.get("output_attentions"))
    if cache is None:
        cache = kwargs.get("past_key_values")
    B, n = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, n, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    ctx = layer_attention(self, q, k, v, attention_mask, cache, self.attn_dropout_p)
    return self.out_proj(ctx.transpose(1, 2).reshape(B, n, -1)), None


def _falcon_forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                    output_attentions=False, position_embeddings=None, **kwargs):
    _refuse_outputs(output_attentions)
    num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    q, k, v = self._split_heads(self.query_key_value(hidden_states))
    B, n = q.shape[:2]
    q = q.transpose(1, 2).reshape(B, self.num_heads, n, self.head_dim)
    k = k.transpose(1, 2).reshape(B, num_kv_heads, n, self.head_dim)
    v = v.transpose(1, 2).reshape(B, num_kv_heads, n, self.head_dim)
    ctx = layer_attention(self, q, k, v, attention_mask, layer_past, self.attention_dropout.p)
    return self.dense(ctx.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim)), None


def _bloom_slopes(num_heads: int) -> Tensor:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, torch.device("cpu"))


def _mpt_slopes(num_heads: int) -> Tensor:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    # [H, 1, 2] = slopes * (-1, 0): MptModel calls it with the default alibi_bias_max = 8
    return -build_mpt_alibi_tensor(num_heads, 2, device=torch.device("cpu"))[:, 0, 0]


def _check_bloom(config) -> None:
    """BLOOM has one ALiBi variant (``pretraining_tp`` / ``slow_but_exact`` are kept by the forward)."""


def _check_mpt(config) -> None:
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


def _check_falcon(config) -> None:
    if not config.alibi:
        raise ValueError("model: this Falcon has config.alibi=False (rotary positions, not ALiBi); patch_alibi "
                         "patches ALiBi models only")


@dataclass(frozen=True)
class Family:
    """One ALiBi family: its attention class name, the patched forward, slopes ``(H) -> float32 [H]``,
    the config check, and how to read heads, head dim and logit scale off an attention module."""

    name: str
    base_class: str
    attention_class: str
    forward: Callable
    slopes: Callable[[int], Tensor]
    check: Callable
    heads: Callable
    scale: Callable


FAMILIES = {
    "bloom": Family("bloom", "BloomModel", "BloomAttention", _bloom_forward, _bloom_slopes, _check_bloom,
                    lambda m: (m.num_heads, m.head_dim), lambda m: float(m.inv_norm_factor)),
    "mpt": Family("mpt", "MptModel", "MptAttention", _mpt_forward, _mpt_slopes, _check_mpt,
                  lambda m: (m.n_heads, m.head_dim), lambda m: float(m.softmax_scale)),
    "falcon": Family("falcon", "FalconModel", "FalconAttention", _falcon_forward, _bloom_slopes, _check_falcon,
                     lambda m: (m.num_heads, m.head_dim), lambda m: float(m.inv_norm_factor)),
}


def family_of(model) -> Tuple[Family, List[torch.nn.Module], List[torch.nn.Module]]:
    """The model's family, its attention modules (in layer order) and its base models; one line for a
    model that is not BLOOM, MPT or ALiBi Falcon."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model: a transformers BLOOM, MPT or Falcon model expected, got {type(model).__name__}")
    kind = getattr(model.config, "model_type", None)
    fam = FAMILIES.get(kind)
    if fam is None:
        raise ValueError(f"model: {type(model).__name__} (model_type {kind!r}) is not an ALiBi model patch_alibi "
                         "knows (BLOOM, MPT, Falcon with alibi=True); RoPE models take "
                         "poslsh.integrations.hf.apply_positional_scheme")
    fam.check(model.config)
    attn = [m for m in model.modules() if type(m).__name__ == fam.attention_class]
    other = [m for m in model.modules() if type(m).__name__.startswith(fam.attention_class[:-9])
             and type(m).__name__.endswith(("Attention", "Attention2")) and type(m).__name__ != fam.attention_class]
    if other:
        raise ValueError(f"model: {type(other[0]).__name__} is not the eager {fam.attention_class} (flash-attention "
                         "has no ALiBi in transformers); load the model with the default attention implementation")
    if not attn:
        raise ValueError(f"model: {type(model).__name__} has no {fam.attention_class} module")
    bases = [m for m in model.modules() if type(m).__name__ == fam.base_class]
    return fam, attn, bases


def layer_slopes(fam: Family, module, falcon_bias: str) -> Tuple[Tensor, float, object]:
    """``(slopes in logit units [H] float64, logit scale, key_bias or None)`` of one attention module."""
    H, d = fam.heads(module)
    m = fam.slopes(H).to(torch.float64)
    scale = fam.scale(module)
    if fam.name != "falcon":
        return m, scale, None
    root = math.sqrt(d)
    if falcon_bias == "bfloat16":
        return fam.slopes(H).to(torch.bfloat16).to(torch.float64) / root, scale, falcon_bf16_bias(fam.slopes(H), d)
    return m / root, scale, None
