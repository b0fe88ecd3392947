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

import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Partitions", "Blocks", "sample_partitions", "hash_positions", "bin_start", "block_labels",
           "block_bounds"]


MAX_WIDTH = 1e300   # widths are clamped here (a single block for any sequence)


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
        if self.sigma is not None and not isinstance(self.sigma, Tensor):
            object.__setattr__(self, "sigma", _validate_sigma(self.sigma))
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

    # --------------------------------------------------------------- geometry
    def block_ids(self, n: int) -> Tensor:
        """Block label of every position, int64 ``[H, s, n]``.

        Labels start at 0 for position 0 and increase along the sequence; two
        positions share a block in sample ``t`` iff their labels are equal.
        """
        n = _check_length(n)
        u = torch.arange(n, dtype=torch.float64, device=self.device)
        return block_labels(self.widths, self.offsets, u).to(torch.int64)

    def blocks(self, n: int) -> Blocks:
        """The blocks of ``[0, n)`` for every (head, sample), computed from the bin
        boundaries in ``O(H * s + num_blocks)`` time and memory (no ``[H, s, n]``
        tensor). Consistent with :meth:`block_ids` bit for bit."""
        n = _check_length(n)
        H, s = self.widths.shape
        dev = self.device
        w, c = self.widths.reshape(-1), self.offsets.reshape(-1)
        first = hash_positions(torch.zeros(1, dtype=torch.float64, device=dev), w, c)
        last = hash_positions(torch.full((1,), float(n - 1), dtype=torch.float64, device=dev), w, c)
        # Bins of width <= 1 hold at most one integer: every position is its own
        # block (and bins may be empty), so enumerate positions, not bins.
        singleton = w <= 1.0
        nbins = torch.where(singleton, torch.full_like(first, n), last - first + 1).to(torch.int64)
        pair = torch.repeat_interleave(torch.arange(H * s, device=dev), nbins)
        group_start = torch.cumsum(nbins, 0) - nbins
        rank = torch.arange(pair.numel(), device=dev) - group_start[pair]
        wp, cp = w[pair], c[pair]
        label = first[pair] + rank.to(torch.float64)
        start = torch.where(singleton[pair], rank.to(torch.float64), bin_start(label, wp, cp))
        start = start.clamp(0, n).to(torch.int64)
        start = torch.where(rank == 0, torch.zeros_like(start), start)
        is_last = rank == (nbins[pair] - 1)
        end = torch.where(is_last, torch.full_like(start, n), start.roll(-1))
        length = end - start
        keep = length > 0
        pair, start, length = pair[keep], start[keep], length[keep]
        return Blocks(pair // s, pair % s, start, length)

    def block_bounds(self, n: int, positions: Tensor) -> Tuple[Tensor, Tensor]:
        """``[start, end)`` of the block holding each of ``positions`` (int ``[P]``, in
        ``[0, n)``) in every (head, sample): two int64 ``[H, s, P]`` tensors, equal to
        what :meth:`blocks` gives for those positions."""
        return block_bounds(self.widths, self.offsets, _check_length(n), positions)

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


# ------------------------------------------------------------------ geometry
# The one definition of the block geometry. Every consumer (Partitions, the torch
# backend, the Triton plan and its kernel, the analysis code) uses these float64
# expressions, so all of them see exactly the same blocks.
def hash_positions(u: Tensor, widths: Tensor, offsets: Tensor) -> Tensor:
    """Random-binning hash ``floor((u - c) / b)`` (float64), broadcast as given."""
    return torch.floor((u - offsets) / widths)


def bin_start(label: Tensor, widths: Tensor, offsets: Tensor) -> Tensor:
    """Smallest integer ``u`` with ``hash(u) >= label`` (float64, elementwise).
    ``ceil(c + label * b)`` is off by one at most through rounding; the hash fixes it."""
    u = torch.ceil(offsets + label * widths)
    u = torch.where(hash_positions(u - 1, widths, offsets) >= label, u - 1, u)
    return torch.where(hash_positions(u, widths, offsets) < label, u + 1, u)


def block_labels(widths: Tensor, offsets: Tensor, u: Tensor) -> Tensor:
    """Block labels (float64, ``[H, s, len(u)]``) of float64 positions ``u`` relative to
    position 0's bin: equal labels <=> same block. Bins of width <= 1 hold at most one
    integer, and positions then label themselves (their hash can be huge)."""
    w, c = widths[..., None], offsets[..., None]
    first = hash_positions(torch.zeros((), dtype=torch.float64, device=u.device), w, c)
    return torch.where(w <= 1.0, u.expand(*w.shape[:-1], u.numel()), hash_positions(u, w, c) - first)


def block_bounds(widths: Tensor, offsets: Tensor, n: int, positions: Tensor) -> Tuple[Tensor, Tensor]:
    """``[start, end)`` (int64 ``[H, s, P]``) of the block of each position, clipped to ``[0, n)``."""
    w, c = widths.to(torch.float64)[..., None], offsets.to(torch.float64)[..., None]
    u = positions.to(torch.float64)
    lab = hash_positions(u, w, c)
    start = bin_start(lab, w, c).clamp(0, n)
    end = bin_start(lab + 1, w, c).clamp(0, n)
    single = w <= 1.0
    start = torch.where(single, u.expand_as(start), start)
    end = torch.where(single, (u + 1).expand_as(end), end)
    return start.to(torch.int64), end.to(torch.int64)



def _validate_sigma(sigma) -> Tensor:
    if isinstance(sigma, Tensor):
        pass
    elif isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) or (
            isinstance(sigma, (list, tuple)) and all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                                     for x in sigma)):
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
    else:
        raise TypeError(f"sigma must be a tensor, a number or a list of numbers (per-head bandwidths), "
                        f"got {type(sigma).__name__}")
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


def _validate_seed(seed) -> int:
    """An int torch.manual_seed accepts exactly (no silent flooring or overflow)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(2 ** 63) <= int(seed) < 2 ** 64:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    return int(seed)


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
        generator = torch.Generator().manual_seed(_validate_seed(seed))
    H = sigma.numel()
    sig = sigma.detach().to("cpu", torch.float64)
    # Gamma(2, sigma) = sigma * (E1 + E2) with E ~ Exp(1); 1 - U avoids log(0).
    u = torch.rand(3, H, num_samples, dtype=torch.float64, generator=generator)
    widths = -sig[:, None] * (torch.log1p(-u[0]) + torch.log1p(-u[1]))
    # Clamp to finite widths: sigma near float64's max would overflow to inf (and a NaN
    # offset); any width beyond 1e300 is one block for every representable sequence.
    widths = widths.clamp(min=torch.finfo(torch.float64).tiny, max=MAX_WIDTH)
    offsets = u[2] * widths
    dev = sigma.device
    return Partitions(widths.to(dev), offsets.to(dev), sig.to(dev))

