"""The three ALiBi families of transformers as they are: which modules attend, their slopes as the
model's code computes them, the logit scale, what each refuses, and each attention module's patched
forward (its own projections, then :func:`~poslsh.integrations.hf.alibi.layer.layer_attention`).

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

import inspect
import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
from torch import Tensor

from ..layer import falcon_bf16_bias, layer_attention

__all__ = ["Family", "family_of", "FAMILIES", "falcon_kv_heads"]


def _arguments(self, args, kwargs) -> dict:
    """The call's arguments by the names of the module's own (unpatched) forward, whatever their order or
    number in this transformers release; the cache under ``"cache"`` (``layer_past`` / ``past_key_values``)."""
    try:
        sig = inspect.signature(type(self).forward)
        named = dict(sig.bind(self, *args, **kwargs).arguments)
        for p in sig.parameters.values():           # the **kwargs entry, flattened
            if p.kind is p.VAR_KEYWORD:
                named.update(named.pop(p.name, {}) or {})
    except TypeError as e:
        raise TypeError(f"{type(self).__name__}: this transformers release calls its attention with arguments the "
                        f"patched forward cannot bind ({e}); see poslsh.integrations.hf.TESTED_TRANSFORMERS") from None
    if named.get("output_attentions"):
        raise ValueError("output_attentions=True: a patched ALiBi model never forms the n x n attention weights; "
                         "call it with output_attentions=False")
    for name in ("cache", "layer_past", "past_key_values"):
        if named.get(name) is not None:
            named["cache"] = named[name]
    return named


def _bloom_forward(self, hidden_states, *args, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add

    a = _arguments(self, (hidden_states, *args), kwargs)
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


def _mpt_forward(self, hidden_states, *args, **kwargs):
    a = _arguments(self, (hidden_states, *args), kwargs)
    B, n = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, n, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    ctx = layer_attention(self, q, k, v, a.get("attention_mask"), a.get("cache"), self.attn_dropout_p)
    return self.out_proj(ctx.transpose(1, 2).reshape(B, n, -1)), None


def falcon_kv_heads(config) -> int:
    """Key/value heads of a Falcon checkpoint's fused projection: grouped (the new decoder architecture),
    one (multi-query) or one per head."""
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else int(config.num_attention_heads)


def _falcon_qkv(self, hidden_states):
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


def _falcon_forward(self, hidden_states, *args, **kwargs):
    a = _arguments(self, (hidden_states, *args), kwargs)
    q, k, v = _falcon_qkv(self, hidden_states)
    B, n = hidden_states.shape[:2]
    p = getattr(self.attention_dropout, "p", self.attention_dropout)      # a Dropout module, or its rate
    ctx = layer_attention(self, q, k, v, a.get("attention_mask"), a.get("cache"), float(p))
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
    the config check, and how to read heads and head dim, the logit scale and the key/value heads off an
    attention module."""

    name: str
    base_class: str
    attention_class: str
    forward: Callable
    slopes: Callable[[int], Tensor]
    check: Callable
    heads: Callable
    scale: Callable
    kv_heads: Callable


FAMILIES = {
    "bloom": Family("bloom", "BloomModel", "BloomAttention", _bloom_forward, _bloom_slopes, _check_bloom,
                    lambda m: (m.num_heads, m.head_dim), lambda m: float(m.inv_norm_factor),
                    lambda m: m.num_heads),
    "mpt": Family("mpt", "MptModel", "MptAttention", _mpt_forward, _mpt_slopes, _check_mpt,
                  lambda m: (m.n_heads, m.head_dim), lambda m: float(m.softmax_scale),
                  lambda m: m.n_heads),
    "falcon": Family("falcon", "FalconModel", "FalconAttention", _falcon_forward, _bloom_slopes, _check_falcon,
                     lambda m: (m.num_heads, m.head_dim), lambda m: float(m.inv_norm_factor),
                     lambda m: falcon_kv_heads(m.config)),
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
