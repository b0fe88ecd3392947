"""Partition-derived tensors the Triton kernels read (plain torch, no triton).

Everything here is elementwise float64 arithmetic on the bin widths and
offsets: no data-dependent shapes, no host synchronisation, no Python loop over
heads or samples. Each array is computed with the very same float64 operations as
:meth:`poslsh.Partitions.block_ids` and :meth:`poslsh.Partitions.blocks`, so the
kernel sees exactly the blocks that the reference and the torch backend see.

* ``ids``  int32 ``[H, s, n]``: block label of every position (nondecreasing
  along the sequence; equal labels <=> same block).
* ``gran`` int32 ``[4, H, s, ceil(n / 16)]``: for every 16-position *granule*
  ``g``, the block ``[start, end)`` that holds its first position ``16 g``
  (rows 0 and 1) and the block that holds its last position
  ``min(16 g + 15, n - 1)`` (rows 2 and 3). A tile of ``16 j`` rows reads its
  key range, and whether a key tile is *interior* (inside the block of every
  row in every sample), from these four numbers per sample.
* ``order`` int32 ``[Hq + Hkv]``: query heads, then key/value heads, sorted by
  decreasing expected work (mean block width), so the grid launches the longest
  programs first.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

GRANULE = 16
# Bound on the float64 temporaries of block_ids: H * s * chunk elements.
_IDS_CHUNK_ELEMENTS = 1 << 23


def _hash(u: Tensor, w: Tensor, c: Tensor) -> Tensor:
    """``floor((u - c) / w)``: the same expression as ``Partitions._hash``."""
    return torch.floor((u - c) / w)


def block_ids(widths: Tensor, offsets: Tensor, n: int) -> Tensor:
    """int32 ``[H, s, n]`` block labels, equal to ``Partitions.block_ids(n)``
    wherever that fits in int32, and equal-iff-same-block everywhere."""
    H, S = widths.shape
    w = widths.to(torch.float64)[..., None]
    c = offsets.to(torch.float64)[..., None]
    dev = widths.device
    # Bins of width <= 1 hold at most one integer (blocks() enumerates positions
    # for them): label every position by itself instead of by its huge hash.
    single = w <= 1.0
    first = _hash(torch.zeros((), dtype=torch.float64, device=dev), w, c)
    out = torch.empty(H, S, n, dtype=torch.int32, device=dev)
    chunk = max(1, _IDS_CHUNK_ELEMENTS // max(1, H * S))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        u = torch.arange(lo, hi, dtype=torch.float64, device=dev)
        lab = torch.where(single, u, _hash(u, w, c) - first)
        out[..., lo:hi] = lab.to(torch.int32)
    return out


def _bin_start(label: Tensor, w: Tensor, c: Tensor) -> Tensor:
    """Smallest integer ``u`` with ``floor((u - c) / w) >= label`` (as in ``Partitions.blocks``)."""
    u = torch.ceil(c + label * w)
    u = torch.where(_hash(u - 1, w, c) >= label, u - 1, u)
    u = torch.where(_hash(u, w, c) < label, u + 1, u)
    return u


def block_bounds(widths: Tensor, offsets: Tensor, n: int, pos: Tensor) -> Tuple[Tensor, Tensor]:
    """``[start, end)`` of the block holding each position of ``pos`` (int64 ``[P]``),
    for every (head, sample): two int64 ``[H, s, P]`` tensors."""
    w = widths.to(torch.float64)[..., None]
    c = offsets.to(torch.float64)[..., None]
    u = pos.to(torch.float64)
    single = w <= 1.0
    lab = _hash(u, w, c)
    start = _bin_start(lab, w, c).clamp(0, n)
    end = _bin_start(lab + 1, w, c).clamp(0, n)
    start = torch.where(single, u.expand_as(start), start)
    end = torch.where(single, (u + 1).expand_as(end), end)
    return start.to(torch.int64), end.to(torch.int64)


def granule_bounds(widths: Tensor, offsets: Tensor, n: int) -> Tensor:
    """int32 ``[4, H, s, ceil(n / GRANULE)]``: first-position start/end, last-position start/end."""
    dev = widths.device
    first = torch.arange(0, n, GRANULE, device=dev, dtype=torch.int64)
    last = torch.clamp(first + GRANULE - 1, max=n - 1)
    fs, fe = block_bounds(widths, offsets, n, first)
    ls, le = block_bounds(widths, offsets, n, last)
    return torch.stack([fs, fe, ls, le]).to(torch.int32).contiguous()


def head_order(widths: Tensor, n: int, group: int) -> Tensor:
    """int32 ``[Hq + Hkv]``: query heads then kv heads, heaviest (widest blocks) first."""
    work = widths.to(torch.float64).clamp(max=float(n)).sum(1)
    q_order = torch.argsort(work, descending=True, stable=True)
    kv_work = work.view(-1, group).sum(1)
    kv_order = torch.argsort(kv_work, descending=True, stable=True)
    return torch.cat([q_order, kv_order]).to(torch.int32)


def plan(widths: Tensor, offsets: Tensor, n: int, group: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(ids, gran, order)`` for the kernels (see the module docstring)."""
    return (block_ids(widths, offsets, n), granule_bounds(widths, offsets, n),
            head_order(widths, n, group))


def visited_tiles(widths: Tensor, offsets: Tensor, n: int, block_m: int, block_n: int,
                  causal: bool) -> Tuple[Tensor, Tensor]:
    """Key tiles the forward kernel visits, per query head: ``(total [H], interior [H])``
    (int64), for query tiles of ``block_m`` rows and key tiles of ``block_n`` keys.

    Mirrors the kernel's range logic (``_ranges`` / ``_split``), so ``total * block_m *
    block_n`` is the number of score elements it computes: the FLOP count behind the
    "TFLOP/s on visited tiles" of the benchmark.
    """
    if block_m % GRANULE:
        raise ValueError(f"block_m must be a multiple of {GRANULE}")
    gran = granule_bounds(widths, offsets, n).long()                    # [4, H, s, G]
    m0 = torch.arange(0, n, block_m, device=widths.device)
    mlast = torch.clamp(m0 + block_m, max=n) - 1
    g0, g1 = m0 // GRANULE, mlast // GRANULE
    lo = gran[0][..., g0].amin(1)                                       # [H, nQ]
    inner_hi = gran[1][..., g0].amin(1)
    inner_lo = gran[2][..., g1].amax(1)
    hi = gran[3][..., g1].amax(1)
    if causal:
        hi = torch.minimum(hi, mlast + 1)
        inner_hi = torch.minimum(inner_hi, m0 + 1)
    nt = (torch.clamp(hi - lo, min=0) + block_n - 1) // block_n
    ja = torch.minimum((torch.clamp(inner_lo - lo, min=0) + block_n - 1) // block_n, nt)
    jb = torch.maximum(torch.minimum(torch.clamp(inner_hi - lo, min=0) // block_n, nt), ja)
    return nt.sum(1), (jb - ja).sum(1)
