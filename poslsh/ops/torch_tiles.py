"""The torch backend's tile plan: query tiles grouped by padded key-range width
(:class:`TileGroup`) and the chunks the kernels loop over (:class:`Chunk`), each with its
additive bias: ``log count`` (built by difference arrays) plus, for the window op, ALiBi's
``-m_h |i - j|``. Input: the :class:`~.torch_plan.RowBounds` of any op. Plain torch.
"""
from __future__ import annotations

import math
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import AttnShape
from .torch_plan import RowBounds

__all__ = ["CHUNK_ELEMENTS", "TileGroup", "Chunk", "choose_tiles", "plan_tiles", "iter_chunks", "score_elements"]

# Score elements (batch x tiles x T x R) per chunk: bounds transient memory (a few
# such buffers live at once, ~16 MiB each in float32) while keeping the batched matmuls
# large. Fewer, larger chunks also mean fewer parallel regions per call: on a CPU shared
# with other processes every region's barrier can wait a scheduler time slice for a
# descheduled thread, so at n = 16384 (H = 4, s = 10, 2 threads, load ~7 on 2 cores)
# 2^22 took 1.8 s per forward against 3.6 s for 2^21 (benchmarks/bench_cpu.py --busy).
CHUNK_ELEMENTS = 1 << 22


class TileGroup(NamedTuple):
    """Query tiles of ``tile`` rows whose key range is padded to ``width``; ``[U]`` each. A tile
    holds the query rows ``[q0, q1)`` (``q1 - q0 <= tile``: a document's last tile may be short)."""

    tile: int
    width: int
    head: Tensor     # query head
    q0: Tensor       # first query row
    k0: Tensor       # first key row of the range
    q1: Tensor       # one past the last query row


def _pad_width(r: Tensor) -> Tensor:
    """Round key-range widths up to a coarse grid (<= 25% padding) so few groups form."""
    q = torch.clamp(2 ** (torch.log2(r.double().clamp(min=1)).floor().long() - 2), min=16)
    return (r + q - 1) // q * q


def _power_of_two_at_least(n: Tensor) -> Tensor:
    return 2 ** torch.ceil(torch.log2(n.double().clamp(min=1))).long()


def choose_tiles(widths: Tensor, n: int) -> Tensor:
    """Query-tile height per head from its widest block (``widths [H, s]``): 32 rows (< 128),
    64 (< 1024), else 128. A taller tile shares one gathered key range among more queries,
    but a causal tile wastes about half its height in keys per row; measured at sigma = 4..256."""
    widest = widths.amax(1).cpu()
    t = torch.where(widest < 128, 32, torch.where(widest < 1024, 64, 128))
    return torch.clamp(t, max=1 << max(0, math.ceil(math.log2(n))))


def plan_tiles(bounds: RowBounds, n: int, tiles: Tensor,
               segments: Optional[Tuple[Tensor, Tensor]] = None) -> List[TileGroup]:
    """Cut the ``n`` query rows of head ``h`` into tiles of ``tiles[h]`` rows; group all tiles by
    (tile, padded key-range width).

    ``segments`` (first row and one past the last of every packed document, int64 ``[D]``):
    tiles restart at every document, and a document of ``L`` rows gets tiles of at most the power
    of two ``>= L`` rows, exactly the tiles it would get alone (:func:`choose_tiles`), so a packed
    row costs what its documents cost one by one and no tile mixes documents."""
    dev = bounds.start.device
    if segments is None:
        segments = (torch.zeros(1, dtype=torch.int64, device=dev), torch.full((1,), n, dtype=torch.int64, device=dev))
    first, last = (x.to(dev) for x in segments)
    tiles = tiles.to(dev)
    D = first.numel()
    T = torch.minimum(tiles[:, None], _power_of_two_at_least(last - first)[None])      # [H, D]
    per_pair = ((last - first)[None] + T - 1) // T                                       # tiles of (head, doc)
    pair = torch.repeat_interleave(torch.arange(T.numel(), device=dev), per_pair.reshape(-1))
    rank = torch.arange(pair.numel(), device=dev) - (torch.cumsum(per_pair.reshape(-1), 0) - per_pair.reshape(-1))[pair]
    head, doc, tile = pair // D, pair % D, T.reshape(-1)[pair]
    q0 = first[doc] + rank * tile
    q1 = torch.minimum(q0 + tile, last[doc])
    lo = bounds.start[head, q0].amin(-1)                    # starts grow along a document's rows
    hi = bounds.end[head, q1 - 1].amax(-1)                  # and so do ends
    if bounds.causal:
        hi = torch.minimum(hi, q1 + bounds.delta)
    width = _pad_width(hi - lo)
    key = tile * (int(width.max()) + 1) + width
    groups = []
    for k in torch.unique(key).tolist():
        sel = key == k
        i = int(torch.nonzero(sel)[0])
        groups.append(TileGroup(int(tile[i]), int(width[i]), head[sel], q0[sel], lo[sel], q1[sel]))
    return groups


def score_elements(groups: List[TileGroup]) -> int:
    """Scores the plan computes per batch row (tiles x rows x padded key-range width): its cost."""
    return sum(g.head.numel() * g.tile * g.width for g in groups)


class Chunk(NamedTuple):
    rows: Tensor       # [U*T] flat query rows into [Hq*n_q] (clamped in range)
    out_rows: Tensor   # [U*T] same, rows past a tile's end go to the sink row Hq*n_q
    kv_rows: Tensor    # [U*R] flat key rows into [Hkv*n_k] (clamped in range)
    bias: Tensor       # [U, T, R] log count (+ -m |i - j| for the window op); -inf where no weight
    units: int
    tile: int
    width: int


def _units_per_chunk(g: TileGroup, batch: int) -> int:
    return max(1, CHUNK_ELEMENTS // (batch * g.tile * g.width))


def iter_chunks(groups: List[TileGroup], bounds: RowBounds, shape: AttnShape, ct,
                slopes: Optional[Tensor] = None) -> Iterator[Chunk]:
    """The plan's chunks with their bias: ``log count_ij`` (the samples in which query ``i`` and
    key ``j`` share a block; ``-inf`` for none, and after the query when causal), plus
    ``-slopes[h] |i - j|`` when ``slopes`` (``[H]``, the window op: one sample, so the count is
    0 or 1 and the bias is exact ALiBi inside the window). The one definition of a chunk's bias."""
    n, nk, Hq, group = shape.seqlen, shape.kv_len, shape.q_heads, shape.group
    H, _, s = bounds.start.shape
    causal, delta = bounds.causal, bounds.delta
    # [H*n, s] views: one index_select fetches a row's block bounds in all samples.
    start_rows = bounds.start.view(H * n, s)
    end_rows = bounds.end.view(H * n, s)
    dev = start_rows.device
    log_table = torch.arange(s + 1, dtype=ct, device=dev).log()   # log 0 = -inf
    neg_slopes = None if slopes is None else -slopes.to(device=dev, dtype=ct)
    # Buffers reused by every chunk (fresh large allocations cost page faults each
    # time). The difference buffer is zero between chunks: each chunk's scatters are
    # undone after use, O(s) per row instead of re-zeroing O(R) per row.
    cap = max(min(_units_per_chunk(g, shape.batch), g.head.numel()) * g.tile * (g.width + 1) for g in groups)
    diff_buf = torch.zeros(cap, dtype=torch.int64, device=dev)
    count_buf = torch.empty(cap, dtype=torch.int64, device=dev)
    for g in groups:
        T, R = g.tile, g.width
        per_chunk = _units_per_chunk(g, shape.batch)
        ar_t, ar_r = torch.arange(T, device=dev), torch.arange(R, device=dev)
        for lo in range(0, g.head.numel(), per_chunk):
            head, q0, k0, q1 = (x[lo:lo + per_chunk] for x in (g.head, g.q0, g.k0, g.q1))
            U = head.numel()
            raw = q0[:, None] + ar_t                                   # [U, T] query rows
            # rows past a tile's end repeat its last row (same document, keys in range) and
            # write to the sink row
            pos = torch.minimum(raw, q1[:, None] - 1)
            rows = head[:, None] * n + pos
            out_rows = torch.where(raw < q1[:, None], rows, torch.full_like(rows, Hq * n)).reshape(-1)
            rows = rows.reshape(-1)
            keys = k0[:, None] + ar_r                                  # [U, R] key rows (may pass n_k)
            kv_rows = ((head // group)[:, None] * nk + keys.clamp(max=nk - 1)).reshape(-1)
            # Rows of a tile whose blocks are the same in every sample have the same
            # counts: build them once per run of such rows ("segment"), then copy rows.
            # (Both ends are compared: a window clipped at the sequence start keeps its start.)
            start_r = start_rows.index_select(0, rows).view(U, T, s)
            end_r = end_rows.index_select(0, rows).view(U, T, s)
            new_seg = torch.ones(U, T, dtype=torch.bool, device=dev)
            new_seg[:, 1:] = ((start_r[:, 1:] != start_r[:, :-1]) | (end_r[:, 1:] != end_r[:, :-1])).any(-1)
            new_seg = new_seg.view(-1)
            rep = torch.nonzero(new_seg).flatten()
            seg = torch.cumsum(new_seg, 0) - 1
            M = rep.numel()
            base = k0.repeat_interleave(T)[rep, None]
            rel_start = start_r.view(U * T, s)[rep] - base              # [M, s], in [0, R)
            rel_end = (end_r.view(U * T, s)[rep] - base).clamp_(max=R)
            diff = diff_buf[: M * (R + 1)].view(M, R + 1)
            one = torch.ones((), dtype=torch.int64, device=dev).expand(rel_start.shape)
            diff.scatter_add_(1, rel_start, one).scatter_add_(1, rel_end, -one)
            count = torch.cumsum(diff, 1, out=count_buf[: M * (R + 1)].view(M, R + 1))
            diff.scatter_add_(1, rel_start, -one).scatter_add_(1, rel_end, one)   # back to zeros
            # log via a table: integer counts 0..s, and torch.log is slow on zeros.
            bias = F.embedding(seg, torch.take(log_table, count[:, :R])).view(U, T, R)
            if neg_slopes is not None:
                dist = ((pos + delta)[:, :, None] - keys[:, None, :]).abs_().to(ct)
                bias.add_(dist.mul_(neg_slopes[head][:, None, None]))
            if causal:  # keys after the query: only columns from the earliest tile start on
                c0 = max(0, int((q0 + delta - k0).min()))
                later = keys[:, None, c0:] > (pos + delta)[:, :, None]
                bias[:, :, c0:].masked_fill_(later, float("-inf"))
            yield Chunk(rows, out_rows, kv_rows, bias, U, T, R)
