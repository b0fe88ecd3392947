"""Positional LSH partitions of a sequence (paper section 3.2).

Random Binning Features: for bandwidth ``sigma`` draw a width
``b ~ Gamma(shape=2, scale=sigma)`` and an offset ``c ~ U[0, b]``; position ``u``
hashes to ``h(u) = floor((u - c) / b)``. Positions with equal hash form a
contiguous block, so one sample is a contiguous block-diagonal 0/1 mask ``M``
and ``E[M_ij] = exp(-|i - j| / sigma)``. Other width distributions
(:mod:`poslsh.widths`) give other kernels: ``E[M_ij] = k(|i - j|)``.

A :class:`Partitions` holds ``s`` such hash functions for each of ``H`` heads as
float64 tensors. Sampling always runs on the CPU, so a seed gives the same
partitions whatever device they are moved to afterwards. The ``s`` masks may be
drawn i.i.d. (the paper) or correlated but marginally exact (``"stratified"``,
``"grouped"``: see :mod:`poslsh.sampling`); grouped partitions keep their group
structure (``Partitions.groups``), and :func:`group_count` counts a group's shared
blocks by lattice arithmetic. A :class:`~poslsh.partitions_nd.PartitionsND` (boxes in ``D``
dimensions) is ``D`` of these, one per axis.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .positional import Positional
from .sampling import (MAX_WIDTH, SAMPLERS, check_groups, check_num_samples, check_sampler, check_sigma, check_widths,
                       draw, group_count, make_generator)
from .widths import GammaWidths, WidthDistribution, kernel_matrix

__all__ = ["Partitions", "Blocks", "sample_partitions", "hash_positions", "bin_start", "block_labels",
           "block_bounds", "group_count", "check_sampler", "SAMPLERS", "MAX_WIDTH"]


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
class Partitions(Positional):
    """``s`` random-binning partitions per head: the positional kind of the ``"sequence"`` op
    (:mod:`poslsh.positional`).

    Attributes:
        widths: ``[H, s]`` float64, bin widths ``b`` (``> 0``).
        offsets: ``[H, s]`` float64, bin offsets ``c`` (``0 <= c <= b``).
        sigma: ``[H]`` float64 bandwidths the partitions were drawn for, or
            ``None`` for deterministic partitions (the fixed-blocks baseline).
        groups: ``[H, s]`` int64 group id of every slot (``0..G-1``, the same
            ``G`` groups in every head), or ``None`` for independent masks
            (i.i.d.). The masks of a group share one width and their offsets are
            one lattice ``c + Z b / k`` (``k`` the group's size), so the groups are
            independent and :func:`group_count` applies; checked on construction.
            Stratified partitions are ``s`` groups of one.
        distribution: the law the widths were drawn from (:mod:`poslsh.widths`; ``E[M]`` is its
            kernel): :class:`~poslsh.widths.GammaWidths` ``(2)`` (ALiBi) unless told otherwise
            when ``sigma`` is given, ``None`` for deterministic partitions.

    Values are checked on construction, except on the meta device (no values to check); ``to``
    moves checked values without checking them again.
    """

    widths: Tensor
    offsets: Tensor
    sigma: Optional[Tensor] = None
    groups: Optional[Tensor] = None
    distribution: Optional[WidthDistribution] = None

    op = "sequence"
    heads_are = "partitions were built for"
    public_name = "poslsh.Partitions"

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
        values = w.device.type != "meta"
        if values and (not bool(torch.all(self.widths > 0)) or bool(torch.isnan(self.widths).any())):
            raise ValueError("partition widths must be > 0")
        if values and not bool(torch.isfinite(self.offsets).all()):
            raise ValueError("partition offsets must be finite")
        if self.sigma is not None and not isinstance(self.sigma, Tensor):
            object.__setattr__(self, "sigma", check_sigma(self.sigma))
        if self.sigma is not None and self.sigma.shape != (w.shape[0],):
            raise ValueError(f"sigma must have shape [H]={w.shape[0]}, got {tuple(self.sigma.shape)}")
        if self.groups is not None:
            groups = check_groups(self.widths, self.offsets, self.groups) if values else self.groups.to(torch.int64)
            object.__setattr__(self, "groups", groups)
        if self.sigma is None and self.distribution is not None:
            raise ValueError("a width distribution needs the sigma the widths were drawn for (got sigma=None)")
        if self.sigma is not None:
            object.__setattr__(self, "distribution", check_widths(self.distribution))

    def __eq__(self, other) -> bool:
        """Equal values (widths, offsets, sigma, groups) and distribution, whatever the tensor objects."""
        if type(other) is not type(self):
            return NotImplemented
        if self.distribution != other.distribution:
            return False
        pairs = [(self.widths, other.widths), (self.offsets, other.offsets), (self.sigma, other.sigma),
                 (self.groups, other.groups)]
        return all((a is None and b is None) or (a is not None and b is not None and a.device == b.device
                                                and a.shape == b.shape and bool(torch.equal(a, b)))
                   for a, b in pairs)

    def __hash__(self) -> int:        # consistent with __eq__: equal partitions have equal shapes
        return hash((tuple(self.widths.shape), self.sigma is None, self.groups is None))

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
        """The same partitions with their tensors on ``device`` (still float64), any device
        (``"meta"`` too): the values were checked on construction, so they are not checked again."""
        if self.widths.device == torch.device(device):
            return self      # no copy (keeps torch.compile graphs whole)
        return Partitions.checked_elsewhere(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                                            device=device)

    @classmethod
    def checked_elsewhere(cls, widths: Tensor, offsets: Tensor, sigma: Optional[Tensor] = None,
                          groups: Optional[Tensor] = None, distribution: Optional[WidthDistribution] = None, *,
                          device=None) -> "Partitions":
        """Partitions from values a checked draw produced (moved to ``device`` when given), not checked
        again: what :meth:`to` and a compiled :class:`~poslsh.PartitionSchedule` build (the checks read
        values, which a ``torch.compile`` graph cannot)."""
        made = object.__new__(cls)
        for name, x in (("widths", widths), ("offsets", offsets), ("sigma", sigma), ("groups", groups),
                        ("distribution", distribution)):
            object.__setattr__(made, name, x.to(device) if isinstance(x, Tensor) and device is not None else x)
        return made

    def select_heads(self, heads) -> "Partitions":
        """The partitions of some heads (an index, slice or list), groups kept."""
        idx = [heads] if isinstance(heads, int) else heads
        pick = (lambda x: None if x is None else x[idx])
        return Partitions(self.widths[idx], self.offsets[idx], pick(self.sigma), pick(self.groups), self.distribution)

    # ------------------------------------------------- the positional protocol
    def tensors(self) -> Tuple[Tensor, Tensor]:
        """``(widths, offsets)``, float64 ``[H, s]`` each (the groups follow from them)."""
        return self.widths, self.offsets

    def reach(self, positions: Tensor, seq_len: int) -> Tuple[Tensor, Tensor]:
        """Per head the keys ``[first, end)`` of the union of a position's blocks over the samples, int64 ``[H, P]``."""
        start, end = self.block_bounds(seq_len, positions)
        return start.amin(1), end.amax(1)

    def cache_bound(self, *, per_head: bool = False) -> Union[int, List[int]]:
        """``max_block - 1`` with ``max_block = max_{h,t} ceil(b_{h,t})`` (a bin of width ``b <= 1`` holds one
        position): the most keys a causal stream keeps after a step (``per_head``: each query head's)."""
        heads = [max(1, int(math.ceil(w))) - 1 for w in self.widths.amax(1).tolist()]
        return heads if per_head else max(heads)

    def dense_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``log count_ij`` between positions (samples in which they share a block; ``-inf`` for none),
        float64 ``[H, P, Q]``: one sample at a time, ``O(H (P + Q) s + H P Q)`` memory."""
        lab_q, lab_k = (block_labels(self.widths, self.offsets, p.to(self.device, torch.float64)) for p in (q_pos, k_pos))
        count = torch.zeros(self.num_heads, q_pos.numel(), k_pos.numel(), dtype=torch.float64, device=self.device)
        for t in range(self.num_samples):
            count += lab_q[:, t, :, None] == lab_k[:, t, None, :]
        return torch.log(count)

    def __repr__(self) -> str:
        kind = "fixed" if self.sigma is None else "sampled" if self.groups is None else \
            "sampled in groups" if self.device.type == "meta" else f"sampled in {self.num_groups} groups"
        if self.distribution is not None and self.distribution != GammaWidths():
            kind += f", {self.distribution.name}"
        return f"Partitions({kind}, heads={self.num_heads}, samples={self.num_samples}, device={self.device})"

    # ------------------------------------------------------------ groups
    @property
    def num_groups(self) -> int:
        """``G``, the number of independent groups per head (``s`` for i.i.d. masks)."""
        return self.num_samples if self.groups is None else int(self.groups.max()) + 1

    def group_sizes(self) -> Tensor:
        """int64 ``[H, G]``: the size ``k_g`` of every group (all ones for i.i.d. masks)."""
        if self.groups is None:
            return torch.ones(self.num_heads, self.num_samples, dtype=torch.int64, device=self.device)
        sizes = torch.zeros(self.num_heads, self.num_groups, dtype=torch.int64, device=self.device)
        return sizes.scatter_add_(1, self.groups, torch.ones_like(self.groups))

    def effective_groups(self) -> float:
        """``G_eff = s^2 / sum_g k_g^2``: the number of independent bounded terms that
        Hoeffding's inequality sees (``M~ = sum_g (k_g/s) X_g``, ``X_g`` in ``[0, 1]``).
        ``s`` for i.i.d. and stratified masks, ``G`` for groups of equal size."""
        k = self.group_sizes()[0].to(torch.float64)
        return float(k.sum() ** 2 / (k * k).sum())

    def group_lattices(self) -> Tuple[Tensor, Tensor, Tensor]:
        """Per group ``(width, origin, size)``, ``[H, G]`` each: its masks' common
        width, one point of its boundary lattice ``origin + Z width / size`` (the
        smallest offset of its masks) and its size. Needs ``groups``."""
        if self.groups is None:
            raise ValueError("these partitions have no groups (i.i.d.): draw them with sampler='grouped'")
        H, G = self.num_heads, self.num_groups
        width = torch.zeros(H, G, dtype=torch.float64, device=self.device).scatter_(1, self.groups, self.widths)
        origin = torch.full((H, G), float("inf"), dtype=torch.float64, device=self.device)
        origin = origin.scatter_reduce(1, self.groups, self.offsets, "amin")
        return width, origin, self.group_sizes()

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
        return self.labels(torch.arange(_check_length(n), device=self.device))

    def labels(self, positions: Tensor) -> Tensor:
        """Block labels of integer ``positions`` (``[P]``, any order), int64 ``[H, s, P]``, relative
        to position 0's bin: two positions share a block in sample ``t`` iff their labels are equal."""
        u = positions.to(self.device, torch.float64)
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

    def expected_mean(self, n: int) -> Tensor:
        """``E[M~]_ij = k(|i - j|; sigma_h)``, float64 ``[H, n, n]``: the kernel of the width
        distribution (``L* = exp(-|i - j| / sigma)`` for Gamma(2)). Dense; needs sampled partitions."""
        if self.sigma is None:
            raise ValueError("fixed partitions are deterministic: E[M] = M, use dense_mean")
        u = torch.arange(_check_length(n), dtype=torch.float64, device=self.device)
        return kernel_matrix(self.distribution, (u[:, None] - u[None, :]).abs(), self.sigma)

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


def sample_partitions(sigma, num_samples: int, *, generator: Optional[torch.Generator] = None,
                      seed: Optional[int] = None, sampler: str = "iid", group_size: Union[int, str, None] = None,
                      widths: Optional[WidthDistribution] = None) -> Partitions:
    """Draw ``num_samples`` random-binning partitions for each head.

    Args:
        sigma: per-head bandwidths ``[H]`` (``sigma_h = 1 / alibi_slope_h``); finite, ``> 0`` (from ALiBi
            slopes: ``1 / slopes``, or :func:`poslsh.alibi_sigmas`). A number is one head.
        num_samples: ``s >= 1`` partitions per head.
        generator: a CPU ``torch.Generator`` to draw from (exclusive with ``seed``).
        seed: an int seed (exclusive with ``generator``). With neither, the global
            CPU RNG is used.
        sampler: ``"iid"`` (the paper, the default), ``"stratified"`` (independent
            masks, stratified widths) or ``"grouped"`` (groups of shifted grids with
            stratified widths): every slot is marginally ``b ~ widths(sigma)``,
            ``c | b ~ U[0, b)``, so ``E[M~] = k`` exactly. See :mod:`poslsh.sampling`.
        group_size: ``"grouped"`` only: the largest group size ``k``, giving
            ``G = max(2, ceil(s / k))`` groups of nearly equal size; ``None``: ``k = 4``
            (:data:`~poslsh.sampling.DEFAULT_GROUP_SIZE`); ``"sqrt"``:
            ``G = max(2, round(sqrt(s)))`` groups.
        widths: the width distribution (:mod:`poslsh.widths`): ``None`` or ``GammaWidths(2)``
            is ALiBi (``E[M] = exp(-|i - j| / sigma)``, the same stream as ever for a seed),
            ``GammaWidths(m)`` / ``FixedWidth(w)`` other kernels. Every sampler takes both
            (stratifying needs the quantile function, which both have).

    Returns:
        :class:`Partitions` with ``widths``/``offsets`` of shape ``[H, s]`` (float64)
        on ``sigma``'s device (``groups`` set unless ``sampler == "iid"``; ``distribution`` the
        width law). Drawing happens on the CPU, so the same seed gives the same partitions on
        every device.
    """
    sigma = check_sigma(sigma)
    check_num_samples(num_samples)
    check_sampler(sampler, group_size)
    dist = check_widths(widths, sampler)
    generator = make_generator(generator, seed)
    sig = sigma.detach().to("cpu", torch.float64)
    dev = sigma.device
    w, c, groups = draw(sig, num_samples, generator, sampler, group_size, dist)
    return Partitions(w.to(dev), c.to(dev), sig.to(dev), None if groups is None else groups.to(dev), dist)
