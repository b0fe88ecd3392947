"""Positional LSH partitions of a sequence (paper section 3.2).

Random Binning Features: for bandwidth ``sigma`` draw a width
``b ~ Gamma(shape=2, scale=sigma)`` and an offset ``c ~ U[0, b]``; position ``u``
hashes to ``h(u) = floor((u - c) / b)``. Positions with equal hash form a
contiguous block, so one sample is a contiguous block-diagonal 0/1 mask ``M``
and ``E[M_ij] = exp(-|i - j| / sigma)``.

A :class:`Partitions` holds ``s`` such hash functions for each of ``H`` heads as
float64 tensors. Sampling always runs on the CPU, so a seed gives the same
partitions whatever device they are moved to afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["Partitions", "Blocks", "sample_partitions"]


class Blocks(NamedTuple):
    """All blocks of all (head, sample) partitions of ``[0, n)``, flattened.

    Each field has shape ``[num_blocks]`` (int64); blocks are sorted by
    (head, sample, start) and cover ``[0, n)`` exactly once per (head, sample).
    """

    head: Tensor
    sample: Tensor
    start: Tensor
    length: Tensor


def _check_length(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sequence length n must be a positive int, got {n!r}")
    return n


@dataclass(frozen=True)
class Partitions:
    """``s`` random-binning partitions per head.

    Attributes:
        widths: ``[H, s]`` float64, bin widths ``b`` (``> 0``).
        offsets: ``[H, s]`` float64, bin offsets ``c`` (``0 <= c <= b``).
        sigma: ``[H]`` float64 bandwidths the partitions were drawn for, or
            ``None`` for deterministic partitions (the fixed-blocks baseline).
    """

    widths: Tensor
    offsets: Tensor
    sigma: Optional[Tensor] = None

    def __post_init__(self):
        w, c = self.widths, self.offsets
        if not (isinstance(w, Tensor) and isinstance(c, Tensor)):
            raise TypeError("widths and offsets must be tensors")
        if w.dim() != 2 or w.shape != c.shape:
            raise ValueError(f"widths and offsets must both be [H, s]; got {tuple(w.shape)} and {tuple(c.shape)}")
        if w.shape[0] < 1 or w.shape[1] < 1:
            raise ValueError(f"need at least one head and one sample, got widths of shape {tuple(w.shape)}")
        if w.dtype != torch.float64 or c.dtype != torch.float64:
            object.__setattr__(self, "widths", w.to(torch.float64))
            object.__setattr__(self, "offsets", c.to(torch.float64))
        if not bool(torch.all(self.widths > 0)) or bool(torch.isnan(self.widths).any()):
            raise ValueError("partition widths must be > 0")
        if not bool(torch.isfinite(self.offsets).all()):
            raise ValueError("partition offsets must be finite")
        if self.sigma is not None and self.sigma.shape != (w.shape[0],):
            raise ValueError(f"sigma must have shape [H]={w.shape[0]}, got {tuple(self.sigma.shape)}")

    # ------------------------------------------------------------------ basics
    @property
    def num_heads(self) -> int:
        return self.widths.shape[0]

    @property
    def num_samples(self) -> int:
        return self.widths.shape[1]

    @property
    def device(self) -> torch.device:
        return self.widths.device

    def to(self, device) -> "Partitions":
        """The same partitions with their tensors on ``device`` (still float64)."""
        if self.widths.device == torch.device(device):
            return self      # no copy, no re-validation (keeps torch.compile graphs whole)
        sigma = None if self.sigma is None else self.sigma.to(device)
        return Partitions(self.widths.to(device), self.offsets.to(device), sigma)

    def __repr__(self) -> str:
        kind = "fixed" if self.sigma is None else "sampled"
        return f"Partitions({kind}, heads={self.num_heads}, samples={self.num_samples}, device={self.device})"

    # ---------------------------------------------------------- constructors
    @classmethod
    def fixed_blocks(cls, num_heads: int, block_size: int, *, device=None) -> "Partitions":
        """The paper's fixed-blocks baseline: one deterministic partition per head
        into consecutive blocks of ``block_size`` positions (``[0, B), [B, 2B), ...``)."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        widths = torch.full((num_heads, 1), float(block_size), dtype=torch.float64, device=device)
        return cls(widths, torch.zeros_like(widths), None)

    # --------------------------------------------------------------- hashing
    def _hash(self, u: Tensor) -> Tensor:
        """``floor((u - c) / b)`` for positions ``u`` broadcast against ``[H, s, 1]``."""
        return torch.floor((u - self.offsets[..., None]) / self.widths[..., None])

    def block_ids(self, n: int) -> Tensor:
        """Block label of every position, int64 ``[H, s, n]``.

        Labels start at 0 for position 0 and increase along the sequence; two
        positions share a block in sample ``t`` iff their labels are equal.
        """
        n = _check_length(n)
        u = torch.arange(n, dtype=torch.float64, device=self.device)
        h = self._hash(u)
        return (h - h[..., :1]).to(torch.int64)

    def blocks(self, n: int) -> Blocks:
        """The blocks of ``[0, n)`` for every (head, sample), computed from the bin
        boundaries in ``O(H * s + num_blocks)`` time and memory (no ``[H, s, n]``
        tensor). Consistent with :meth:`block_ids` bit for bit."""
        n = _check_length(n)
        H, s = self.widths.shape
        dev = self.device
        w, c = self.widths.reshape(-1), self.offsets.reshape(-1)
        zero = torch.zeros(1, dtype=torch.float64, device=dev)
        first = torch.floor((zero - c) / w)
        last = torch.floor((zero + (n - 1) - c) / w)
        # Bins of width <= 1 hold at most one integer: every position is its own
        # block (and bins may be empty), so enumerate positions, not bins.
        singleton = w <= 1.0
        nbins = torch.where(singleton, torch.full_like(first, n), last - first + 1).to(torch.int64)
        pair = torch.repeat_interleave(torch.arange(H * s, device=dev), nbins)
        group_start = torch.cumsum(nbins, 0) - nbins
        rank = torch.arange(pair.numel(), device=dev) - group_start[pair]
        wp, cp = w[pair], c[pair]
        label = first[pair] + rank.to(torch.float64)
        # Start of bin `label`: the smallest integer u with floor((u - c) / b) >= label.
        # ceil(c + label * b) is off by one at most through rounding; fix it with the
        # hash itself so blocks() and block_ids() agree exactly.
        u = torch.ceil(cp + label * wp)
        u = torch.where(torch.floor((u - 1 - cp) / wp) >= label, u - 1, u)
        u = torch.where(torch.floor((u - cp) / wp) < label, u + 1, u)
        start = torch.where(singleton[pair], rank.to(torch.float64), u)
        start = start.clamp(0, n).to(torch.int64)
        start = torch.where(rank == 0, torch.zeros_like(start), start)
        is_last = rank == (nbins[pair] - 1)
        end = torch.where(is_last, torch.full_like(start, n), start.roll(-1))
        length = end - start
        keep = length > 0
        pair, start, length = pair[keep], start[keep], length[keep]
        return Blocks(pair // s, pair % s, start, length)

    def max_block_size(self, n: int) -> int:
        """The largest block size over all heads and samples for length ``n``."""
        return int(self.blocks(n).length.max())

    def dense_mean(self, n: int) -> Tensor:
        """The empirical mean mask ``M~ = (1/s) sum_t M_t``, float64 ``[H, n, n]``.

        Built with a 2-D difference array (four corner updates per block, then
        two prefix sums): ``O(n^2 + #blocks)``, not ``O(s * n^2)``. Dense: for
        references, theory and plots only.
        """
        return self.dense_count(n).to(torch.float64) / self.num_samples

    def dense_count(self, n: int) -> Tensor:
        """``count_ij`` = number of samples in which ``i`` and ``j`` share a block,
        int32 ``[H, n, n]`` (dense, small ``n`` only)."""
        n = _check_length(n)
        blk = self.blocks(n)
        H = self.num_heads
        diff = torch.zeros(H, n + 1, n + 1, dtype=torch.int32, device=self.device)
        a, e, h = blk.start, blk.start + blk.length, blk.head
        ones = torch.ones_like(a, dtype=torch.int32)
        for rows, cols, sign in ((a, a, 1), (a, e, -1), (e, a, -1), (e, e, 1)):
            diff.index_put_((h, rows, cols), sign * ones, accumulate=True)
        return diff.cumsum(1).cumsum(2)[:, :n, :n].contiguous()


def _validate_sigma(sigma) -> Tensor:
    if not isinstance(sigma, Tensor):
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
    if sigma.dim() == 0:
        sigma = sigma.reshape(1)
    if sigma.dim() != 1 or sigma.numel() < 1:
        raise ValueError(f"sigma must be a 1-D tensor of per-head bandwidths, got shape {tuple(sigma.shape)}")
    if not sigma.dtype.is_floating_point:
        sigma = sigma.to(torch.float64)
    bad = ~torch.isfinite(sigma) | (sigma <= 0)
    if bool(bad.any()):
        raise ValueError(f"every sigma must be finite and > 0; got {sigma.tolist()}")
    return sigma


def sample_partitions(sigma, num_samples: int, *, generator: Optional[torch.Generator] = None,
                      seed: Optional[int] = None) -> Partitions:
    """Draw ``num_samples`` random-binning partitions for each head.

    Args:
        sigma: per-head bandwidths ``[H]`` (``sigma_h = 1 / alibi_slope_h``); finite, ``> 0``.
        num_samples: ``s >= 1`` partitions per head.
        generator: a CPU ``torch.Generator`` to draw from (exclusive with ``seed``).
        seed: an int seed (exclusive with ``generator``). With neither, the global
            CPU RNG is used.

    Returns:
        :class:`Partitions` with ``widths``/``offsets`` of shape ``[H, s]`` (float64)
        on ``sigma``'s device. Drawing happens on the CPU, so the same seed gives
        the same partitions on every device.
    """
    sigma = _validate_sigma(sigma)
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("generator must be a CPU torch.Generator (sampling runs on the CPU for reproducibility)")
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
    H = sigma.numel()
    sig = sigma.detach().to("cpu", torch.float64)
    # Gamma(2, sigma) = sigma * (E1 + E2) with E ~ Exp(1); 1 - U avoids log(0).
    u = torch.rand(3, H, num_samples, dtype=torch.float64, generator=generator)
    widths = -sig[:, None] * (torch.log1p(-u[0]) + torch.log1p(-u[1]))
    widths = widths.clamp_min(torch.finfo(torch.float64).tiny)
    offsets = u[2] * widths
    dev = sigma.device
    return Partitions(widths.to(dev), offsets.to(dev), sig.to(dev))

