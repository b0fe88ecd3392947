"""Partition-derived tensors the Triton kernels read (plain torch, no triton).

Everything here is elementwise float64 arithmetic on the bin widths and
offsets: no data-dependent shapes, no host synchronisation, no Python loop over
heads or samples. Each array comes from the one definition of the block geometry
in :mod:`poslsh.partitions` (``block_labels``, ``block_bounds``), so the kernel sees
exactly the blocks that the reference and the torch backend see.

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

from ...partitions import block_bounds, block_labels

GRANULE = 16
# Bound on the float64 temporaries of block_ids: H * s * chunk elements.
_IDS_CHUNK_ELEMENTS = 1 << 23


def block_ids(widths: Tensor, offsets: Tensor, n: int) -> Tensor:
    """int32 ``[H, s, n]`` block labels: :func:`poslsh.partitions.block_labels` in chunks
    (equal to ``Partitions.block_ids(n)`` wherever that fits in int32)."""
    H, S = widths.shape
    w, c = widths.to(torch.float64), offsets.to(torch.float64)
    out = torch.empty(H, S, n, dtype=torch.int32, device=widths.device)
    chunk = max(1, _IDS_CHUNK_ELEMENTS // max(1, H * S))
    for lo in range(0, n, chunk):
        u = torch.arange(lo, min(n, lo + chunk), dtype=torch.float64, device=widths.device)
        out[..., lo:lo + u.numel()] = block_labels(w, c, u).to(torch.int32)
    return out


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
