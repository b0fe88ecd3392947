"""A bounded KV cache for positional-LSH / fixed-blocks models, in transformers' cache API.

:class:`PoslshCache` is a ``transformers.Cache`` with one :class:`PoslshCacheLayer` (a
``DynamicLayer``) per decoder layer. After every forward step a layer drops the keys no
later query can see (:mod:`poslsh.decoding`: every key before the smallest block start,
over heads and samples, of the next position), so decoding is *exactly* the model's
own attention and a layer never keeps more than ``cache_bound(partitions)`` keys (its
widest block minus one; eq. (4) bounds that width with high probability), plus the
tokens of the current chunk, whatever the context length.

How the attention finds its layer: Llama / Qwen3 / Mistral call
``cache.update(k, v, layer_idx, kwargs=kwargs)`` with the attention call's keyword
dict (transformers 5); the layer adds itself to it under :data:`CACHE_KWARG`, so the
registered attention function (:mod:`poslsh.integrations.hf`) receives the layer and
with it the positions of the keys it returned.

Positions: keys are kept in *padded* coordinates (index in the batch's token
sequence, ``[start, total)``). A row's positions start at its first real token, as in
the prefill without a cache (left padding): the layer learns each row's first real
token from the causal mask (its diagonal says which new tokens are real). Each step
runs :func:`poslsh.poslsh_attention` with ``q_start`` / ``k_start`` once per group of
rows with the same offsets (one call without padding); outputs at padding positions
are zero.

Bad input raises one ``ValueError`` line: a cache built for another model instance,
scheme, number of samples, block size or partition seed; a model in training mode
(its partitions change every forward); ``position_ids`` that do not continue the
cache; padding after a row's first real token; another batch size; a step whose
attention was not a poslsh / fixed_blocks one.
"""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from ..attention import poslsh_attention
from ..decoding import cache_bound, first_needed, span_backend
from ..partitions import Partitions
from .hf_convert import positional_config

__all__ = ["CACHE_KWARG", "BLOCK_SCHEMES", "CacheSpec", "PoslshCacheLayer", "PoslshCache", "attend",
           "span_rows_attention", "left_pads", "generation_cache", "enable_generation_cache"]

CACHE_KWARG = "poslsh_cache_layer"
BLOCK_SCHEMES = ("poslsh", "fixed_blocks")
NEW_CACHE = "build a new one with poslsh.integrations.hf.generation_cache(model)"


@dataclass(frozen=True)
class CacheSpec:
    """What the partitions of a model's attention depend on (fields a scheme ignores are None)."""

    scheme: str
    num_heads: int
    num_samples: Optional[int] = None     # poslsh
    eval_seed: Optional[int] = None       # poslsh
    block_size: Optional[int] = None      # fixed_blocks

    @classmethod
    def of(cls, config, scheme: Optional[str] = None) -> "CacheSpec":
        pc = positional_config(config)
        scheme = scheme or config._attn_implementation
        H = int(config.num_attention_heads)
        if scheme == "poslsh":
            return cls(scheme, H, num_samples=pc.num_samples, eval_seed=pc.eval_seed)
        return cls(scheme, H, block_size=pc.block_size)

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if v is not None and k != "scheme")
        return f"{self.scheme} ({extra})"


def _validity(allowed: Optional[Tensor], B: int, nq: int) -> Optional[Tensor]:
    """Which new tokens are real, bool ``[B, nq]`` (None: all), from the diagonal of a causal
    mask ``[B, 1, nq, kv]`` whose last ``nq`` key columns are the new tokens."""
    if allowed is None:
        return None
    if allowed.shape[-2] != nq or allowed.shape[-1] < nq:
        raise ValueError(f"attention_mask: a mask of shape {tuple(allowed.shape)} does not fit a cached step of {nq} "
                         "tokens; pass the 2-D padding mask (as generate() does), not a 4-D one")
    idx = torch.arange(nq, device=allowed.device)
    return allowed[:, 0, idx, allowed.shape[-1] - nq + idx].expand(B, nq).cpu()


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
        self.partitions: Optional[Partitions] = None
        self.peak = 0                     # most keys a step attended to
        self.pending = False              # updated, not yet attended

    # ----------------------------------------------------------- cache API
    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs=None, **extra) -> Tuple[Tensor, Tensor]:
        if not isinstance(kwargs, dict):
            raise ValueError("cache: this model does not pass its attention kwargs to cache.update (transformers 5 "
                             "Llama / Qwen3 / Mistral do), so it cannot use a PoslshCache; use a DynamicCache")
        if self.pending:
            raise ValueError(f"cache: layer {self.index}'s last update was never attended by poslsh/fixed_blocks "
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
        now = CacheSpec.of(module.config, scheme)
        if now != self.spec:
            raise ValueError(f"cache: this PoslshCache was built for {self.spec} but the model runs {now}: {NEW_CACHE}")
        if self._owner() is not module.config:
            raise ValueError(f"cache: this PoslshCache was built for another model instance: {NEW_CACHE}")
        if getattr(module, "layer_idx", self.index) != self.index:
            raise ValueError(f"cache: layer {self.index} was updated by attention layer {module.layer_idx}")
        if module.training:
            raise ValueError("model is in training mode, which draws new partitions every forward; decoding with a "
                             "cache needs the fixed evaluation partitions: call model.eval()")

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
            need = first_needed(self.partitions, torch.tensor([self.total - p for p in started]))
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


def attend(layer: PoslshCacheLayer, module, scheme: str, query: Tensor, key: Tensor, value: Tensor,
           allowed: Optional[Tensor], partitions: Partitions, scale: float, backend: str,
           position_ids: Optional[Tensor]) -> Tensor:
    """One cached step of layer ``layer``: ``query [B, Hq, nq, d]`` (the new tokens) against
    ``key/value [B, Hkv, total - start, d]`` (what ``layer.update`` returned); returns
    ``[B, Hq, nq, dv]`` and evicts. ``allowed``: the boolean causal mask (or None)."""
    layer.check(module, scheme)
    B, nq = query.shape[0], query.shape[2]
    if key.shape[2] != layer.keys.shape[-2]:
        raise ValueError(f"cache: layer {layer.index} returned {layer.keys.shape[-2]} keys but the attention got "
                         f"{key.shape[2]}")
    valid = _validity(allowed, B, nq)
    layer.observe(valid, nq)
    layer.check_positions(position_ids, valid, nq)
    layer.partitions = partitions
    out = span_rows_attention(query, key, value, partitions, layer.total - nq, layer.start, layer.pads, scale,
                              backend)
    layer.evict()
    layer.pending = False
    return out


def span_rows_attention(query: Tensor, key: Tensor, value: Tensor, partitions: Partitions, q_first: int,
                        k_first: int, pads: List[Optional[int]], scale: float, backend: str) -> Tensor:
    """Causal attention of ``query [B, Hq, nq, d]`` at padded positions ``[q_first, q_first + nq)``
    to ``key/value [B, Hkv, nk, d]`` at padded ``[k_first, k_first + nk)``, where row ``b``'s own
    positions start at its first real token ``pads[b]`` (None: no real token yet). One
    :func:`poslsh.poslsh_attention` call per group of rows with equal offsets; returns
    ``[B, Hq, nq, dv]``, zero at padding positions."""
    B, Hq, nq, _ = query.shape
    backend = span_backend(backend, query)
    groups: Dict[Tuple[int, int, int, int], List[int]] = {}
    for b, pad in enumerate(pads):
        if pad is None or pad >= q_first + nq:
            continue
        i0, j0 = max(0, pad - q_first), max(0, pad - k_first)
        groups.setdefault((i0, j0, q_first + i0 - pad, k_first + j0 - pad), []).append(b)

    def run(rows, i0, j0, qs, ks):
        return poslsh_attention(query[rows, :, i0:], key[rows, :, j0:], value[rows, :, j0:], partitions,
                                causal=True, scale=scale, backend=backend, q_start=qs, k_start=ks)

    if len(groups) == 1:
        (i0, j0, qs, ks), rows = next(iter(groups.items()))
        if i0 == 0 and len(rows) == B:     # no padding in this step: one call on the whole batch
            return run(slice(None), i0, j0, qs, ks)
    out = query.new_zeros(B, Hq, nq, value.shape[-1])
    for (i0, j0, qs, ks), rows in groups.items():
        idx = torch.tensor(rows, device=query.device)
        out[idx, :, i0:] = run(idx, i0, j0, qs, ks)
    return out


def left_pads(allowed: Optional[Tensor], B: int, nq: int, nk: int) -> Optional[List[Optional[int]]]:
    """For a full cache (queries are the last ``nq`` of ``nk`` keys): each row's first real
    key if ``allowed [B, 1|H, nq, nk]`` is causal with left padding (None for a row with no
    real key), else None (another mask: the caller takes the dense path)."""
    if allowed is None:
        return [0] * B
    if allowed.shape[-2:] != (nq, nk) or (allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all())):
        return None
    a = allowed[:, 0].expand(B, nq, nk)
    last = a[:, -1]
    pad = torch.where(last.any(1), last.to(torch.int8).argmax(1), nk)
    j = torch.arange(nk, device=a.device)
    i = torch.arange(nk - nq, nk, device=a.device)
    expect = (j[None, None] >= pad[:, None, None]) & (j[None, None] <= i[None, :, None])
    if not torch.equal(a, expect):
        return None
    return [p if p < nk else None for p in pad.tolist()]


class PoslshCache(Cache):
    """Bounded KV cache of a poslsh / fixed_blocks model (see the module docstring).

    ``model.generate()`` uses one automatically for models built or converted by
    :mod:`poslsh.integrations.hf`; pass ``cache=PoslshCache(model)`` to a forward call to
    decode by hand. :meth:`stats` reports, per layer, the keys kept, the most keys a step
    attended to, and the bound ``cache_bound(partitions)`` that kept keys never exceed.
    """

    def __init__(self, model):
        config = model.config.get_text_config(decoder=True)
        impl = config._attn_implementation
        if impl not in BLOCK_SCHEMES:
            raise ValueError(f"model: a PoslshCache serves attn_implementation 'poslsh' or 'fixed_blocks', this model "
                             f"runs {impl!r}; use transformers' DynamicCache")
        spec = CacheSpec.of(config)
        owner = weakref.ref(config)
        super().__init__(layers=[PoslshCacheLayer(i, spec, owner) for i in range(config.num_hidden_layers)])

    def stats(self) -> List[dict]:
        """Per layer: ``tokens`` seen, ``kept`` keys, ``peak`` keys attended in one step,
        ``bound`` (``cache_bound`` of its partitions; None before the first step)."""
        return [{"layer": l.index, "tokens": l.total, "kept": l.size, "peak": l.peak,
                 "bound": None if l.partitions is None else cache_bound(l.partitions)} for l in self.layers]

    def nbytes(self) -> int:
        """Bytes of the keys and values held now."""
        return sum(t.numel() * t.element_size() for l in self.layers if l.is_initialized
                   for t in (l.keys, l.values))


# ------------------------------------------------------------------ generate()
def generation_cache(model) -> PoslshCache:
    """A bounded KV cache for ``model`` (attn_implementation ``"poslsh"`` or ``"fixed_blocks"``):
    ``model.generate(x, cache=generation_cache(model))`` or ``model(x, cache=c, use_cache=True)``.
    Each layer keeps at most ``poslsh.decoding.cache_bound`` of its partitions keys, plus the
    tokens of the current step."""
    return PoslshCache(model)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """``generate()``'s cache hook: a :class:`PoslshCache` where it would make a default ``DynamicCache``."""
    if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
            and generation_config.cache_implementation is None
            and not getattr(generation_config, "is_assistant", False)
            and self.config.get_text_config(decoder=True)._attn_implementation in BLOCK_SCHEMES):
        model_kwargs["cache"] = PoslshCache(self)
        return None
    return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)


def enable_generation_cache(model):
    """Make ``model.generate()`` use a :class:`PoslshCache` wherever it would build a default
    cache and the model runs poslsh / fixed_blocks attention (checked at each call); returns
    ``model``. ``hf.apply_positional_scheme``, ``hf.from_pretrained`` and
    ``hf.model_from_config`` do this."""
    model._prepare_cache_for_generation = types.MethodType(_prepare_cache_for_generation, model)
    return model
