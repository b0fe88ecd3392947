"""Decoding a patched ALiBi model (BLOOM, MPT, Falcon): which cache ``generate()`` uses, and the step of a layer on
a per-head window cache.

* **Windows** (``patch_alibi(model, window=...)``, fixed, or ``window="certified", tol=...``): a step needs only
  the last ``w_h`` keys of each head, so ``generate()`` runs on a
  :class:`~poslsh.integrations.hf.cache.PoslshCache` of per-head windows (:func:`alibi_cache`), whose layers hold
  ``sum_j (w_j + 1)`` rows each and return the step's attention themselves
  (:meth:`~poslsh.integrations.hf.cache.PoslshCache.attend_window`). Fixed windows: the same tokens and logits
  as without a cache. Certified windows: each layer chooses its windows once, from the prefill
  (:meth:`~.layer.LayerAlibi.decoding_window`), and the cache's :class:`~poslsh.decoding.Certificate` (default
  ``Certificate(tol, "warn")``) bounds the mass every later step drops against exact ALiBi over every past key.
* **Every key** (exact ALiBi, positional LSH, Falcon's ``falcon_bias="bfloat16"``, whose per-key rounding a window
  store does not apply): ``generate()`` runs on an :class:`~poslsh.integrations.hf.cache.AppendCache`, which
  appends in place where transformers' ``DynamicCache`` copies the whole cache at every step.

A model in training mode, ``cache=``, ``cache_implementation=`` or ``use_cache=False`` keep transformers' choice.
"""
from __future__ import annotations

import types
from typing import List, Optional

import torch
from torch import Tensor

from ....decoding import Certificate
from ..cache import AppendCache, HeadWindowLayer, PoslshCache

__all__ = ["alibi_cache", "windowed_cache_of", "attend_cached", "enable_alibi_generation_cache", "generation_cache_of"]


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
    if any(st.key_bias is not None for st in layers):
        return "falcon_bias='bfloat16' adds a rounding per key that a window store does not apply"
    if not all(st.per_head_cache for st in layers):
        modes = {st.mode for st in layers}
        return (f"the model attends with {'/'.join(sorted(modes))} (fixed or certified windows only: exact ALiBi and "
                "positional LSH need every past key; generate() decodes them on an AppendCache)")
    return None


def alibi_cache(model, *, certificate: Optional[Certificate] = None, sinks: int = 0) -> PoslshCache:
    """A per-head window cache for a model patched with fixed or certified windows: pass it as the model's cache
    (``model(x, cache=c, use_cache=True)``, ``model.generate(x, cache=c)``; ``generate()`` makes one itself).

    Args:
        certificate: the per-step check of the mass each head drops against exact ALiBi over every past key
            (:class:`poslsh.decoding.Certificate`: ``tol``, ``policy`` ``"warn"`` / ``"raise"`` / ``"widen"``,
            ``cap``). Certified windows: default ``Certificate(tol, "warn")`` with the ``tol`` of ``patch_alibi``;
            fixed windows: default none.
        sinks: the first positions of every row kept exactly (attended with their ALiBi bias).
    Raises (one line) for a model that is not patched with windows."""
    modules = _modules(model)
    layers = [m._poslsh_alibi for m in modules]
    why = _why_not(layers)
    if why is not None:
        raise ValueError(f"model: no per-head window cache: {why}")
    if certificate is None and layers[0].certified:
        certificate = Certificate(layers[0].tol, "warn")
    cache = PoslshCache.for_windows(model, certificate=certificate, sinks=sinks, num_layers=len(modules),
                                    num_kv_heads=_kv_heads(modules[0]))
    cache._poslsh_alibi_owner = modules[0]._poslsh_alibi.owner
    return cache


def generation_cache_of(model):
    """The cache ``generate()`` of a patched model in eval mode decodes on: :func:`alibi_cache` for fixed or
    certified windows, an :class:`~poslsh.integrations.hf.cache.AppendCache` for layers that need every key."""
    if _why_not(_layers(model)) is None:
        return alibi_cache(model)
    return AppendCache()


def windowed_cache_of(cache) -> Optional[PoslshCache]:
    """``cache`` when it is a per-head window cache (the layer attends through it), else None."""
    if isinstance(cache, PoslshCache) and all(isinstance(layer, HeadWindowLayer) for layer in cache.layers):
        return cache
    return None


def _window_of(layer: HeadWindowLayer, st, query: Tensor, key: Tensor):
    """The windows a layer's per-head cache attends with: fixed, or certified ones chosen at the cache's first
    step (its prefill) and kept."""
    if not st.certified:
        return st.positional_for(query, key)
    if layer.positional is None:
        return st.decoding_window(query, key)
    return layer.positional


def attend_cached(cache: PoslshCache, st, layer_idx: int, query: Tensor, key: Tensor, value: Tensor, call) -> Tensor:
    """One patched layer's step on a per-head window cache: ``[B, Hq, nq, dv]``; a left pad's row is the
    model's (every key of the row weighed equally)."""
    if not st.per_head_cache:
        raise ValueError(f"cache: a per-head window cache serves layers with fixed or certified windows; layer "
                         f"{layer_idx} attends with {st.mode if st.key_bias is None else 'the bfloat16 Falcon bias'}; "
                         "use an AppendCache or transformers' DynamicCache")
    owner = getattr(cache, "_poslsh_alibi_owner", None)
    if owner is None or owner() is None or owner() is not st.owner():
        raise ValueError("cache: this per-head window cache was made for another model; make one for this model "
                         "with alibi_cache(model)")
    layer = cache.layers[layer_idx]
    seen, nq = layer.get_seq_length(), query.shape[2]
    full = call.valid_for(seen + nq)
    valid = None if full is None else full[:, -nq:]
    out = cache.attend_window(layer_idx, query, key, value, _window_of(layer, st, query, key), scale=st.scale,
                              valid=valid, backend=st.backend)
    if full is None or bool(valid.all()):                          # every new token real: none without a key
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
    """``generate()``'s cache hook on a patched model: :func:`generation_cache_of` where transformers would make
    its default ``DynamicCache``."""
    if (model_kwargs.get("cache") is None and model_kwargs.get("past_key_values") is None
            and generation_config.use_cache is not False and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False) and not self.training and _layers(self)):
        model_kwargs["cache"] = generation_cache_of(self)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def enable_alibi_generation_cache(model) -> None:
    """Make ``model.generate()`` decode on :func:`generation_cache_of` whenever the model is patched and in eval mode
    (checked at each call: re-patching to another mode changes the cache; a model in training mode goes back to
    transformers' cache)."""
    if hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
