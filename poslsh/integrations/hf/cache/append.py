"""A cache that keeps every key and appends in place: :class:`AppendCache`, one :class:`AppendLayer` per layer.

transformers' ``DynamicCache`` concatenates the whole past with the new keys at every step of every layer
(``torch.cat``): ``O(n)`` copied per token, more than the attention of one token reads. An
:class:`AppendLayer` holds its keys and values in buffers ``[B, Hkv, capacity, d]`` and writes the new
tokens into the next free rows; ``keys`` / ``values`` are views of the filled part, ``[B, Hkv, n, d]``. When
a step does not fit, the capacity doubles (one copy of the filled part; amortised ``O(1)`` per token), so a
token costs what its own keys cost; the first fill (a prefill) leaves room for an eighth more or
:data:`MIN_CAPACITY` tokens, so the steps after it allocate nothing. The views' batch and head axes merge (one layout ``[B, Hkv, ...]``), so
an attention reads them as ``[B * Hkv, n, d]`` without a copy (:mod:`poslsh.ops.torch.decode`).

Beam search reorders or repeats the batch rows (``reorder_cache``, ``batch_select_indices``,
``batch_repeat_interleave``): one copy of the buffers per call, as any cache that keeps each row's keys
contiguous; ``crop`` forgets the last tokens (assisted decoding). Exact: it holds what ``DynamicCache``
holds, at the same positions. Used by ``generate()`` of a model patched with :func:`~poslsh.integrations.hf.
patch_alibi` wherever its layers need every key (exact ALiBi, positional LSH, Falcon's bfloat16 bias), and
of the ``"alibi"`` scheme.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["AppendLayer", "AppendCache", "MIN_CAPACITY"]

MIN_CAPACITY = 256           # rows of room a buffer is made with, at least


class AppendLayer(DynamicLayer):
    """One layer's keys ``[B, Hkv, n, d]`` and values ``[B, Hkv, n, dv]``: views of buffers that grow by
    doubling (see the module docstring). ``capacity``: rows allocated per head; ``buffer_ptr()``: where the
    keys live (the same between steps until the capacity doubles)."""

    is_croppable = True

    def __init__(self, *args, **kwargs):
        self._k: Optional[Tensor] = None
        self._v: Optional[Tensor] = None
        self._n = 0
        super().__init__()

    # keys / values: views of the filled part; assigning one (transformers' generic offload, reset, ...) makes
    # it the buffer, filled to its length
    @property
    def keys(self) -> Optional[Tensor]:
        return None if self._k is None else self._k[:, :, :self._n]

    @keys.setter
    def keys(self, value: Optional[Tensor]) -> None:
        self._k = value
        self._n = 0 if value is None or value.dim() < 3 else value.shape[2]

    @property
    def values(self) -> Optional[Tensor]:
        return None if self._v is None else self._v[:, :, :self._n]

    @values.setter
    def values(self, value: Optional[Tensor]) -> None:
        self._v = value

    @property
    def capacity(self) -> int:
        return 0 if self._k is None or self._k.dim() < 3 else self._k.shape[2]

    def buffer_ptr(self) -> int:
        """The keys buffer's address (0 before the first step)."""
        return 0 if self._k is None else self._k.data_ptr()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True
        self._k = self._v = None
        self._n = 0

    def _grow(self, key_states: Tensor, value_states: Tensor, need: int) -> None:
        B, H, _, d = key_states.shape
        cap = max(2 * self.capacity, need + max(MIN_CAPACITY, need // 8))
        k = key_states.new_empty(B, H, cap, d)
        v = value_states.new_empty(B, H, cap, value_states.shape[-1])
        if self._n:
            k[:, :, :self._n] = self._k[:, :, :self._n]
            v[:, :, :self._n] = self._v[:, :, :self._n]
        self._k, self._v = k, v

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """Append ``key_states [B, Hkv, m, d]`` / ``value_states`` and return every key and value held, views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m, n = key_states.shape[2], self._n
        if self._n and (self._k.shape[:2] != key_states.shape[:2] or self._k.dtype != key_states.dtype
                        or self._k.device != key_states.device or self._k.shape[3] != key_states.shape[3]):
            raise ValueError(f"cache: this layer holds [B, Hkv] = {list(self._k.shape[:2])} {self._k.dtype} keys on "
                             f"{self._k.device}, the step passes {list(key_states.shape[:2])} {key_states.dtype} on "
                             f"{key_states.device}: one cache per batch")
        if self._k is None or n + m > self.capacity:
            self._grow(key_states, value_states, n + m)
        self._k[:, :, n:n + m] = key_states
        self._v[:, :, n:n + m] = value_states
        self._n = n + m
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: a positive value ({tokens_to_remove}) is transformers' legacy form; pass minus "
                             "the number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self._n = max(0, self._n + tokens_to_remove)

    def _rows(self, index: Tensor) -> None:
        if self._k is not None and self._n:
            idx = index.to(self._k.device)
            self._k, self._v = self._k.index_select(0, idx), self._v.index_select(0, idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._k is not None and self._n:
            self._rows(torch.arange(self._k.shape[0], device=self._k.device)[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None and self._n:
            self._rows(torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats))

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (the filled part and the room to grow)."""
        return sum(0 if t is None else t.numel() * t.element_size() for t in (self._k, self._v))


class AppendCache(Cache):
    """Every key and value of every layer, appended in place (:class:`AppendLayer`; layers made as the model
    calls them). A drop-in for ``DynamicCache`` (``model(x, cache=AppendCache(), use_cache=True)``,
    ``generate(..., cache=AppendCache())``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(layer_class_to_replicate=AppendLayer)

    def nbytes(self) -> int:
        """Bytes allocated for keys and values, every layer."""
        return sum(layer.nbytes() for layer in self.layers)

    def held_bytes(self) -> int:
        """Bytes of the keys and values held (the filled part), every layer."""
        return sum(0 if layer.keys is None else layer.keys.numel() * layer.keys.element_size()
                   + layer.values.numel() * layer.values.element_size() for layer in self.layers)
