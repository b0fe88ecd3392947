"""Streaming decoding with a bounded KV cache: which cached keys a query can still need.

With fixed (evaluation) partitions, the query at position ``p`` sees only the keys in
the blocks that contain ``p``, one block per (head, sample), and along the sequence
those blocks only move forward (block starts are non-decreasing in ``p``). So once
the next query is at position ``p``, every key before

    ``first_needed(p) = min over heads h and samples t of start_{h,t}(p)``

is dead for good: no later query can see it. Dropping those keys after each step
keeps attention *exactly* the model's own (the same estimator, the same partitions),
not an approximation of it.

Size bound: a block of a bin of width ``b`` holds at most ``ceil(b)`` positions, so
after a step a layer keeps ``p - first_needed(p) <= max_block - 1`` keys, where
``max_block = max_{h,t} ceil(b_{h,t})`` (:func:`cache_bound`), whatever the context
length; a step of ``nq`` new tokens attends to at most ``max_block - 1 + nq`` keys.
For random-binning partitions eq. (4) (:func:`poslsh.theory.block_size_bound`)
bounds the widest bin: ``Pr[b_max > 1 + sigma (3 ln(s/delta) + 2)] < delta`` per
head, so with probability at least ``1 - H delta`` a layer's cache stays below
:func:`cache_bound_whp`. Fixed blocks of size ``B`` keep at most ``B - 1`` keys.

:class:`KVWindow` is the cache of one attention layer for one stream (all batch
rows at the same positions), calling :func:`poslsh.poslsh_attention` with
``q_start`` / ``k_start``; the transformers cache
(:mod:`poslsh.integrations.hf_cache`) applies the same rule per layer, with left
padding.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .attention import poslsh_attention
from .ops import load_backends, registry
from .partitions import Partitions
from .theory import block_size_bound

__all__ = ["first_needed", "cache_bound", "cache_bound_whp", "span_backend", "KVWindow"]


def first_needed(partitions: Partitions, positions: Tensor) -> Tensor:
    """The first key position a query at each of ``positions`` (int ``[P]``, >= 0) can see:
    the smallest start of its blocks over all heads and samples, int64 ``[P]``. Keys
    before ``first_needed(p)`` are never seen by a query at ``p`` or later."""
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if positions.numel() == 0:
        return positions
    if bool((positions < 0).any()):
        raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
    start, _ = partitions.block_bounds(int(positions.max()) + 1, positions.to(partitions.device))
    return start.amin(dim=(0, 1)).cpu()                                      # [H, s, P] -> [P]


def cache_bound(partitions: Partitions) -> int:
    """Most keys a layer with these partitions keeps after a step: ``max_block - 1`` with
    ``max_block = max_{h,t} ceil(b_{h,t})`` (a bin of width ``b <= 1`` holds one position)."""
    return max(1, int(math.ceil(float(partitions.widths.max())))) - 1


def cache_bound_whp(sigma, num_samples: int, delta: float = 0.01) -> float:
    """Eq. (4) per head, maximised over heads: with probability at least ``1 - H * delta``
    the partitions drawn for bandwidths ``sigma`` (``[H]``) and ``num_samples`` samples
    give :func:`cache_bound` below this value, for any context length."""
    sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    return max(block_size_bound(float(x), num_samples, delta) for x in sig) - 1.0


def span_backend(backend: str, q: Tensor) -> str:
    """``backend`` if it attends queries and keys at given positions, else ``"auto"``
    (e.g. the Triton kernels compute self-attention only: decoding steps use the torch backend)."""
    load_backends()
    if backend == "auto":
        return backend
    ok = {b.name for b in registry.registered("sequence") if "spans" in b.features["sequence"] and b.can_run(q)}
    return backend if backend in ok else "auto"


class KVWindow:
    """Bounded KV cache of one attention layer for one token stream.

    Every batch row sits at the same positions. Keys and values of positions
    ``[start, end)`` are kept; :meth:`step` appends a chunk, attends its queries to the
    window with :func:`poslsh.poslsh_attention` (``q_start = end``, ``k_start = start``),
    then drops every key before :func:`first_needed` of the next position. The window
    never exceeds :attr:`bound` ``+ nq`` keys (see the module docstring).

    Args:
        partitions: fixed partitions of the layer (``Hq`` heads).
        scale: logit scale (default ``1 / sqrt(d)``).
        backend: backend of :func:`poslsh.poslsh_attention` (one that accepts positions).
    """

    def __init__(self, partitions: Partitions, *, scale: Optional[float] = None, backend: str = "auto"):
        if not isinstance(partitions, Partitions):
            raise TypeError(f"partitions must be a poslsh.Partitions, got {type(partitions).__name__}")
        self.partitions, self.scale, self.backend = partitions, scale, backend
        self.k: Optional[Tensor] = None      # [B, Hkv, end - start, d]
        self.v: Optional[Tensor] = None      # [B, Hkv, end - start, dv]
        self.start = 0                       # position of the first kept key
        self.end = 0                         # tokens seen = position of the next query
        self.peak = 0                        # most keys a step attended to
        self.bound = cache_bound(partitions)

    @property
    def size(self) -> int:
        """Keys kept now (``end - start``)."""
        return self.end - self.start

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the next ``nq`` tokens.

        Args:
            q: ``[B, Hq, nq, d]`` queries at positions ``[end, end + nq)``.
            k: ``[B, Hkv, nq, d]``, v: ``[B, Hkv, nq, dv]`` their keys and values.
        Returns:
            ``[B, Hq, nq, dv]``: causal positional-LSH attention of the chunk, equal to the
            rows ``[end, end + nq)`` of the full-sequence forward.
        """
        if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
            raise ValueError(f"q, k, v must hold the same nq new tokens, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
        if self.k is not None and (k.shape[:2] != self.k.shape[:2] or k.dtype != self.k.dtype):
            raise ValueError(f"k: got [B, Hkv] = {list(k.shape[:2])} / {k.dtype}, the window holds "
                             f"{list(self.k.shape[:2])} / {self.k.dtype}: use one KVWindow per stream and layer")
        nq = q.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.peak = max(self.peak, self.k.shape[2])
        out = poslsh_attention(q, self.k, self.v, self.partitions, causal=True, scale=self.scale,
                               backend=span_backend(self.backend, q), q_start=self.end, k_start=self.start)
        self.end += nq
        self.evict()
        return out

    def evict(self) -> int:
        """Drop the keys no query at ``end`` or later can see; returns how many were dropped."""
        keep_from = max(self.start, int(first_needed(self.partitions, torch.tensor([self.end]))[0]))
        drop = keep_from - self.start
        if drop > 0:
            # A view: the next step's cat copies only the kept keys. After a long prompt most
            # of the storage is dead, so copy now rather than hold it for a step.
            keep = self.k.shape[2] - drop
            self.k, self.v = self.k[:, :, drop:], self.v[:, :, drop:]
            if drop > keep:
                self.k, self.v = self.k.clone(), self.v.clone()
            self.start = keep_from
        return drop
