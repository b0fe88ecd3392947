"""The ``"torch"`` backend of the ``"nd"`` op (on a 2-D grid): near-linear positional-LSH attention on a 2-D
token grid (images), in plain PyTorch.

Tokens form a ``Gr x Gc`` grid in raster order. In sample ``t`` the block of the query at
``(r, c)`` is the box ``[rlo_t(r), rhi_t(r)) x [clo_t(c), chi_t(c))``, whose sides are 1-D
random-binning bins (:func:`poslsh.partitions.block_bounds` per axis): their ends are
non-decreasing in the coordinate. So for a *query tile* (a ``tr x tc`` patch of the grid, one
head) the union over all samples of its queries' boxes lies in one bounding box of keys,
rows ``[min_t rlo_t(R0), max_t rhi_t(R1))`` and columns likewise. It is gathered once, and every
score gets the bias ``log count`` with

    ``count[(i, j), (a, b)] = sum_t [a in rowbin_t(i)] * [b in colbin_t(j)]``

the number of samples in which query and key share a box on *both* axes (a sum over samples
of products, not a product of per-axis counts): one batched matmul over the sample axis,
``[tr * pr, s] @ [s, tc * pc]``, of the per-axis indicators. The estimator is then one softmax
(sum of numerators over sum of denominators, paper section 4), every score computed once.
Tiles are grouped by padded bounding-box size; each group is one batched matmul over all heads
and tiles. Raster-causal attention masks keys after the query in raster order.

Backward is flash-attention 2's, recomputed tile by tile from the saved log-sum-exp. Chunks run on
threads, the key gradients added in one fixed order (:mod:`.workers`): bitwise the same
results whatever the thread count. Memory is ``O(n (d + s))`` plus a few bounded chunks: no
``n x n`` tensor. Both directions are
``torch.library`` custom ops. The log-sum-exp is computed but not offered (``return_lse``): its
gradient would need the backward op to pass ``dlse`` on to :func:`~poslsh.ops.torch.kernels.tiled_backward`.
"""
from __future__ import annotations

import threading
from typing import List, NamedTuple, Tuple

import torch
from torch import Tensor

from ..._validation import AttnShape, compute_dtype
from ...partitions import block_bounds
from ..registry import register_backend
from .kernels import flat_rows, gather_rows, tiled_backward
from .workers import run_items

__all__ = ["GridBounds", "grid_bounds", "plan_tiles_2d", "attention_2d", "forward", "backward"]

# Score elements (batch x tiles x T x R) per chunk: bounds transient memory.
CHUNK_ELEMENTS = 1 << 21


class GridBounds(NamedTuple):
    """Per head, sample and grid line: the bin of every row ``[rlo, rhi)`` (int64 ``[H, s, Gr]``)
    and of every column ``[clo, chi)`` (``[H, s, Gc]``); ``causal``: raster-causal."""

    rlo: Tensor
    rhi: Tensor
    clo: Tensor
    chi: Tensor
    causal: bool

    @property
    def grid(self) -> Tuple[int, int]:
        return self.rlo.shape[2], self.clo.shape[2]


def grid_bounds(widths: Tensor, offsets: Tensor, grid: Tuple[int, int], causal: bool, device) -> GridBounds:
    """Box sides of a ``grid`` from ``[H, s, 2]`` widths/offsets (axis 0: rows, axis 1: columns),
    by the one 1-D geometry; ``O(H s (Gr + Gc))``."""
    Gr, Gc = grid
    dev = widths.device
    rlo, rhi = block_bounds(widths[..., 0], offsets[..., 0], Gr, torch.arange(Gr, device=dev))
    clo, chi = block_bounds(widths[..., 1], offsets[..., 1], Gc, torch.arange(Gc, device=dev))
    return GridBounds(*(x.to(device).contiguous() for x in (rlo, rhi, clo, chi)), causal)


class TileGroup2D(NamedTuple):
    """Query tiles of ``tr x tc`` cells whose key box is padded to ``pr x pc``; ``[U]`` each."""

    tr: int
    tc: int
    pr: int
    pc: int
    head: Tensor   # query head
    r0: Tensor     # first query row / column of the tile
    c0: Tensor
    kr0: Tensor    # first key row / column of the box
    kc0: Tensor


def _pad(size: Tensor, limit: int) -> Tensor:
    """Round box sides up (<= 25% padding) so few groups form, never past the grid."""
    q = torch.clamp(2 ** (torch.log2(size.double().clamp(min=1)).floor().long() - 2), min=1)
    return torch.clamp((size + q - 1) // q * q, max=limit)


def choose_tiles(widths: Tensor, grid: Tuple[int, int]) -> Tensor:
    """Tile sides ``[H, 2]`` per head: 4 cells along an axis whose widest bin is below 8, else 8
    (a larger tile shares its gathered keys among more queries, a smaller one gathers a tighter
    box), never more than the grid."""
    widest = widths.amax(1).cpu()                                   # [H, 2]
    t = torch.where(widest < 8, 4, 8)
    return torch.minimum(t, torch.tensor(grid))


def plan_tiles_2d(b: GridBounds, tiles: Tensor) -> List[TileGroup2D]:
    """Cut the grid into tiles of ``tiles[h]`` cells for head ``h``; group all tiles by
    (tile, padded bounding box)."""
    Gr, Gc = b.grid
    dev = b.rlo.device
    tiles = tiles.to(dev)
    groups = []
    for tr, tc in torch.unique(tiles, dim=0).tolist():
        heads = torch.nonzero((tiles[:, 0] == tr) & (tiles[:, 1] == tc)).flatten()
        R0, C0 = torch.arange(0, Gr, tr, device=dev), torch.arange(0, Gc, tc, device=dev)
        R1, C1 = torch.clamp(R0 + tr, max=Gr) - 1, torch.clamp(C0 + tc, max=Gc) - 1
        rlo = b.rlo[heads][:, :, R0].amin(1)                       # [h, nR]: bin ends grow along the axis
        rhi = b.rhi[heads][:, :, R1].amax(1)
        if b.causal:                                               # no key row below the tile's last row
            rhi = torch.minimum(rhi, R1 + 1)
        clo, chi = b.clo[heads][:, :, C0].amin(1), b.chi[heads][:, :, C1].amax(1)   # [h, nC]
        pr, pc = _pad(rhi - rlo, Gr), _pad(chi - clo, Gc)
        kr0, kc0 = torch.minimum(rlo, Gr - pr), torch.minimum(clo, Gc - pc)      # padding stays in the grid
        h, nR, nC = heads.numel(), R0.numel(), C0.numel()
        full = lambda x, along: (x[:, :, None] if along == 0 else x[:, None, :]).expand(h, nR, nC).reshape(-1)  # noqa: E731
        head = heads[:, None, None].expand(h, nR, nC).reshape(-1)
        r0, c0 = R0[None, :, None].expand(h, nR, nC).reshape(-1), C0[None, None, :].expand(h, nR, nC).reshape(-1)
        pr, pc, kr0, kc0 = full(pr, 0), full(pc, 1), full(kr0, 0), full(kc0, 1)
        for a, c in torch.unique(torch.stack([pr, pc], 1), dim=0).tolist():
            sel = (pr == a) & (pc == c)
            groups.append(TileGroup2D(int(tr), int(tc), int(a), int(c), head[sel], r0[sel], c0[sel],
                                      kr0[sel], kc0[sel]))
    return groups


class Chunk(NamedTuple):
    rows: Tensor       # [U*T] flat query rows into [Hq*n] (clamped into the grid)
    out_rows: Tensor   # [U*T] same, cells outside the grid go to the sink row Hq*n
    kv_rows: Tensor    # [U*R] flat key rows into [Hkv*n]
    count: Tensor      # [U, T, R] #samples in which query and key share a box (0 for a later key, causal)
    units: int
    tile: int
    width: int


class GridChunks:
    """The plan's chunks, built one at a time from any thread (as
    :class:`~poslsh.ops.tiles.ChunkMaker`): ``specs`` lists them (a group, its first tile and
    its tiles), ``cost(spec)`` is its score count, ``make(spec)`` builds its :class:`Chunk`."""

    def __init__(self, groups: List[TileGroup2D], b: GridBounds, shape: AttnShape, ct, batch: int):
        Gr, Gc = b.grid
        H, s = b.rlo.shape[:2]
        self.b, self.shape, self.ct = b, shape, ct
        # [H*G, s] views: one index_select fetches a line's bin in every sample.
        self.rlo, self.rhi = (x.transpose(1, 2).reshape(H * Gr, s) for x in (b.rlo, b.rhi))
        self.clo, self.chi = (x.transpose(1, 2).reshape(H * Gc, s) for x in (b.clo, b.chi))
        per = [max(1, CHUNK_ELEMENTS // (batch * g.tr * g.tc * g.pr * g.pc)) for g in groups]
        self.specs = [(g, lo, min(p, g.head.numel() - lo)) for g, p in zip(groups, per)
                      for lo in range(0, g.head.numel(), p)]

    @staticmethod
    def cost(spec) -> int:
        g, _, units = spec
        return units * g.tr * g.tc * g.pr * g.pc

    def make(self, spec) -> Chunk:
        g, lo, U = spec
        b, shape, ct = self.b, self.shape, self.ct
        Gr, Gc = b.grid
        n, Hq, group = shape.seqlen, shape.q_heads, shape.group
        s = b.rlo.shape[1]
        dev = b.rlo.device
        T, R = g.tr * g.tc, g.pr * g.pc
        ar = [torch.arange(x, device=dev) for x in (g.tr, g.tc, g.pr, g.pc)]
        sl = slice(lo, lo + U)
        head = g.head[sl]
        qr, qc = g.r0[sl, None] + ar[0], g.c0[sl, None] + ar[1]                 # [U, tr], [U, tc]
        inside = ((qr < Gr)[:, :, None] & (qc < Gc)[:, None, :]).reshape(U, T)
        qr, qc = qr.clamp(max=Gr - 1), qc.clamp(max=Gc - 1)
        qtok = (qr[:, :, None] * Gc + qc[:, None, :]).reshape(U, T)
        rows = head[:, None] * n + qtok
        out_rows = torch.where(inside, rows, torch.full_like(rows, Hq * n)).reshape(-1)
        kr, kc = g.kr0[sl, None] + ar[2], g.kc0[sl, None] + ar[3]               # [U, pr], [U, pc]
        # Keys in column-major order within the box (b, a): the count below then comes out of
        # one broadcast matmul already as [U, (i, j), (b, a)], with no permuted copy.
        ktok = (kr[:, None, :] * Gc + kc[:, :, None]).reshape(U, R)
        kv_rows = ((head // group)[:, None] * n + ktok).reshape(-1)
        # Per-axis indicators per sample; count = sum over samples of their products.
        row_idx = (head[:, None] * Gr + qr).reshape(-1)
        lr = self.rlo.index_select(0, row_idx).view(U, g.tr, s, 1)
        hr = self.rhi.index_select(0, row_idx).view(U, g.tr, s, 1)
        krv = kr[:, None, None, :]
        in_row = ((krv >= lr) & (krv < hr)).to(ct)                              # [U, tr, s, pr]
        col_idx = (head[:, None] * Gc + qc).reshape(-1)
        lc = self.clo.index_select(0, col_idx).view(U, g.tc, 1, s)
        hc = self.chi.index_select(0, col_idx).view(U, g.tc, 1, s)
        kcv = kc[:, None, :, None]
        in_col = ((kcv >= lc) & (kcv < hc)).to(ct).reshape(U, 1, g.tc * g.pc, s)  # [U, 1, (j, b), s]
        # [U, 1, (j, b), s] @ [U, tr, s, a] as one bmm (explicit expand: about 3x faster than
        # a broadcasting matmul here) -> [U, (i, j), (b, a)]; exact small integers.
        count = torch.bmm(in_col.expand(U, g.tr, g.tc * g.pc, s).reshape(U * g.tr, g.tc * g.pc, s),
                          in_row.reshape(U * g.tr, s, g.pr)).view(U, T, R)
        if b.causal:
            count.masked_fill_(ktok[:, None, :] > qtok[:, :, None], 0)
        return Chunk(rows.reshape(-1), out_rows, kv_rows, count, U, T, R)


def _scores(Qg: Tensor, Kg: Tensor, scale: float) -> Tensor:
    """``scale * Q K^T`` as ``[B, U, T, R]``."""
    return torch.matmul(Qg, Kg.transpose(-1, -2)).mul_(scale)


# A row's weight sum below this means its shared keys score far below a key it does not share
# (under the safe max below): recompute that chunk with the exact max (never seen in practice).
_FLOOR = {torch.float32: torch.finfo(torch.float32).tiny ** 0.5, torch.float64: torch.finfo(torch.float64).tiny ** 0.5}


def _weights(Qg: Tensor, Kg: Tensor, count: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``w = count * exp(s - m)``, ``m`` and ``sum w`` per row (``[B, U, T, R]``, ``[B, U, T, 1]`` x 2).

    Multiplying by ``count`` instead of adding ``log count`` skips a logarithm per score; ``m``,
    the max over the whole key box, is a safe shift (no overflow). If a row's sum underflows
    (its shared keys all score ~40+ below a key it does not share), the chunk is redone with the
    max over shared keys only, so the result is exact either way."""
    traced = torch.is_grad_enabled() and (Qg.requires_grad or Kg.requires_grad)   # double backward

    def weigh(s: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        m = s.amax(-1, keepdim=True).detach()
        w = torch.exp(s - m) * count if traced else s.sub_(m).exp_().mul_(count)
        return w, m, w.sum(-1, keepdim=True)

    w, m, denom = weigh(_scores(Qg, Kg, scale))
    if bool((denom < _FLOOR[w.dtype]).any()):
        w, m, denom = weigh(_scores(Qg, Kg, scale).masked_fill((count == 0).expand(w.shape), float("-inf")))
    return w, m, denom


def forward(q: Tensor, k: Tensor, v: Tensor, groups: List[TileGroup2D], b: GridBounds, shape: AttnShape,
            scale: float) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype) and ``lse [B, Hq, n]`` (float32, float64 for float64 input),
    ``lse_i = log sum_j count_ij exp(s_ij)``."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    qf, kf, vf = flat_rows(q, ct), flat_rows(k, ct), flat_rows(v, ct)
    out = torch.empty(B, Hq * n + 1, shape.v_dim, dtype=ct, device=q.device)    # + sink row
    lse = torch.empty(B, Hq * n + 1, dtype=ct, device=q.device)
    chunks = GridChunks(groups, b, shape, ct, B)
    writes = threading.Lock()                # several chunks write the sink row

    def run(spec):
        c = chunks.make(spec)
        Qg = gather_rows(qf, c.rows, c.units, c.tile)
        Kg, Vg = gather_rows(kf, c.kv_rows, c.units, c.width), gather_rows(vf, c.kv_rows, c.units, c.width)
        # Each query shares a box with itself in every sample: every row has a weight > 0.
        w, m, denom = _weights(Qg, Kg, c.count, scale)
        o = (torch.matmul(w, Vg) / denom).reshape(B, -1, shape.v_dim)
        with writes:                         # every other row is written once, by its own chunk
            lse.index_copy_(1, c.out_rows, (m + denom.log()).reshape(B, -1))
            out.index_copy_(1, c.out_rows, o)

    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):   # traced: double backward
        for spec in chunks.specs:
            run(spec)
    else:
        run_items(chunks.specs, run, cost=chunks.cost)
    return out[:, :-1].view(B, Hq, n, shape.v_dim).to(q.dtype), lse[:, :-1].view(B, Hq, n)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, groups: List[TileGroup2D],
             b: GridBounds, shape: AttnShape, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` by tile-wise recomputation with the saved ``lse`` (the torch backend's
    :func:`~poslsh.ops.torch.kernels.tiled_backward`; a query's whole key box lies in its one tile)."""
    def probabilities(Qg, Kg, c, lse_g):
        # p = count exp(s - lse); where count > 0, s - lse <= -log count <= 0, so clamping at 0
        # only touches keys with count 0 (no inf * 0).
        return _scores(Qg, Kg, scale).sub_(lse_g).clamp_max_(0).exp_().mul_(c.count)

    chunks = GridChunks(groups, b, shape, compute_dtype(q.dtype), shape.batch)
    return tiled_backward(dout, q, k, v, lse, chunks, shape, scale, probabilities)


# ------------------------------------------------------------------ custom ops
FWD_NAME = "poslsh::torch_attention_2d_fwd"
BWD_NAME = "poslsh::torch_attention_2d_bwd"


def _shape(q: Tensor, k: Tensor, v: Tensor) -> AttnShape:
    B, Hq, n, d = q.shape
    return AttnShape(B, Hq, k.shape[1], n, d, v.shape[-1], k.shape[2])


def _plan(widths: Tensor, offsets: Tensor, grid: List[int], causal: bool, device):
    g = (int(grid[0]), int(grid[1]))
    b = grid_bounds(widths, offsets, g, causal, device)
    return b, plan_tiles_2d(b, choose_tiles(widths, g))


@torch.library.custom_op(FWD_NAME, mutates_args=())
def torch_attention_2d_fwd(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, grid: List[int],
                           causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype) and ``lse [B, Hq, n]`` (float32, float64 for float64 input)."""
    b, groups = _plan(widths, offsets, grid, causal, q.device)
    with torch.autocast(q.device.type, enabled=False):
        out, lse = forward(q, k, v, groups, b, _shape(q, k, v), scale)
    return out.contiguous(), lse.contiguous()


@torch_attention_2d_fwd.register_fake
def _(q, k, v, widths, offsets, grid, causal, scale):
    B, Hq, n, _ = q.shape
    return q.new_empty(B, Hq, n, v.shape[-1]), q.new_empty(B, Hq, n, dtype=compute_dtype(q.dtype))


@torch.library.custom_op(BWD_NAME, mutates_args=())
def torch_attention_2d_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, widths: Tensor,
                           offsets: Tensor, grid: List[int], causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (contiguous, dtypes of q, k, v) by tile-wise recomputation."""
    b, groups = _plan(widths, offsets, grid, causal, q.device)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv = backward(dout.contiguous(), q, k, v, lse, groups, b, _shape(q, k, v), scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@torch_attention_2d_bwd.register_fake
def _(dout, q, k, v, lse, widths, offsets, grid, causal, scale):
    # contiguous, as the real op returns them, whatever the inputs' strides (transposed views)
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, widths, offsets, grid, causal, scale = inputs
    ctx.save_for_backward(q, k, v, output[1], widths, offsets)
    ctx.grid, ctx.causal, ctx.scale = list(grid), causal, scale
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, dlse):
    q, k, v, lse, widths, offsets = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True: differentiate a recomputation traced by autograd (same tiles, no n x n).
        b, groups = _plan(widths, offsets, ctx.grid, ctx.causal, q.device)
        with torch.autocast(q.device.type, enabled=False):
            out, _ = forward(q, k, v, groups, b, _shape(q, k, v), ctx.scale)
        wanted = [x for x in (q, k, v) if x.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, dout, create_graph=True, allow_unused=True))
        return (*[next(got) if x.requires_grad else None for x in (q, k, v)], None, None, None, None, None)
    dq, dk, dv = torch_attention_2d_bwd(dout, q, k, v, lse, widths, offsets, ctx.grid, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


torch_attention_2d_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_2d(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, grid: Tuple[int, int],
                 causal: bool, scale: float) -> Tensor:
    """2-D attention on validated inputs (widths and offsets ``[H, s, 2]`` float64 on q's device)."""
    out, _ = torch_attention_2d_fwd(q, k, v, widths, offsets, [int(grid[0]), int(grid[1])], bool(causal),
                                    float(scale))
    return out


def _grid(call):
    """The registry's entry (``backend="torch"``, op ``"nd"``): ``call.positional`` a
    :class:`~poslsh.partitions_nd.PartitionsND` with 2 axes on q's device."""
    axes = call.positional.axes
    # stacked from the axes: PartitionsND's cached properties take a lock, which torch.compile cannot trace
    widths, offsets = (torch.stack([getattr(a, name) for a in axes], -1) for name in ("widths", "offsets"))
    return attention_2d(call.q, call.k, call.v, widths, offsets, call.grid, call.causal, call.scale), None


register_backend("torch", _grid, op="nd")
