"""Decoding a patched ALiBi model (BLOOM, MPT, Falcon) with per-head windows on a bounded cache.

A model patched with fixed windows (``patch_alibi(model, window=...)``) needs, at every step, only
the last ``w_h`` keys of each head: ``generate()`` then runs on a
:class:`~poslsh.integrations.hf.cache.PoslshCache` of per-head windows (:func:`alibi_cache`), whose
layers hold ``sum_j (w_j + 1)`` rows each and return the step's attention themselves
(:meth:`~poslsh.integrations.hf.cache.PoslshCache.attend_window`). The result is the model's own:
the same tokens and logits as without a cache. Exact ALiBi, certified windows (chosen again at every
call from that call's logit range) and positional LSH keep transformers' ``DynamicCache``, which holds
every key; so does Falcon's ``falcon_bias="bfloat16"``, whose per-key rounding a window store does not
apply.
"""
from __future__ import annotations

import types
from typing import List, Optional

import torch
from torch import Tensor

from ....decoding import Certificate
from ..cache import HeadWindowLayer, PoslshCache

__all__ = ["alibi_cache", "windowed_cache_of", "attend_cached", "enable_alibi_generation_cache"]


def _modules(model) -> List:
    """The patched attention modules (each carries its layer's state, ``_poslsh_alibi``)."""
    return [m for m in model.modules() if getattr(m, "_poslsh_alibi", None) is not None]


def _layers(model) -> List:
    return [m._poslsh_alibi for m in _modules(model)]


def _kv_heads(module) -> int:
    """Key/value heads of a patched attention module (what its keys carry: ``LayerAlibi.kv_heads``)."""
    return int(module._poslsh_alibi.kv_heads)


def _why_not(layers) -> Optional[str]:
    if not layers:
        return "the model is not patched; call patch_alibi(model, window=...) first"
    if not all(st.fixed_windows for st in layers):
        modes = {st.mode for st in layers}
        return (f"the model attends with {'/'.join(sorted(modes))} (fixed windows only: exact ALiBi, certified "
                "windows and positional LSH need every past key; use transformers' DynamicCache)")
    if any(st.key_bias is not None for st in layers):
        return "falcon_bias='bfloat16' adds a rounding per key that a window store does not apply"
    return None


def alibi_cache(model, *, certificate: Optional[Certificate] = None, sinks: int = 0) -> PoslshCache:
    """A per-head window cache for a model patched with fixed windows: pass it as the model's cache
    (``model(x, cache=c, use_cache=True)``; ``generate()`` makes one itself). ``certificate``: the
    per-step check of the mass each head drops against exact ALiBi over every past key
    (:class:`poslsh.decoding.Certificate`); ``sinks``: the first positions kept exactly.
    Raises (one line) for a model that is not patched with fixed windows."""
    modules = _modules(model)
    why = _why_not([m._poslsh_alibi for m in modules])
    if why is not None:
        raise ValueError(f"model: no per-head window cache: {why}")
    cache = PoslshCache.for_windows(model, certificate=certificate, sinks=sinks, num_layers=len(modules),
                                    num_kv_heads=_kv_heads(modules[0]))
    cache._poslsh_alibi_owner = modules[0]._poslsh_alibi.owner
    return cache


def windowed_cache_of(cache) -> Optional[PoslshCache]:
    """``cache`` when it is a per-head window cache (the layer attends through it), else None."""
    if isinstance(cache, PoslshCache) and all(isinstance(layer, HeadWindowLayer) for layer in cache.layers):
        return cache
    return None


def attend_cached(cache: PoslshCache, st, layer_idx: int, query: Tensor, key: Tensor, value: Tensor, call) -> Tensor:
    """One patched layer's step on a per-head window cache: ``[B, Hq, nq, dv]``; a left pad's row is the
    model's (every key of the row weighed equally)."""
    if not st.fixed_windows or st.key_bias is not None:
        raise ValueError(f"cache: a per-head window cache serves layers with fixed windows; layer {layer_idx} "
                         f"attends with {st.mode if st.key_bias is None else 'the bfloat16 Falcon bias'}; "
                         "use transformers' DynamicCache")
    owner = getattr(cache, "_poslsh_alibi_owner", None)
    if owner is None or owner() is None or owner() is not st.owner():
        raise ValueError("cache: this per-head window cache was made for another model; make one for this model "
                         "with alibi_cache(model)")
    seen, nq = cache.layers[layer_idx].get_seq_length(), query.shape[2]
    full = call.valid_for(seen + nq)
    valid = None if full is None else full[:, -nq:]
    out = cache.attend_window(layer_idx, query, key, value, st.positional_for(query, key), scale=st.scale,
                              valid=valid, backend=st.backend)
    if full is None:
        return out
    empty = full.to(torch.int64).cumsum(1)[:, -nq:] == 0          # [B, nq]: no real token at or before
    if not bool(empty.any()):
        return out
    if seen:
        raise ValueError("attention_mask: a row with no real token after the first step; a per-head window cache "
                         "no longer holds the keys the model weighs equally there; give every row a real token")
    # the model weighs every key of such a row equally (its softmax of a row at the dtype's minimum)
    mean = value.mean(2, keepdim=True).repeat_interleave(query.shape[1] // value.shape[1], 1)
    return torch.where(empty[:, None, :, None], mean.to(out.dtype), out)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``generate()``'s cache hook on a patched model: a per-head window cache where transformers would
    make its default ``DynamicCache`` and every layer attends with fixed windows."""
    if (model_kwargs.get("cache") is None and model_kwargs.get("past_key_values") is None
            and generation_config.use_cache is not False and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False) and not self.training
            and _why_not(_layers(self)) is None):
        model_kwargs["cache"] = alibi_cache(self)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def enable_alibi_generation_cache(model) -> None:
    """Make ``model.generate()`` decode on :func:`alibi_cache` whenever the model is patched with fixed
    windows and in eval mode (checked at each call: re-patching to another mode, or a model in training
    mode, goes back to transformers' cache)."""
    if hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
