"""The torch backend's plan: where the queries and keys sit (:class:`Span`), each query row's
blocks as key rows (:class:`RowBounds`), query tiles grouped by padded key-range width
(:class:`TileGroup`) and the chunks the kernels loop over (:class:`Chunk`, with the
``log count`` bias built by difference arrays). Plain torch; see :mod:`.torch_impl`.
"""
from __future__ import annotations

import math
from typing import Iterator, List, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import AttnShape
from ..partitions import Partitions

__all__ = ["CHUNK_ELEMENTS", "Span", "RowBounds", "TileGroup", "Chunk", "row_bounds", "plan_tiles", "choose_tiles",
           "iter_chunks"]

# Score elements (batch x tiles x T x R) per chunk: bounds transient memory (a few
# such buffers live at once, ~16 MiB each in float32) while keeping the batched matmuls
# large. Fewer, larger chunks also mean fewer parallel regions per call: on a CPU shared
# with other processes every region's barrier can wait a scheduler time slice for a
# descheduled thread, so at n = 16384 (H = 4, s = 10, 2 threads, load ~7 on 2 cores)
# 2^22 took 1.8 s per forward against 3.6 s for 2^21 (benchmarks/bench_cpu.py --busy).
CHUNK_ELEMENTS = 1 << 22


class Span(NamedTuple):
    """Absolute positions: query row ``i`` is token ``q_start + i``, key row ``j`` is token
    ``k_start + j``, in a sequence of ``seq_len`` tokens (blocks end there)."""

    q_start: int
    k_start: int
    n_q: int
    n_k: int
    seq_len: int

    @staticmethod
    def self_attention(n: int) -> "Span":
        return Span(0, 0, n, n, n)

    @property
    def is_self(self) -> bool:
        return self.q_start == self.k_start == 0 and self.n_q == self.n_k == self.seq_len

    @property
    def delta(self) -> int:
        """Query row ``i`` sits at key row ``i + delta``."""
        return self.q_start - self.k_start


class RowBounds(NamedTuple):
    """Per (head, query row, sample): the block of the query, as key rows ``[start, end)``
    (int64 ``[H, n_q, s]``; a row's bounds in all samples are contiguous); ``causal``
    says keys after the query are masked as well; query row ``i`` is key row ``i + delta``."""

    start: Tensor
    end: Tensor
    causal: bool
    delta: int = 0


class TileGroup(NamedTuple):
    """Query tiles of ``tile`` rows whose key range is padded to ``width``; ``[U]`` each."""

    tile: int
    width: int
    head: Tensor     # query head
    q0: Tensor       # first query row
    k0: Tensor       # first key row of the range


def row_bounds(partitions: Partitions, span, causal: bool, device) -> RowBounds:
    """The query rows' blocks as key rows; ``span`` is a :class:`Span` or, for
    self-attention, the sequence length. Raises if the keys miss a key a query can see."""
    if not isinstance(span, Span):
        span = Span.self_attention(int(span))
    H, s = partitions.num_heads, partitions.num_samples
    if span.is_self:   # all positions: from the blocks, O(H s n) integer work
        n = span.seq_len
        blk = partitions.blocks(n)
        start = torch.repeat_interleave(blk.start, blk.length).view(H, s, n).transpose(1, 2)
        end = torch.repeat_interleave(blk.start + blk.length, blk.length).view(H, s, n).transpose(1, 2)
        return RowBounds(start.to(device).contiguous(), end.to(device).contiguous(), causal, 0)
    pos = torch.arange(span.q_start, span.q_start + span.n_q, device=partitions.device)
    start, end = partitions.block_bounds(span.seq_len, pos)                 # [H, s, n_q], absolute
    need_lo = int(start.min())
    need_hi = int(torch.minimum(end, pos + 1).max() if causal else end.max())
    if need_lo < span.k_start or need_hi > span.k_start + span.n_k:
        raise ValueError(
            f"keys cover positions [{span.k_start}, {span.k_start + span.n_k}) but the queries at "
            f"[{span.q_start}, {span.q_start + span.n_q}) can see keys in [{need_lo}, {need_hi}): pass keys from "
            f"k_start <= {need_lo} to at least {need_hi} (a cache must not drop keys a later query needs)")
    start, end = (x.transpose(1, 2).to(device).contiguous() - span.k_start for x in (start, end))
    return RowBounds(start, end, causal, span.delta)


def _pad_width(r: Tensor) -> Tensor:
    """Round key-range widths up to a coarse grid (<= 25% padding) so few groups form."""
    q = torch.clamp(2 ** (torch.log2(r.double().clamp(min=1)).floor().long() - 2), min=16)
    return (r + q - 1) // q * q


def plan_tiles(bounds: RowBounds, n: int, tiles: Tensor) -> List[TileGroup]:
    """Cut the ``n`` query rows of head ``h`` into tiles of ``tiles[h]`` rows; group all
    tiles by (tile, padded key-range width)."""
    dev = bounds.start.device
    groups = []
    for T in torch.unique(tiles).tolist():
        heads = torch.nonzero(tiles == T).flatten()
        q0 = torch.arange(0, n, T, device=dev)
        last = torch.clamp(q0 + T, max=n) - 1
        lo = bounds.start[heads][:, q0].amin(-1)              # [h, tiles]: starts grow along rows
        hi = bounds.end[heads][:, last].amax(-1)              # ends grow along rows
        if bounds.causal:
            hi = torch.minimum(hi, last + 1 + bounds.delta)
        width = _pad_width(hi - lo).reshape(-1)
        head = heads[:, None].expand_as(lo).reshape(-1)
        q0, lo = q0[None].expand_as(lo).reshape(-1), lo.reshape(-1)
        for w in torch.unique(width).tolist():
            sel = width == w
            groups.append(TileGroup(int(T), int(w), head[sel], q0[sel], lo[sel]))
    return groups


def choose_tiles(widths: Tensor, n: int) -> Tensor:
    """Query-tile height per head from its widest block (``widths [H, s]``): 32 rows (< 128),
    64 (< 1024), else 128. A taller tile shares one gathered key range among more queries,
    but a causal tile wastes about half its height in keys per row; measured at sigma = 4..256."""
    widest = widths.amax(1).cpu()
    t = torch.where(widest < 128, 32, torch.where(widest < 1024, 64, 128))
    return torch.clamp(t, max=1 << max(0, math.ceil(math.log2(n))))


class Chunk(NamedTuple):
    rows: Tensor       # [U*T] flat query rows into [Hq*n_q] (clamped in range)
    out_rows: Tensor   # [U*T] same, rows past n_q go to the sink row Hq*n_q
    kv_rows: Tensor    # [U*R] flat key rows into [Hkv*n_k] (clamped in range)
    log_count: Tensor  # [U, T, R] log(#samples in which query and key share a block), -inf if none
    units: int
    tile: int
    width: int


def _units_per_chunk(g: TileGroup, batch: int) -> int:
    return max(1, CHUNK_ELEMENTS // (batch * g.tile * g.width))


def iter_chunks(groups: List[TileGroup], bounds: RowBounds, shape: AttnShape, ct) -> Iterator[Chunk]:
    n, nk, Hq, group = shape.seqlen, shape.kv_len, shape.q_heads, shape.group
    H, _, s = bounds.start.shape
    causal, delta = bounds.causal, bounds.delta
    # [H*n, s] views: one index_select fetches a row's block bounds in all samples.
    start_rows = bounds.start.view(H * n, s)
    end_rows = bounds.end.view(H * n, s)
    dev = start_rows.device
    log_table = torch.arange(s + 1, dtype=ct, device=dev).log()   # log 0 = -inf
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
            head, q0, k0 = g.head[lo:lo + per_chunk], g.q0[lo:lo + per_chunk], g.k0[lo:lo + per_chunk]
            U = head.numel()
            pos = q0[:, None] + ar_t                                   # [U, T] query rows
            rows = head[:, None] * n + pos.clamp(max=n - 1)
            out_rows = torch.where(pos < n, rows, torch.full_like(rows, Hq * n)).reshape(-1)
            rows = rows.reshape(-1)
            keys = (k0[:, None] + ar_r).clamp(max=nk - 1)
            kv_rows = ((head // group)[:, None] * nk + keys).reshape(-1)
            # Rows of a tile whose blocks are the same in every sample have the same
            # counts: build them once per run of such rows ("segment"), then copy rows.
            start_r = start_rows.index_select(0, rows)                # [U*T, s]
            new_seg = torch.ones(U, T, dtype=torch.bool, device=dev)
            new_seg[:, 1:] = (start_r.view(U, T, s)[:, 1:] != start_r.view(U, T, s)[:, :-1]).any(-1)
            new_seg = new_seg.view(-1)
            rep = torch.nonzero(new_seg).flatten()
            seg = torch.cumsum(new_seg, 0) - 1
            M = rep.numel()
            base = k0.repeat_interleave(T)[rep, None]
            rel_start = start_r[rep] - base                             # [M, s], >= 0
            rel_end = (end_rows.index_select(0, rows[rep]) - base).clamp_(max=R)
            diff = diff_buf[: M * (R + 1)].view(M, R + 1)
            one = torch.ones((), dtype=torch.int64, device=dev).expand(rel_start.shape)
            diff.scatter_add_(1, rel_start, one).scatter_add_(1, rel_end, -one)
            count = torch.cumsum(diff, 1, out=count_buf[: M * (R + 1)].view(M, R + 1))
            diff.scatter_add_(1, rel_start, -one).scatter_add_(1, rel_end, one)   # back to zeros
            # log via a table: integer counts 0..s, and torch.log is slow on zeros.
            log_count = F.embedding(seg, torch.take(log_table, count[:, :R])).view(U, T, R)
            if causal:  # keys after the query: only columns from the earliest tile start on
                c0 = max(0, int((q0 + delta - k0).min()))
                later = (k0[:, None] + ar_r[c0:])[:, None, :] > (pos + delta)[:, :, None]
                log_count[:, :, c0:].masked_fill_(later, float("-inf"))
            yield Chunk(rows, out_rows, kv_rows, log_count, U, T, R)


