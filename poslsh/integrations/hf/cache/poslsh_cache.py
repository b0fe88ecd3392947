"""A bounded KV cache in transformers' cache API: positional LSH, fixed blocks, ALiBi windows.

:class:`PoslshCache` is a ``transformers.Cache`` with one layer per decoder layer: a
:class:`~.layer.PoslshCacheLayer` (one tensor, evicted to the widest head's window) or, for ALiBi windows, a
:class:`~.heads.HeadWindowLayer` (each KV head its own window). Decoding is *exactly* the model's own
attention, and a layer never keeps more than ``cache_bound(positional)`` keys plus the tokens of the current
chunk, whatever the context length.

Schemes (:data:`CACHE_SCHEMES`): ``"poslsh"`` and ``"fixed_blocks"`` (the attention passes the
layer's :class:`~poslsh.partitions.Partitions`) and ``"alibi-window"`` (it passes the layer's
:class:`~poslsh.AlibiWindow`). The attention function of a scheme calls :func:`attend`
with the layer it received and its positional object; nothing else is scheme-specific.

How the attention finds its layer: Llama / Qwen3 / Mistral call
``cache.update(k, v, layer_idx, kwargs=kwargs)`` with the attention call's keyword
dict (transformers 5); the layer adds itself to it under :data:`CACHE_KWARG`, so the
registered attention function (:mod:`poslsh.integrations.hf.schemes.attention`) receives the layer and
with it the positions of the keys it returned. After a packed prefill, :func:`packed_prefill_cache` makes
every document its own row.

Bad input raises one ``ValueError`` line: a cache built for another model instance,
scheme, number of samples, block size, partition seed or window; a layer asked to attend
with other partitions / another window than it evicted with; a model in training mode
(its partitions change every forward); ``position_ids`` that do not continue the
cache; padding after a row's first real token; another batch size; a step whose
attention was not one of the schemes.
"""
from __future__ import annotations

import types
import weakref
from typing import List, Optional, Sequence

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ....decoding import SEQUENCE_KINDS, Certificate, document_rows
from ....positional import Positional, check_positional
from ..rows import left_padded_rows, new_token_validity
from .heads import HeadWindowLayer
from .layer import PoslshCacheLayer
from .append import AppendCache
from .spec import CACHE_KWARG, CACHE_SCHEMES, FULL_SCHEMES, WINDOW_SCHEMES, CacheSpec, check_layer

__all__ = ["PoslshCache", "attend", "packed_prefill_cache", "generation_cache", "enable_generation_cache"]


def attend(layer, module, scheme: str, query: Tensor, key: Tensor, value: Tensor,
           allowed: Optional[Tensor], positional: Positional, scale: float, backend: str,
           position_ids: Optional[Tensor]) -> Tensor:
    """One cached step of layer ``layer``: ``query [B, Hq, nq, d]`` (the new tokens) against
    ``key/value [B, Hkv, total - start, d]`` (what ``layer.update`` returned; a :class:`HeadWindowLayer`:
    the new tokens' keys, stored per head); returns ``[B, Hq, nq, dv]`` and evicts. ``allowed``: the
    boolean causal mask (or None); ``positional``: the layer's :class:`Partitions` (``poslsh``,
    ``fixed_blocks``) or :class:`AlibiWindow` (``alibi-window``), the same at every step (checked)."""
    check_layer(layer, module, scheme)
    check_positional(positional, op=SEQUENCE_KINDS)
    valid = new_token_validity(allowed, query.shape[0], query.shape[2])
    return layer.attend_scheme(query, key, value, valid, positional, scale, backend, position_ids)


class PoslshCache(Cache):
    """Bounded KV cache of a poslsh / fixed_blocks / alibi-window model (see the module docstring).

    ``model.generate()`` uses one automatically for models built or converted by
    :mod:`poslsh.integrations.hf`; pass ``cache=PoslshCache(model)`` to a forward call to
    decode by hand. ``scheme``: the scheme the model's attention reports to :func:`attend`
    (default its ``attn_implementation``; one of :data:`CACHE_SCHEMES`). :meth:`stats` reports,
    per layer, the keys kept, the most keys a step attended to, and the bound
    ``cache_bound(positional)`` that kept keys never exceed.
    """

    def __init__(self, model, scheme: Optional[str] = None, *, certificate: Optional[Certificate] = None,
                 sinks: int = 0, per_head: bool = True):
        config = model.config.get_text_config(decoder=True)
        scheme = scheme or config._attn_implementation
        if scheme not in CACHE_SCHEMES:
            raise ValueError(f"model: a PoslshCache serves attn_implementation {' / '.join(map(repr, CACHE_SCHEMES))}, "
                             f"this model runs {scheme!r}; use transformers' DynamicCache")
        heads = per_head and scheme in WINDOW_SCHEMES
        if not heads and (certificate is not None or sinks):
            raise ValueError(f"certificate / sinks: only per-head window caches ({'/'.join(WINDOW_SCHEMES)}, "
                             f"per_head=True) check a certificate or keep sinks; {scheme} keeps its own bound")
        spec = CacheSpec.of(config, scheme)
        owner = weakref.ref(config)
        n = config.num_hidden_layers
        super().__init__(layers=[HeadWindowLayer(i, spec, owner, certificate=certificate, sinks=sinks,
                                                 kwarg=CACHE_KWARG) if heads else PoslshCacheLayer(i, spec, owner)
                                 for i in range(n)])
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    @classmethod
    def for_windows(cls, model, *, certificate: Optional[Certificate] = None, sinks: int = 0,
                    num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None) -> "PoslshCache":
        """A per-head window cache for a model whose attention calls :meth:`attend_window` itself (e.g. one
        patched for ALiBi): one :class:`HeadWindowLayer` per decoder layer (``num_layers``, default
        ``config.num_hidden_layers``), no scheme of this integration required."""
        config = model.config.get_text_config(decoder=True)
        self = cls.__new__(cls)
        n = int(num_layers if num_layers is not None else config.num_hidden_layers)
        Cache.__init__(self, layers=[HeadWindowLayer(i, certificate=certificate, sinks=sinks, kwarg=CACHE_KWARG)
                                     for i in range(n)])
        self.num_kv_heads = int(num_kv_heads or getattr(config, "num_key_value_heads", None)
                                or config.num_attention_heads)
        return self

    def attend_window(self, layer_idx: int, query: Tensor, key: Tensor, value: Tensor, window, *,
                      scale: Optional[float] = None, valid: Optional[Tensor] = None, backend: str = "auto",
                      position_ids: Optional[Tensor] = None) -> Tensor:
        """Store layer ``layer_idx``'s keys of this step and return its attention output
        (:meth:`HeadWindowLayer.attend_window`: ``query [B, Hq, nq, d]``, ``key / value [B, Hkv, nq, d]``, the
        layer's :class:`~poslsh.AlibiWindow`, ``valid [B, nq]`` the real new tokens) -> ``[B, Hq, nq, dv]``."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, HeadWindowLayer):
            raise ValueError(f"cache: layer {layer_idx} of this PoslshCache keeps one shared window (partitions or "
                             "per_head=False); attend_window needs a per-head window cache")
        return layer.attend_window(query, key, value, window, scale=scale, valid=valid, backend=backend,
                                   position_ids=position_ids)

    def stats(self) -> List[dict]:
        """Per layer: ``tokens`` seen, ``kept`` keys (the widest head's), ``peak`` keys attended in one
        step, ``bound`` (``cache_bound`` of its partitions / window; per head: the widest ring; None before
        the first step) and ``bound_per_head`` (what each query head alone needs); per-head layers add
        ``kept_per_head`` and, certified, the ``certificate``'s counts."""
        return [layer.stats() for layer in self.layers]

    def kept_keys(self) -> Tensor:
        """The keys each KV head of each layer holds now: LongTensor ``[num_layers, num_kv_heads]``."""
        return torch.stack([layer.kept_keys(self.num_kv_heads) for layer in self.layers])

    def nbytes(self) -> int:
        """Bytes of the keys and values held now."""
        return sum(layer.nbytes() for layer in self.layers)


def packed_prefill_cache(model, prefill, positionals: Sequence[Positional], *, cu_seqlens: Optional[Tensor] = None,
                         document_ids: Optional[Tensor] = None, scheme: Optional[str] = None) -> PoslshCache:
    """A :class:`PoslshCache` with one row per document of a packed prefill, each continuing its
    document exactly as if it had been run alone (positions restart at 0 in every document).

    Args:
        model: the model (as for :class:`PoslshCache`).
        prefill: the prefill's keys and values per layer, ``k [B, Hkv, n, d]``, ``v [B, Hkv, n, dv]``
            of the packed tokens: a ``transformers`` cache filled by the packed forward (e.g. a
            ``DynamicCache``) or a list of ``(k, v)``.
        positionals: each layer's :class:`Partitions` / :class:`AlibiWindow` (what its attention
            passes to :func:`attend`, checked at the first step).
        cu_seqlens, document_ids: the packed documents (:mod:`poslsh.documents`); row ``d`` of the
            cache is document ``d`` (:func:`poslsh.decoding.document_rows` order).
        scheme: as for :class:`PoslshCache`.
    Returns:
        The cache, rows left-padded so every row's next token is at the same padded position;
        each layer holds only the keys its rows' continuations can need (evicted per row as
        after any step). Decode with ``model(next_tokens [D, nq], cache=cache, use_cache=True)``.
    """
    cache = PoslshCache(model, scheme)
    pairs = [(l.keys, l.values) for l in prefill.layers] if isinstance(prefill, Cache) else list(prefill)
    if len(pairs) != len(cache.layers) or len(positionals) != len(cache.layers):
        raise ValueError(f"prefill / positionals: got {len(pairs)} layers of keys and {len(positionals)} positional "
                         f"objects for a model of {len(cache.layers)} layers")
    for layer, (k, v), positional in zip(cache.layers, pairs, positionals):
        rows = document_rows(k, v, cu_seqlens=cu_seqlens, document_ids=document_ids)
        keys, values, _, start, pads = left_padded_rows(rows, check_positional(positional, op=SEQUENCE_KINDS))
        layer.fill(positional, keys, values, start=start, pads=pads)
    return cache


# ------------------------------------------------------------------ generate()
def generation_cache(model) -> PoslshCache:
    """A bounded KV cache for ``model`` (attn_implementation one of :data:`CACHE_SCHEMES`):
    ``model.generate(x, cache=generation_cache(model))`` or ``model(x, cache=c, use_cache=True)``.
    Each layer keeps at most ``poslsh.decoding.cache_bound`` of its partitions / window keys,
    plus the tokens of the current step."""
    return PoslshCache(model)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``generate()``'s cache hook: a :class:`PoslshCache` (an :class:`AppendCache` for :data:`FULL_SCHEMES`) where
    it would make a default ``DynamicCache``."""
    scheme = self.config.get_text_config(decoder=True)._attn_implementation
    if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False)
            and scheme in CACHE_SCHEMES + FULL_SCHEMES):
        model_kwargs["cache"] = PoslshCache(self) if scheme in CACHE_SCHEMES else AppendCache()
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def enable_generation_cache(model):
    """Make ``model.generate()`` use a :class:`PoslshCache` wherever it would build a default
    cache and the model runs one of :data:`CACHE_SCHEMES`, an :class:`AppendCache` for exact ALiBi
    (:data:`FULL_SCHEMES`) (checked at each call); returns
    ``model``. ``hf.apply_positional_scheme``, ``hf.from_pretrained`` and
    ``hf.model_from_config`` do this."""
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    return model
