"""A bounded KV cache in transformers' cache API: positional LSH, fixed blocks, ALiBi windows.

:class:`PoslshCache` is a ``transformers.Cache`` with one :class:`PoslshCacheLayer` (a
``DynamicLayer``) per decoder layer. After every forward step a layer drops the keys no
later query can see (:mod:`poslsh.decoding`: every key before the first key, over heads
and samples, that the next position sees), so decoding is *exactly* the model's own
attention and a layer never keeps more than ``cache_bound(positional)`` keys (partitions:
the widest block minus one, bounded by eq. (4) with high probability; an ALiBi window:
``max_h w_h``), plus the tokens of the current chunk, whatever the context length.

Schemes (:data:`CACHE_SCHEMES`): ``"poslsh"`` and ``"fixed_blocks"`` (the attention passes the
layer's :class:`~poslsh.partitions.Partitions`) and ``"alibi-window"`` (it passes the layer's
:class:`~poslsh.AlibiWindow`). The attention function of a scheme calls :func:`attend`
with the layer it received and its positional object; nothing else is scheme-specific.

How the attention finds its layer: Llama / Qwen3 / Mistral call
``cache.update(k, v, layer_idx, kwargs=kwargs)`` with the attention call's keyword
dict (transformers 5); the layer adds itself to it under :data:`CACHE_KWARG`, so the
registered attention function (:mod:`poslsh.integrations.hf`) receives the layer and
with it the positions of the keys it returned.

Positions: keys are kept in *padded* coordinates (index in the batch's token
sequence, ``[start, total)``). A row's positions start at its first real token, as in
the prefill without a cache (left padding): the layer learns each row's first real
token from the causal mask (its diagonal says which new tokens are real). Each step
runs the op with ``q_start`` / ``k_start`` once per group of rows with the same offsets
(:mod:`poslsh.integrations.hf.rows`; one call without padding); outputs at padding positions are zero. After
a packed prefill, :func:`packed_prefill_cache` makes every document its own row.

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
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from ....decoding import SEQUENCE_KINDS, Certificate, HeadWindows, document_rows
from ....positional import Positional, check_positional
from .heads import HeadWindowLayer
from .spec import (BLOCK_SCHEMES, CACHE_KWARG, CACHE_SCHEMES, NEW_CACHE, WINDOW_SCHEMES, CacheSpec,
                            check_layer)
from ..rows import left_padded_rows, left_pads, new_token_validity, span_rows_attention

__all__ = ["CACHE_KWARG", "BLOCK_SCHEMES", "WINDOW_SCHEMES", "CACHE_SCHEMES", "CacheSpec", "PoslshCacheLayer",
           "HeadWindowLayer", "PoslshCache", "Certificate", "attend", "span_rows_attention", "left_pads", "packed_prefill_cache", "generation_cache",
           "enable_generation_cache"]

class PoslshCacheLayer(DynamicLayer):
    """The keys and values of one decoder layer, padded positions ``[start, total)``:
    ``keys [B, Hkv, total - start, d]``, ``values [B, Hkv, total - start, dv]``."""

    is_croppable = False

    def __init__(self, index: int, spec: CacheSpec, owner):
        super().__init__()
        self.index, self.spec, self._owner = index, spec, owner    # owner: weakref to the model's config
        self._clear()

    def _clear(self) -> None:
        self.total = 0                    # tokens seen, padding included (= next padded position)
        self.start = 0                    # padded position of keys[..., 0, :]
        self.pads: Optional[List[Optional[int]]] = None   # per row: padded position of its first real token
        self.positional: Optional[Positional] = None   # partitions / window the layer evicts with
        self.peak = 0                     # most keys a step attended to
        self.pending = False              # updated, not yet attended

    # ----------------------------------------------------------- cache API
    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs=None, **extra) -> Tuple[Tensor, Tensor]:
        if not isinstance(kwargs, dict):
            raise ValueError("cache: this model does not pass its attention kwargs to cache.update (transformers 5 "
                             "Llama / Qwen3 / Mistral do), so it cannot use a PoslshCache; use a DynamicCache")
        if self.pending:
            raise ValueError(f"cache: layer {self.index}'s last update was never attended by a {'/'.join(CACHE_SCHEMES)} "
                             f"attention (another attn_implementation, or an error interrupted the step): {NEW_CACHE}")
        B = key_states.shape[0]
        if self.pads is None:
            self.pads = [None] * B
        elif len(self.pads) != B:
            raise ValueError(f"cache: it holds {len(self.pads)} rows but got a batch of {B}: use one cache per batch")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.total += key_states.shape[-2]
        self.peak = max(self.peak, self.keys.shape[-2])
        self.pending = True
        kwargs[CACHE_KWARG] = self       # the attention function gets the layer (see the module docstring)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.total

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.total - self.start + query_length, self.start

    def get_max_length(self) -> int:
        return -1

    @property
    def size(self) -> int:
        """Keys kept now."""
        return self.total - self.start

    def reset(self) -> None:
        super().reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("cache: a PoslshCache cannot be cropped (evicted keys are gone); assisted "
                                      "decoding needs a DynamicCache")

    def _rows(self, fn) -> None:
        if self.is_initialized and self.keys.dim() == 4:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))
        if self.pads is not None:
            self.pads = [self.pads[i] for i in beam_idx.tolist()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))
        if self.pads is not None:
            self.pads = [p for p in self.pads for _ in range(repeats)]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices, ...])
        if self.pads is not None:
            self.pads = [self.pads[i] for i in torch.arange(len(self.pads))[indices.cpu()].tolist()]

    # ------------------------------------------------------- attention side
    def check(self, module, scheme: str) -> None:
        """Raise if the calling attention is not the one this layer was built for."""
        check_layer(self, module, scheme)

    def observe(self, valid: Optional[Tensor], nq: int) -> None:
        """Record each row's first real token from ``valid [B, nq]`` (None: all real)."""
        q_first = self.total - nq
        if valid is None:
            firsts = [0] * len(self.pads)
        else:
            ar = torch.arange(nq)
            first = torch.where(valid.any(1), valid.to(torch.int8).argmax(1), nq)
            if not torch.equal(valid, ar[None] >= first[:, None]):
                raise ValueError("attention_mask: a row has padding after a real token; a cache takes left padding "
                                 "only (pad before the prompt, as generate() does)")
            firsts = first.tolist()
        for b, f in enumerate(firsts):
            if self.pads[b] is None:
                if f < nq:
                    self.pads[b] = q_first + f
            elif f != 0:
                raise ValueError(f"attention_mask: row {b} has padding after its first real token; a cache takes "
                                 "left padding only (pad before the prompt, as generate() does)")

    def check_positions(self, position_ids: Optional[Tensor], valid: Optional[Tensor], nq: int) -> None:
        """``position_ids`` of real tokens must continue the cache: counted from each row's
        first real token (what generate() passes) or from the padded start (the default)."""
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != nq:
            return
        B = len(self.pads)
        pid = position_ids.expand(B, nq).cpu()
        padded = self.total - nq + torch.arange(nq)
        pads = torch.tensor([-1 if p is None else p for p in self.pads])
        own = padded[None] - pads[:, None]
        real = (pads >= 0)[:, None] & (padded[None] >= pads[:, None])
        if valid is not None:
            real &= valid
        bad = real & (pid != own) & (pid != padded[None])
        if bool(bad.any()):
            b, i = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(f"position_ids: row {b} token {i} has position {int(pid[b, i])} but the cache, holding "
                             f"{self.total - nq} tokens, expects {int(own[b, i])}: feed tokens in order, or start a "
                             "new cache for a new sequence")

    def evict(self) -> None:
        """Drop every key no query at or after the next position can see (all rows)."""
        started = sorted({p for p in self.pads if p is not None})
        if started:
            need = self.positional.first_needed([self.total - p for p in started])
            keep_from = min(p + n for p, n in zip(started, need.tolist()))
        else:   # no real token yet: nothing a later query can see
            keep_from = self.total
        drop = max(keep_from, self.start) - self.start
        if drop > 0:
            keep = self.keys.shape[-2] - drop
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            if drop > keep:    # mostly dead storage (after a long prompt): free it now
                self.keys, self.values = self.keys.clone(), self.values.clone()
            self.start += drop


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
    if isinstance(layer, HeadWindowLayer):
        valid = new_token_validity(allowed, query.shape[0], query.shape[2])
        return layer.attend_scheme(query, key, value, valid, positional, scale, backend, position_ids)
    if layer.positional is not None and not layer.positional.same_as(positional):
        raise ValueError(f"cache: layer {layer.index} evicted its keys for other partitions / another window than "
                         f"its attention passes now: {NEW_CACHE}")
    B, nq = query.shape[0], query.shape[2]
    if key.shape[2] != layer.keys.shape[-2]:
        raise ValueError(f"cache: layer {layer.index} returned {layer.keys.shape[-2]} keys but the attention got "
                         f"{key.shape[2]}")
    valid = new_token_validity(allowed, B, nq)
    layer.observe(valid, nq)
    layer.check_positions(position_ids, valid, nq)
    layer.positional = positional
    out = span_rows_attention(query, key, value, positional, layer.total - nq, layer.start, layer.pads, scale,
                              backend)
    layer.evict()
    layer.pending = False
    return out


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
            raise ValueError(f"certificate / sinks: only per-head window caches (alibi-window, per_head=True) check a "
                             f"certificate or keep sinks; {scheme} keeps its own bound")
        spec = CacheSpec.of(config, scheme)
        owner = weakref.ref(config)
        n = config.num_hidden_layers
        super().__init__(layers=[HeadWindowLayer(i, spec, owner, certificate=certificate, sinks=sinks, kwarg=CACHE_KWARG)
                                 if heads else PoslshCacheLayer(i, spec, owner) for i in range(n)])
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
        return [l.stats() if isinstance(l, HeadWindowLayer) else
                {"layer": l.index, "tokens": l.total, "kept": l.size, "peak": l.peak,
                 "bound": None if l.positional is None else l.positional.cache_bound(),
                 "bound_per_head": None if l.positional is None else l.positional.cache_bound(per_head=True)}
                for l in self.layers]

    def kept_keys(self) -> Tensor:
        """The keys each KV head of each layer holds now: LongTensor ``[num_layers, num_kv_heads]``."""
        rows = []
        for l in self.layers:
            if isinstance(l, HeadWindowLayer):
                rows.append(l.kept_keys(self.num_kv_heads))
            else:
                n = l.keys.shape[1] if l.is_initialized and l.keys.dim() == 4 else self.num_kv_heads
                rows.append(torch.full((n,), l.size, dtype=torch.int64))
        return torch.stack(rows)

    def nbytes(self) -> int:
        """Bytes of the keys and values held now."""
        return sum(l.nbytes() if isinstance(l, HeadWindowLayer) else
                   sum(t.numel() * t.element_size() for t in (l.keys, l.values)) if l.is_initialized else 0
                   for l in self.layers)


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
        keys, values, total, start, pads = left_padded_rows(rows, check_positional(positional, op=SEQUENCE_KINDS))
        if isinstance(layer, HeadWindowLayer):
            layer.lazy_initialization(keys, values)
            layer.positional = positional
            layer.store = HeadWindows(positional, certificate=layer.certificate, sinks=layer.sinks,
                                      name=f"layer {layer.index}")
            layer.store.fill(keys, values, start=start, pads=pads)
            continue
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values, layer.total, layer.start = keys, values, total, start
        layer.pads, layer.positional = pads, positional
    return cache


# ------------------------------------------------------------------ generate()
def generation_cache(model) -> PoslshCache:
    """A bounded KV cache for ``model`` (attn_implementation one of :data:`CACHE_SCHEMES`):
    ``model.generate(x, cache=generation_cache(model))`` or ``model(x, cache=c, use_cache=True)``.
    Each layer keeps at most ``poslsh.decoding.cache_bound`` of its partitions / window keys,
    plus the tokens of the current step."""
    return PoslshCache(model)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``generate()``'s cache hook: a :class:`PoslshCache` where it would make a default ``DynamicCache``."""
    if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False)
            and self.config.get_text_config(decoder=True)._attn_implementation in CACHE_SCHEMES):
        model_kwargs["cache"] = PoslshCache(self)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def enable_generation_cache(model):
    """Make ``model.generate()`` use a :class:`PoslshCache` wherever it would build a default
    cache and the model runs one of :data:`CACHE_SCHEMES` (checked at each call); returns
    ``model``. ``hf.apply_positional_scheme``, ``hf.from_pretrained`` and
    ``hf.model_from_config`` do this."""
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    return model
