"""The one attention function of the schemes, registered with transformers under each scheme's name.

:func:`attention_forward` (``fn(scheme, module, query [B, Hq, nq, d], key/value [B, Hkv, nk, d],
attention_mask, scaling, dropout, **kwargs) -> ([B, nq, Hq, dv], None)``) attends with the layer's
positional object (:func:`~.state.layer_positional`) through :func:`poslsh.attend`; the schemes differ only
in that object and their rules (:data:`poslsh.integrations.hf.config.SCHEME_RULES`):

* ``"poslsh"``: positional LSH (:class:`poslsh.Partitions`, drawn per layer);
* ``"fixed_blocks"``: the paper's fixed-blocks baseline (one deterministic partition);
* ``"alibi"``: exact ALiBi (dense like stock ``sdpa``, the baseline positional LSH approximates);
* ``"alibi-window"``: exact ALiBi cut at a per-head window (:class:`poslsh.AlibiWindow`),
  ``w_h = window_sigmas * sigma_h`` or the window of positional LSH's cost at ``s`` samples.

:func:`register` registers them with ``transformers.AttentionInterface`` (and a mask builder with
``AttentionMaskInterface``, so padding masks reach them) and the rope type ``"poslsh_no_rotation"``.

Partitions follow :class:`poslsh.PartitionSchedule`: in training mode every forward pass
draws fresh partitions seeded by ``(seed, step, layer)``, where ``step`` is passed along with
the inputs: ``model(input_ids, poslsh_step=step)`` (transformers hands extra keyword
arguments down to the attention functions, so gradient-checkpoint recomputation sees the
same step); without it each layer counts its own training forward passes. In eval mode each
layer has fixed partitions seeded by ``(eval_seed, layer)``. They are drawn by
``config.poslsh["sampler"]`` (``"iid"``, the default, ``"stratified"`` or ``"grouped"`` with
``group_size``; see :mod:`poslsh.sampling`).

Masks: no mask, causal right or left padding and packed batches (``position_ids`` that restart,
or ``cu_seq_lens_q/k`` from ``DataCollatorWithFlattening``) run the near-linear ops; any other
mask is applied exactly by a dense ``O(nq * nk)`` path with one warning per model that names it.
Exact ALiBi (``"alibi"``) is dense like stock ``sdpa``, packed documents included
(the dense oracle of :func:`poslsh.attend` with their ids). Attention dropout and logit
softcapping raise.

Decoding with a KV cache: ``generate()`` of a poslsh / fixed_blocks / alibi-window model built,
converted or loaded here uses a bounded :class:`~poslsh.integrations.hf.cache.PoslshCache`
(:func:`generation_cache`, :func:`enable_generation_cache`), which drops the keys no later
query can see; an ``"alibi"`` model an :class:`~poslsh.integrations.hf.cache.AppendCache` (every key,
appended in place). Decoding against a full cache (left padding) runs the op at the queries' and keys'
positions (``q_start``, ``k_start``), one call per group of rows with equal offsets; for ``"alibi"`` the
window op without a window (its few-query path reads the cache in place).
Context parallelism (``poslsh_context``): every scheme but exact ALiBi.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
from torch import Tensor

from ....attention import attend
from ....reference import dense_attention
from .. import cache
from ..cache import CACHE_KWARG, CACHE_SCHEMES
from ..config import SCHEME_RULES, positional_config
from ..masks import (allowed_mask, dense_cause, documents_from_mask, lazy_causal_mask, packed_documents,
                     padded_self_attention, window_mask)
from ..rows import left_pads, span_rows_attention
from .convert import register_rope_type
from .state import layer_alibi_bias, layer_positional

__all__ = ["attention_forward", "poslsh_attention_forward",
           "fixed_blocks_attention_forward", "alibi_attention_forward", "alibi_window_attention_forward", "register",
           "STEP_KWARG", "CONTEXT_KWARG"]

log = logging.getLogger("poslsh.integrations.hf")
STEP_KWARG = "poslsh_step"
CONTEXT_KWARG = "poslsh_context"   # a poslsh.distributed.ContextShard: the inputs are one rank's shard


def _check_kwargs(module, dropout: float, kwargs) -> None:
    if dropout and dropout > 0:
        raise NotImplementedError("attention dropout is not supported by the poslsh/alibi attention "
                                  "implementations; set config.attention_dropout = 0")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("logit softcapping is not supported by the poslsh/alibi attention implementations")
    if kwargs.get("output_attentions"):
        log.warning("poslsh/alibi attention does not return attention weights (output_attentions ignored)")


def _same_dtype(query: Tensor, key: Tensor, value: Tensor):
    """One dtype for q, k, v: under autocast (e.g. bf16 on CUDA) Qwen3's q/k norms return
    float32 while v is bf16, and the kernels want a single dtype."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dt), key.to(dt), value.to(dt)


def _no_autocast(device: torch.device):
    # The kernels pick their own accumulation dtype; autocast inside them mixes dtypes.
    return torch.autocast(device_type=device.type, enabled=False)


def _causal(module, kwargs) -> bool:
    return bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))


def _sliding(kwargs, nk: int) -> Optional[int]:
    w = kwargs.get("sliding_window")
    return int(w) if w is not None and int(w) < nk else None


def _dense(query, key, value, allowed, bias, scaling, causal, window) -> Tensor:
    """Exact attention with an additive bias ``[H, nq, nk]``; the queries sit at positions
    ``[nk - nq, nk)`` of the keys ``[0, nk)`` (a full cache). A given mask is authoritative (it
    already encodes causality)."""
    nq, nk = query.shape[2], key.shape[2]
    mask = window_mask(allowed, nq, nk, causal, window, query.device)
    return dense_attention(query, key, value, bias[None], allowed=mask, causal=causal and mask is None,
                           scale=scaling, q_start=nk - nq)


# Dense-fallback warnings already given: (id(config), scheme, cause) -> config (weak: dies with the model).
_WARNED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _warn_dense_once(module, scheme: str, cause: str) -> None:
    key = (id(module.config), scheme, cause.split(" (")[0])    # the cause without its sizes
    if _WARNED.get(key) is not module.config:
        log.warning("%s attention: %s needs the exact dense O(nq * nk) path (warned once per model)", scheme, cause)
        _WARNED[key] = module.config


def _fast(attend_op, query, key, value, allowed, causal: bool, window: Optional[int], kwargs) -> Optional[Tensor]:
    """Self-attention by the near-linear op ``attend_op(q, k, v, **documents)`` when the mask allows it:
    none, causal padding or packed documents; None otherwise."""
    B, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if window is not None:
        return None
    docs = packed_documents(allowed, kwargs, B, nq, nk)
    if docs is not None:
        return attend_op(query, key, value, **docs)
    if nq != nk:
        return None
    out = padded_self_attention(attend_op, query, key, value, allowed, causal)
    if out is None and allowed is not None and (ids := documents_from_mask(allowed, causal)) is not None:
        out = attend_op(query, key, value, document_ids=ids)
    return out


def attention_forward(scheme: str, module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0,
                      **kwargs):
    """The attention of every scheme (:data:`SCHEME_RULES`): ``(module, q [B, Hq, nq, d], k/v [B, Hkv, nk, d],
    mask, ...) -> ([B, nq, Hq, dv], None)``, attending with the layer's positional object
    (:func:`~.state.layer_positional`: partitions or a window) through
    :func:`poslsh.attend`; context-parallel shards, :class:`PoslshCache` steps, packed documents, padding
    and a full cache take the near-linear ops, any other mask the exact dense path."""
    rules = SCHEME_RULES[scheme]
    step = kwargs.pop(STEP_KWARG, None)
    context = kwargs.pop(CONTEXT_KWARG, None)
    layer = kwargs.pop(CACHE_KWARG, None)
    if not rules.near_linear and context is not None:
        raise ValueError(f"poslsh_context: exact ALiBi cannot run context-parallel ({scheme}: every query sees every "
                         f"earlier key); use the {' / '.join(CACHE_SCHEMES)} implementation")
    if not rules.near_linear and layer is not None:
        raise ValueError(f"cache: a PoslshCache serves {' / '.join(CACHE_SCHEMES)} attention but this model runs "
                         "exact ALiBi (every key stays needed); use transformers' DynamicCache")
    _check_kwargs(module, dropout, kwargs)
    query, key, value = _same_dtype(query, key, value)
    B, H, nq, d = query.shape
    nk = key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    causal = _causal(module, kwargs)
    if rules.resampled and context is None and (layer is not None or nq != nk) and module.training:
        raise ValueError("model is in training mode, which draws new partitions every forward; decoding with a "
                         "KV cache needs the fixed evaluation partitions: call model.eval()")
    positional = layer_positional(module, scheme, H, step=step, device=query.device)
    backend = positional_config(module.config).backend
    allowed, window = allowed_mask(attention_mask), _sliding(kwargs, nk)

    def attend_op(q, k, v, **positions):
        return attend(q, k, v, positional, causal=causal, scale=scaling, backend=backend, **positions)

    with _no_autocast(query.device):
        if context is not None:   # context parallelism: query/key/value are this rank's shard of each sequence
            out = context.attention(query, key, value, positional, causal=causal, scale=scaling, backend=backend,
                                    mask=allowed, window=kwargs.get("sliding_window"))
        elif layer is not None:   # a PoslshCache step: the keys are the layer's bounded window
            if kwargs.get("sliding_window") is not None or not causal:
                raise ValueError("cache: a PoslshCache needs causal attention without a sliding window")
            out = cache.attend(layer, module, scheme, query, key, value, allowed, positional, scaling, backend,
                                  kwargs.get("position_ids"))
        elif not rules.near_linear:   # exact ALiBi, dense like stock sdpa (packed documents: the dense oracle)
            docs = None if window is not None else packed_documents(allowed, kwargs, B, nq, nk)
            if docs is not None:
                out = attend(query, key, value, positional, causal=causal, scale=scaling, backend="reference", **docs)
            elif window is None and causal and nq < nk and (pads := left_pads(allowed, B, nq, nk)) is not None:
                # a decoding step against every past key: the window op (no window), O(nk d), no nq x nk bias
                out = span_rows_attention(query, key, value, positional, nk - nq, 0, pads, scaling, backend)
            else:
                bias = layer_alibi_bias(module, H, nq, nk, query.device, _bias_dtype(query))
                out = _dense(query, key, value, allowed, bias, scaling, causal, window)
        else:
            out = _fast(attend_op, query, key, value, allowed, causal, window, kwargs)
            if out is None and window is None and causal and nq != nk and (
                    pads := left_pads(allowed, B, nq, nk)) is not None:
                # decoding against a full cache (keys 0..nk-1, queries the last nq): spans, per group of rows
                out = span_rows_attention(query, key, value, positional, nk - nq, 0, pads, scaling, backend)
            if out is None:   # a mask the op cannot express: exact, dense O(nq * nk)
                _warn_dense_once(module, scheme, dense_cause(nq, nk, causal, window))
                bias = positional.dense_bias(torch.arange(nk - nq, nk, device=query.device),
                                             torch.arange(nk, device=query.device))
                out = _dense(query, key, value, allowed, bias, scaling, causal, window)
    return out.transpose(1, 2).contiguous(), None


def _bias_dtype(query: Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def poslsh_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="poslsh"`` (:func:`attention_forward`)."""
    return attention_forward("poslsh", module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def fixed_blocks_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="fixed_blocks"`` (:func:`attention_forward`)."""
    return attention_forward("fixed_blocks", module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def alibi_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="alibi"``: exact ALiBi with slopes for the
    model's number of query heads, dense ``O(n^2)`` like stock ``sdpa`` (:func:`attention_forward`)."""
    return attention_forward("alibi", module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def alibi_window_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="alibi-window"``: exact ALiBi cut at the per-head
    window of ``config.poslsh`` (:meth:`PositionalConfig.alibi_window`; :func:`attention_forward`)."""
    return attention_forward("alibi-window", module, query, key, value, attention_mask, scaling, dropout, **kwargs)


_FUNCTIONS = {"poslsh": poslsh_attention_forward, "fixed_blocks": fixed_blocks_attention_forward,
              "alibi": alibi_attention_forward, "alibi-window": alibi_window_attention_forward}


# ------------------------------------------------------------ registration
def register() -> None:
    """Register the attention implementations, their mask builder and the no-rotation rope
    type with transformers (idempotent; done on import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    register_rope_type()
    for name, fn in _FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        # Without a mask builder transformers passes attention_mask=None to unknown
        # implementations, silently dropping padding.
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, lazy_causal_mask)
