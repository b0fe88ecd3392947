"""Work lists for block attention: turn the blocks of all (head, sample)
partitions into *units*, each a query segment attending to a key segment of the
same block, grouped by padded size so one batched matmul serves many units.

* A block of length ``L <= tile`` is one unit, padded to the smallest bucket
  size ``>= L`` (buckets are spaced by at most 1.5x, so padding wastes at most
  ~2.25x on the cheapest blocks and little on average).
* A longer block is cut into ``tile``-sized query and key segments; the unit
  list holds the (query segment, key segment) pairs, only ``kj <= qi`` when causal.

Everything is vectorised over all heads x samples x blocks: building the
schedule is a handful of tensor ops, never a Python loop over heads or samples.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch
from torch import Tensor

from ..partitions import Blocks

BUCKET_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class UnitGroup(NamedTuple):
    """Units of one padded size ``size``; every tensor is ``[U]`` int64."""

    size: int
    head: Tensor      # query head of the unit
    q_start: Tensor   # first query position
    q_len: Tensor     # valid query rows (<= size)
    k_start: Tensor   # first key position
    k_len: Tensor     # valid key rows (<= size)

    def __len__(self) -> int:
        return self.head.numel()


def _bucket_of(length: Tensor, sizes: Tensor) -> Tensor:
    return torch.searchsorted(sizes, length, right=False)


def build_schedule(blocks: Blocks, *, causal: bool, tile: int = 128) -> List[UnitGroup]:
    """Group the blocks' attention work into padded units (see module docstring)."""
    if tile not in BUCKET_SIZES:
        raise ValueError(f"tile must be one of {BUCKET_SIZES}")
    dev = blocks.start.device
    sizes = torch.tensor([b for b in BUCKET_SIZES if b <= tile], device=dev)
    small = blocks.length <= tile
    groups: List[UnitGroup] = []

    # Blocks that fit in one tile: one unit each.
    h, st, ln = blocks.head[small], blocks.start[small], blocks.length[small]
    bucket = _bucket_of(ln, sizes)
    for bi in torch.unique(bucket).tolist():
        sel = bucket == bi
        groups.append(UnitGroup(int(sizes[bi]), h[sel], st[sel], ln[sel], st[sel], ln[sel]))

    # Long blocks: pairs of tile-sized segments.
    h, st, ln = blocks.head[~small], blocks.start[~small], blocks.length[~small]
    if h.numel():
        nt = (ln + tile - 1) // tile
        npairs = nt * (nt + 1) // 2 if causal else nt * nt
        owner = torch.repeat_interleave(torch.arange(h.numel(), device=dev), npairs)
        p = torch.arange(owner.numel(), device=dev) - (torch.cumsum(npairs, 0) - npairs)[owner]
        if causal:  # p enumerates the lower triangle row by row: p = qi (qi + 1) / 2 + kj
            qi = ((torch.sqrt(8.0 * p.double() + 1.0) - 1.0) / 2.0).floor().long()
            qi = torch.where(qi * (qi + 1) // 2 > p, qi - 1, qi)          # guard rounding
            qi = torch.where((qi + 1) * (qi + 2) // 2 <= p, qi + 1, qi)
            kj = p - qi * (qi + 1) // 2
        else:
            qi, kj = p // nt[owner], p % nt[owner]
        base, length = st[owner], ln[owner]
        q_start, k_start = base + qi * tile, base + kj * tile
        q_len = torch.clamp(length - qi * tile, max=tile)
        k_len = torch.clamp(length - kj * tile, max=tile)
        groups.append(UnitGroup(tile, h[owner], q_start, q_len, k_start, k_len))
    return groups


def unit_work(groups: List[UnitGroup]) -> int:
    """Score elements computed (padded), summed over units: ``sum U * size^2``."""
    return sum(len(g) * g.size * g.size for g in groups)
