"""The torch backend's tile plan: query tiles grouped by padded key-range width
(:class:`TileGroup`) and the chunks the kernels loop over (:class:`Chunk`), each with its
additive bias: ``log count`` (built by difference arrays) plus, for the window op, ALiBi's
``-m_h |i - j|``. Input: the :class:`~.plan.RowBounds` of any op. Plain torch.
"""
from __future__ import annotations

import math
import threading
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._validation import AttnShape
from .plan import RowBounds

__all__ = ["CHUNK_ELEMENTS", "TileGroup", "Chunk", "choose_tiles", "plan_tiles", "ChunkMaker", "iter_chunks",
           "score_elements"]

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


def _units_per_chunk(g: TileGroup, batch: int, elements: int) -> int:
    return max(1, elements // (batch * g.tile * g.width))


def _log_counts(start_r: Tensor, end_r: Tensor, k0: Tensor, keys: Tensor, diff_buf: Tensor, count_buf: Tensor,
                log_table: Tensor, U: int, T: int, R: int, s: int) -> Tensor:
    """``log count`` ``[U, T, R]`` of a chunk's rows (block bounds ``[U, T, s]`` as key rows) by
    difference arrays: +1 at each block's start, -1 at its end, one cumulative sum. Rows of a tile
    whose blocks are the same in every sample have the same counts: they are built once per run
    of such rows ("segment"), then copied."""
    dev = start_r.device
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
    return F.embedding(seg, torch.take(log_table, count[:, :R])).view(U, T, R)


def _window_bias(q_rel: Tensor, lo: Tensor, hi: Tensor, head: Tensor, neg_slopes: Tensor, half: Tensor,
                 R: int, ct) -> Tensor:
    """A window chunk's bias ``[U, T, R]``: ``-m_h |i - j|`` on the columns ``[lo, hi)`` of each row
    (``q_rel [U, T]``: the query's own column, all relative to the tile's first key), ``-inf``
    elsewhere. A row whose window is not clipped (by the sequence, a document or the tile's end)
    has ``[lo, hi) = [q - w, q + w + 1)``, so in a tile of such rows the bias depends only on the
    head and the tile's offset ``q_rel[:, 0]``: a Toeplitz matrix built once per (head, offset) and
    copied, instead of a distance, a mask and a product per score (the chunk cost that made the
    window slower than positional LSH at equal keys per query)."""
    U, T = q_rel.shape
    w = half[head][:, None]                                                  # [U, 1]
    c = q_rel[:, 0]
    plain = ((q_rel == c[:, None] + torch.arange(T, device=c.device)) & (lo == q_rel - w)
             & (hi == q_rel + w + 1)).all(1)                                 # [U]
    cols = torch.arange(R, device=c.device, dtype=ct)
    bias = torch.empty(U, T, R, dtype=ct, device=c.device)
    if bool(plain.any()):
        key = head[plain] * (R + T + 1) + c[plain]
        uniq, inv = torch.unique(key, return_inverse=True)
        h_k, c_k = uniq // (R + T + 1), uniq % (R + T + 1)
        d = (c_k[:, None, None] + torch.arange(T, device=c.device)[None, :, None]).to(ct) - cols
        d.abs_()
        tmpl = (d * neg_slopes[h_k][:, None, None]).masked_fill_(d > half[h_k].to(ct)[:, None, None], float("-inf"))
        bias[plain] = tmpl[inv]
    rest = ~plain
    if bool(rest.any()):
        qr, l, hh = q_rel[rest].to(ct)[:, :, None], lo[rest].to(ct)[:, :, None], hi[rest].to(ct)[:, :, None]
        b = (qr - cols).abs_().mul_(neg_slopes[head[rest]][:, None, None])
        bias[rest] = b.masked_fill_((cols < l).logical_or_(cols >= hh), float("-inf"))
    return bias


class ChunkMaker:
    """The plan's chunks, built one at a time from any thread: ``specs`` lists them (a group and
    its first tile; cost ``units x tile x width``), ``make(spec)`` builds one :class:`Chunk` with its
    bias: ``log count_ij`` (the samples in which query ``i`` and key ``j`` share a block; ``-inf``
    for none, and after the query when causal), plus ``-slopes[h] |i - j|`` when ``slopes`` (``[H]``,
    the window op: one sample, so the count is 0 or 1 and the bias is exact ALiBi inside the
    window). The one definition of a chunk's bias. ``elements``: scores per chunk (default
    :data:`CHUNK_ELEMENTS`)."""

    def __init__(self, groups: List[TileGroup], bounds: RowBounds, shape: AttnShape, ct,
                 slopes: Optional[Tensor] = None, elements: Optional[int] = None):
        H, n, s = bounds.start.shape
        self.shape, self.ct, self.bounds = shape, ct, bounds
        # [H*n, s] views: one index_select fetches a row's block bounds in all samples.
        self.start_rows, self.end_rows = bounds.start.view(H * n, s), bounds.end.view(H * n, s)
        dev = bounds.start.device
        self.log_table = torch.arange(s + 1, dtype=ct, device=dev).log()   # log 0 = -inf
        self.neg_slopes = None if slopes is None else -slopes.to(device=dev, dtype=ct)
        # the window op: the half-width of each head's widest row, the window of its unclipped rows
        self.half = None if slopes is None else ((bounds.end - bounds.start).amax(dim=(1, 2)) - 1) // 2
        per = [_units_per_chunk(g, shape.batch, elements or CHUNK_ELEMENTS) for g in groups]
        self.specs = [(g, lo, min(u, g.head.numel() - lo)) for g, u in zip(groups, per)
                      for lo in range(0, g.head.numel(), u)]
        self._cap = max((u * g.tile * (g.width + 1) for g, _, u in self.specs), default=0)
        self._buffers = threading.local()

    @staticmethod
    def cost(spec) -> int:
        g, _, units = spec
        return units * g.tile * g.width

    def _difference_buffers(self, dev) -> Tuple[Tensor, Tensor]:
        """This thread's buffers, reused by its chunks (fresh large allocations cost page faults each
        time). The difference buffer is zero between chunks: each chunk's scatters are undone after
        use, O(s) per row instead of re-zeroing O(R) per row."""
        b = self._buffers
        if getattr(b, "diff", None) is None:
            b.diff = torch.zeros(self._cap, dtype=torch.int64, device=dev)
            b.count = torch.empty(self._cap, dtype=torch.int64, device=dev)
        return b.diff, b.count

    def make(self, spec) -> Chunk:
        g, lo, U = spec
        shape, ct, bounds = self.shape, self.ct, self.bounds
        n, nk, Hq, group = shape.seqlen, shape.kv_len, shape.q_heads, shape.group
        s, causal, delta = bounds.start.shape[2], bounds.causal, bounds.delta
        T, R = g.tile, g.width
        dev = bounds.start.device
        head, q0, k0, q1 = (x[lo:lo + U] for x in (g.head, g.q0, g.k0, g.q1))
        raw = q0[:, None] + torch.arange(T, device=dev)                  # [U, T] query rows
        # rows past a tile's end repeat its last row (same document, keys in range) and
        # write to the sink row
        pos = torch.minimum(raw, q1[:, None] - 1)
        rows = head[:, None] * n + pos
        out_rows = torch.where(raw < q1[:, None], rows, torch.full_like(rows, Hq * n)).reshape(-1)
        rows = rows.reshape(-1)
        keys = k0[:, None] + torch.arange(R, device=dev)                 # [U, R] key rows (may pass n_k)
        kv_rows = ((head // group)[:, None] * nk + keys.clamp(max=nk - 1)).reshape(-1)
        start_r = self.start_rows.index_select(0, rows).view(U, T, s)
        end_r = self.end_rows.index_select(0, rows).view(U, T, s)
        if self.neg_slopes is not None:
            bias = _window_bias(pos + delta - k0[:, None], start_r.view(U, T) - k0[:, None],
                                end_r.view(U, T) - k0[:, None], head, self.neg_slopes, self.half, R, ct)
        else:
            bias = _log_counts(start_r, end_r, k0, keys, *self._difference_buffers(dev), self.log_table, U, T, R, s)
        if causal:  # keys after the query: only columns from the earliest tile start on
            c0 = max(0, int((q0 + delta - k0).min()))
            later = keys[:, None, c0:] > (pos + delta)[:, :, None]
            bias[:, :, c0:].masked_fill_(later, float("-inf"))
        return Chunk(rows, out_rows, kv_rows, bias, U, T, R)


def iter_chunks(groups: List[TileGroup], bounds: RowBounds, shape: AttnShape, ct,
                slopes: Optional[Tensor] = None) -> Iterator[Chunk]:
    """The plan's chunks in order (:class:`ChunkMaker`)."""
    maker = ChunkMaker(groups, bounds, shape, ct, slopes)
    return (maker.make(spec) for spec in maker.specs)
