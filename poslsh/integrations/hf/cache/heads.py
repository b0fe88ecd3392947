"""The per-head window layer of a :class:`~poslsh.integrations.hf.cache.PoslshCache`: each KV head of a
decoder layer keeps its own ALiBi window (:class:`poslsh.decoding.HeadWindows`), ``sum_j (w_j + 1)`` rows.

Two ways in, one store:

* **Llama-family models of the ``"alibi-window"`` scheme** call ``cache.update(k, v, layer_idx,
  kwargs=kwargs)``; the layer keeps the step's keys pending, returns them, and adds itself to the
  attention's keywords, so :func:`poslsh.integrations.hf.cache.attend` finds it and calls
  :meth:`HeadWindowLayer.attend_scheme` (the model's checks, then the store).
* **Any attention with per-head windows** (e.g. a patched BLOOM / MPT / Falcon layer) skips ``update``
  and calls :meth:`HeadWindowLayer.attend_window` (or ``cache.attend_window(layer_idx, ...)``) with the
  step's query, keys, values and :class:`~poslsh.AlibiWindow`: the keys are stored and the output of
  its queries returned, ``[B, Hq, nq, dv]``.

Positions are padded (index in the batch's token sequence); ``valid [B, nq]`` says which new tokens are
real (left padding: a row's own positions start at its first real token). ``get_mask_sizes`` asks for
masks of the new tokens only (``nq x nq`` at offset ``tokens seen``): the attention reads validity from
their diagonal.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from ....decoding import Certificate, HeadWindows, span_backend
from ....positional import check_positional
from .spec import NEW_CACHE, WINDOW_SCHEMES

__all__ = ["HeadWindowLayer"]


class HeadWindowLayer(CacheLayerMixin):
    """One decoder layer's per-head window store in transformers' cache API (see the module docstring)."""

    is_croppable = False
    is_sliding = False

    def __init__(self, index: int, spec=None, owner=None, *, certificate: Optional[Certificate] = None,
                 sinks: int = 0, kwarg: str = "poslsh_cache_layer"):
        super().__init__()
        self.index, self.spec, self._owner, self._kwarg = index, spec, owner, kwarg
        self.certificate, self.sinks = certificate, sinks
        self._clear()

    def _clear(self) -> None:
        self.store: Optional[HeadWindows] = None
        self.positional = None            # the window the layer was first asked to attend with
        self.pending: Optional[Tuple[Tensor, Tensor]] = None
        self.is_initialized = False

    # ----------------------------------------------------------- cache API
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs=None, **extra) -> Tuple[Tensor, Tensor]:
        if not isinstance(kwargs, dict):
            raise ValueError("cache: this model does not pass its attention kwargs to cache.update (transformers 5 "
                             "Llama / Qwen3 / Mistral do); an attention with per-head windows calls "
                             "cache.attend_window(layer_idx, query, key, value, window) instead")
        if self.pending is not None:
            raise ValueError(f"cache: layer {self.index}'s last update was never attended by an "
                             f"{'/'.join(WINDOW_SCHEMES)} attention (another attn_implementation, or an error "
                             f"interrupted the step): {NEW_CACHE}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        kwargs[self._kwarg] = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.store is None else self.store.total

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return query_length, self.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("cache: a PoslshCache cannot be cropped (evicted keys are gone); assisted "
                                      "decoding needs a DynamicCache")

    def _rows(self, index: Tensor) -> None:
        if self.store is not None:
            self.store.select_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None and self.store.pads is not None:
            self._rows(torch.arange(len(self.store.pads)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None and self.store.pads is not None:
            self._rows(torch.arange(len(self.store.pads))[indices.cpu()])

    # ------------------------------------------------------------- the store
    def _store_for(self, window, scale, backend: str = "auto") -> HeadWindows:
        window = check_positional(window, "window", op="window")
        if self.positional is None:
            self.positional = window
            self.store = HeadWindows(window, scale=scale, certificate=self.certificate, sinks=self.sinks,
                                     backend=span_backend(backend, torch.empty(0), window.op),
                                     name=f"layer {self.index}")
        elif not self.positional.same_as(window):
            raise ValueError(f"cache: layer {self.index} evicted its keys for other partitions / another window than "
                             f"its attention passes now: {NEW_CACHE}")
        if self.store.scale is None:
            self.store.scale = scale
        return self.store

    def fill(self, window, keys: Tensor, values: Tensor, *, start: int, pads: List[Optional[int]]) -> None:
        """Hold a prefill computed elsewhere (:func:`~.poslsh_cache.packed_prefill_cache`): ``keys / values
        [B, Hkv, L, d]`` at padded positions ``[start, start + L)``, row ``b``'s first real token ``pads[b]``."""
        self.lazy_initialization(keys, values)
        self._store_for(window, None).fill(keys, values, start=start, pads=pads)

    def attend_window(self, query: Tensor, key: Tensor, value: Tensor, window, *, scale: Optional[float] = None,
                      valid: Optional[Tensor] = None, backend: str = "auto",
                      position_ids: Optional[Tensor] = None) -> Tensor:
        """**The entry point of an attention with per-head windows.** Store this step's ``key, value
        [B, Hkv, nq, d]`` (at padded positions ``[tokens seen, + nq)``) and return the causal windowed
        ALiBi attention of ``query [B, Hq, nq, d]``: ``[B, Hq, nq, dv]``, zero at padding.

        Args:
            window: the layer's :class:`~poslsh.AlibiWindow` (slopes and per-head windows), the same at every
                step (checked).
            scale: logit scale (default ``1 / sqrt(d)``).
            valid: bool ``[B, nq]``, which new tokens are real (the last ``nq`` columns of a left-padding
                mask); None: all.
            backend: the window op's backend for chunks of several tokens.
            position_ids: ``[B, nq]``, checked to continue the cache (None: not checked).
        """
        if self.pending is not None:
            raise ValueError(f"cache: layer {self.index} was updated through cache.update and not attended: call "
                             f"attend_window without update, or let the {'/'.join(WINDOW_SCHEMES)} attention attend")
        if self.store is not None and self.store.K is not None and query.device != self.store.device:
            raise ValueError(f"cache: layer {self.index} holds its keys on {self.store.device} but the model runs on "
                             f"{query.device}: build the cache after moving the model, or move the model back")
        if not self.is_initialized:
            self.lazy_initialization(key, value)
        return self._store_for(window, scale, backend).attend(query, key, value, valid=valid, position_ids=position_ids)

    def attend_scheme(self, query: Tensor, key: Tensor, value: Tensor, valid: Optional[Tensor], positional,
                      scale: float, backend: str, position_ids: Optional[Tensor]) -> Tensor:
        """A Llama-family ``alibi-window`` step: the keys pending from :meth:`update`."""
        if self.pending is None or self.pending[0].shape[2] != key.shape[2]:
            raise ValueError(f"cache: layer {self.index} was not updated with this step's keys")
        self.pending = None
        try:
            return self.attend_window(query, key, value, positional, scale=scale, valid=valid, backend=backend,
                                      position_ids=position_ids)
        except Exception:
            self.pending = (key, value)       # the failed step leaves the layer unusable, as it says
            raise

    # ------------------------------------------------------------- stats
    def kept_keys(self, num_kv_heads: int = 0) -> Tensor:
        k = None if self.store is None else self.store.kept_keys()
        return k if k is not None and k.numel() else torch.zeros(num_kv_heads, dtype=torch.int64)

    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes()

    def stats(self) -> dict:
        st = self.store
        if st is None or st.K is None:
            return {"layer": self.index, "tokens": 0, "kept": 0, "peak": 0, "bound": None, "bound_per_head": None,
                    "kept_per_head": None}
        kept = st.kept_keys().tolist()
        out = {"layer": self.index, "tokens": st.total, "kept": max(kept), "peak": st.peak,
               "bound": max(st.cap), "bound_per_head": list(st.win), "kept_per_head": kept}
        if st.certificate is not None:
            out["certificate"] = {k: (list(v) if isinstance(v, list) else v) for k, v in st.stats.items()}
        return out
