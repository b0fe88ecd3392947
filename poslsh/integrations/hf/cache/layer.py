"""The shared-window layer of a :class:`~poslsh.integrations.hf.cache.PoslshCache`: one decoder layer's keys
and values in one tensor (a ``DynamicLayer``), every KV head keeping the widest head's window.

After every step the layer drops the keys no later query can see (:mod:`poslsh.decoding`: every key before
the first key, over heads and samples, that the next position sees), so decoding is *exactly* the model's own
attention and the layer never keeps more than ``cache_bound(positional)`` keys (partitions: the widest block
minus one, bounded by eq. (4) with high probability; an ALiBi window: ``max_h w_h``), plus the tokens of the
current chunk.

Positions: keys are kept in *padded* coordinates (index in the batch's token sequence, ``[start, total)``). A
row's positions start at its first real token, as in the prefill without a cache (left padding): the layer
learns each row's first real token from the causal mask (its diagonal says which new tokens are real). Each step
runs the op with ``q_start`` / ``k_start`` once per group of rows with the same offsets
(:mod:`poslsh.integrations.hf.rows`; one call without padding); outputs at padding positions are zero.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from ....decoding.rows import check_row_positions, observe_rows
from ....positional import Positional
from ..rows import span_rows_attention
from .spec import CACHE_KWARG, CACHE_SCHEMES, NEW_CACHE

__all__ = ["PoslshCacheLayer"]


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
            raise ValueError(f"cache: layer {self.index}'s last update was never attended by a "
                             f"{'/'.join(CACHE_SCHEMES)} attention (another attn_implementation, or an error "
                             f"interrupted the step): {NEW_CACHE}")
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
    def fill(self, positional: Positional, keys: Tensor, values: Tensor, *, start: int,
             pads: List[Optional[int]]) -> None:
        """Hold a prefill computed elsewhere (:func:`~.poslsh_cache.packed_prefill_cache`): ``keys / values
        [B, Hkv, L, d]`` at padded positions ``[start, start + L)``, row ``b``'s first real token ``pads[b]``."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.total, self.start = keys, values, start + keys.shape[2], start
        self.pads, self.positional = list(pads), positional

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

    def attend_scheme(self, query: Tensor, key: Tensor, value: Tensor, valid: Optional[Tensor],
                      positional: Positional, scale: float, backend: str, position_ids: Optional[Tensor]) -> Tensor:
        """A scheme's cached step: ``query [B, Hq, nq, d]`` (the new tokens) against ``key/value
        [B, Hkv, total - start, d]`` (what :meth:`update` returned) at their padded positions, every row at its
        own (:func:`~poslsh.integrations.hf.rows.span_rows_attention`); returns ``[B, Hq, nq, dv]`` and evicts."""
        if self.positional is not None and not self.positional.same_as(positional):
            raise ValueError(f"cache: layer {self.index} evicted its keys for other partitions / another window "
                             f"than its attention passes now: {NEW_CACHE}")
        nq = query.shape[2]
        if key.shape[2] != self.keys.shape[-2]:
            raise ValueError(f"cache: layer {self.index} returned {self.keys.shape[-2]} keys but the attention got "
                             f"{key.shape[2]}")
        observe_rows(self.pads, self.total - nq, valid, nq)
        check_row_positions(self.pads, self.total - nq, position_ids, valid, nq)
        self.positional = positional
        out = span_rows_attention(query, key, value, positional, self.total - nq, self.start, self.pads, scale,
                                  backend)
        self.evict()
        self.pending = False
        return out

    # ------------------------------------------------------------- stats
    def stats(self) -> dict:
        bound = None if self.positional is None else self.positional.cache_bound()
        return {"layer": self.index, "tokens": self.total, "kept": self.size, "peak": self.peak, "bound": bound,
                "bound_per_head": None if self.positional is None else self.positional.cache_bound(per_head=True)}

    def kept_keys(self, num_kv_heads: int = 0) -> Tensor:
        n = self.keys.shape[1] if self.is_initialized and self.keys.dim() == 4 else num_kv_heads
        return torch.full((n,), self.size, dtype=torch.int64)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values)) if self.is_initialized else 0
