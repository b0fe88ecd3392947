"""The torch backend's kernels: the tiled forward, flash-attention 2's backward over any chunks
(shared with the 2-D op, :mod:`.grid`) and the few-queries forward (decoding steps).

Every chunk is a batched matmul ``[B, U, T, d] x [B, U, d, R]`` plus the chunk's bias (see
:class:`~.tiles.ChunkMaker`); a query row's whole key range lies in its one tile, so the
softmax of a row is complete inside one chunk and every output row is written once. The chunks
run on threads (:mod:`.workers`); several reach the same key rows, so each returns its part
of ``dk``, ``dv`` and the parts are added one chunk at a time in one fixed order: outputs and
gradients are bitwise the same for identical calls, whatever the thread count.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._validation import AttnShape, compute_dtype
from .plan import RowBounds
from . import tiles as torch_tiles
from .tiles import ChunkMaker, TileGroup
from .workers import run_items

__all__ = ["gather_rows", "flat_rows", "forward", "tiled_backward", "backward", "few_queries_forward",
           "BACKWARD_CHUNK_ELEMENTS", "FEW_QUERIES_ELEMENTS"]

# Scores per chunk of the backward on CPU (at most; the forward's CHUNK_ELEMENTS when smaller). A
# chunk's key gradients may wait for their turn (torch_workers), so they are kept small: about
# 2^20 / T x (d + dv) floats (16 MiB at T = 32, d = dv = 64). Against the forward's 2^22 (chosen
# for intra-op threads) at n = 16384, positional LSH s = 10 (4 heads) and the window op on packed
# documents (9 heads), forward + backward on a loaded 2-core machine: 5-13% faster, 1 and 2 threads.
BACKWARD_CHUNK_ELEMENTS = 1 << 20
# Scores per group of heads of the few-queries forward: a decoding step this small runs as one
# group (threads would cost more than they give), a larger one on threads.
FEW_QUERIES_ELEMENTS = 1 << 15


def gather_rows(x: Tensor, idx: Tensor, units: int, size: int) -> Tensor:
    """Rows ``idx`` of ``x [B, R, d]`` as ``[B, units, size, d]``. ``F.embedding`` is
    the fastest row gather on CPU (about 3x ``index_select`` along dim 1)."""
    B, rows, d = x.shape
    if B > 1:
        idx = (idx[None] + rows * torch.arange(B, device=idx.device)[:, None]).reshape(-1)
    return F.embedding(idx, x.reshape(B * rows, d)).view(B, units, size, d)


def flat_rows(x: Tensor, ct: torch.dtype) -> Tensor:
    """``[B, H, n, d]`` as ``[B, H * n, d]`` in the compute dtype ``ct``."""
    B, H, n, d = x.shape
    return x.to(ct).reshape(B, H * n, d)


def _biased_scores(Qg: Tensor, Kg: Tensor, bias: Tensor, scale: float) -> Tensor:
    """``scale * Q K^T + bias`` as ``[B, U, T, R]`` (-inf where a key gets no weight).
    Consumes ``bias`` (with one batch the matmul accumulates into it in place)."""
    if Qg.shape[0] == 1:
        return bias.baddbmm_(Qg[0], Kg[0].transpose(-1, -2), alpha=scale)[None]
    return torch.matmul(Qg, Kg.transpose(-1, -2)).mul_(scale).add_(bias)


def forward(q: Tensor, k: Tensor, v: Tensor, groups: List[TileGroup], bounds: RowBounds, shape: AttnShape,
            scale: float, need_lse: bool = True, slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (in ``q.dtype``) and ``lse [B, Hq, n]`` (float32/64, the log-sum-exp
    of the biased scores; left uninitialised when ``need_lse`` is False). ``slopes``: see
    :class:`~.tiles.ChunkMaker`. Traceable by autograd when the inputs require grad (double
    backward); otherwise the chunks run on threads (:func:`~.workers.run_items`)."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    qf, kf, vf = flat_rows(q, ct), flat_rows(k, ct), flat_rows(v, ct)
    out = torch.empty(B, Hq * n + 1, shape.v_dim, dtype=ct, device=q.device)   # + sink row
    lse = torch.empty(B, Hq * n + 1, dtype=ct, device=q.device)
    maker = ChunkMaker(groups, bounds, shape, ct, slopes)
    traced = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    writes = threading.Lock()                # several chunks write the sink row

    def run(spec):
        c = maker.make(spec)
        Qg = gather_rows(qf, c.rows, c.units, c.tile)
        Kg = gather_rows(kf, c.kv_rows, c.units, c.width)
        Vg = gather_rows(vf, c.kv_rows, c.units, c.width)
        s = _biased_scores(Qg, Kg, c.bias, scale)
        # Each query sees itself (its own block, or |i - i| = 0 in the window): no row is all -inf.
        p = torch.softmax(s, -1)
        # lse = m + log sum e^{s - m} = m - log max p (max p = 1 / sum e^{s - m}): no second exp pass
        row_lse = (s.amax(-1) - p.amax(-1).log()).reshape(B, -1) if need_lse else None
        o = torch.matmul(p, Vg).reshape(B, -1, shape.v_dim)
        with writes:
            if need_lse:
                lse.index_copy_(1, c.out_rows, row_lse)
            out.index_copy_(1, c.out_rows, o)

    if traced:
        for spec in maker.specs:
            run(spec)
    else:
        run_items(maker.specs, run, cost=maker.cost)
    return out[:, :-1].view(B, Hq, n, shape.v_dim).to(q.dtype), lse[:, :-1].view(B, Hq, n)


def tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, chunks, shape: AttnShape,
                   scale: float, probabilities: Callable,
                   dlse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward over ``chunks`` (a maker: ``specs``, ``cost(spec)`` and
    ``make(spec)`` giving a chunk with ``rows, out_rows, kv_rows, units, tile, width``, as
    :class:`~.tiles.ChunkMaker`), shared by the 1-D and 2-D torch ops; ``probabilities(Qg,
    Kg, chunk, lse_g) -> p [B, U, T, R]`` recomputes a chunk's weights from the saved
    ``lse [B, Hq, n]``. ``dlse [B, Hq, n]`` (optional): the gradient reaching the log-sum-exp,
    which adds ``P_ij dlse_i`` to ``ds_ij`` (``d lse_i / d s_ij = P_ij``).

    The chunks run on threads (:func:`~.workers.run_items`); each returns its parts of
    ``dq, dk, dv`` and they are added in the one order of :func:`~.workers.run_items`'s
    ``commit`` (several chunks reach the same key rows): bitwise the same gradients whatever the
    threads.

    A row's whole key range lies in one tile, so each recomputed row is renormalised to sum to
    1: with logits ~1e4 the float32 ``lse`` is off by ~1e-3 absolute, ``exp(s - lse)`` then
    sums to ``1 + eps``, and ``ds = P (dP - delta)`` keeps an error ``eps * delta`` that does not
    cancel (dq, dk 10x less accurate than SDPA's). Dividing makes ``P`` exact to rounding, for
    ``dv = P^T dO`` as well. ``delta_i = sum_k P_ik dP_ik`` (flash-attention's ``rowsum(dO * O)``)
    is computed from these probabilities in the compute dtype: the output rounded to 16 bits
    would cost low-precision gradients most of their accuracy."""
    B, Hq, Hkv, n, nk = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, k.shape[2]
    ct = compute_dtype(q.dtype)
    qf, kf, vf = flat_rows(q, ct), flat_rows(k, ct), flat_rows(v, ct)
    zero_row = torch.zeros(B, 1, shape.v_dim, dtype=ct, device=q.device)
    # Rows past n read the sink row: dO = 0 and lse = +inf, so their probabilities
    # are exactly 0 and they add nothing to dk, dv (no inf * 0).
    dof = torch.cat([flat_rows(dout, ct), zero_row], 1)
    lse_f = torch.cat([lse.reshape(B, Hq * n).to(ct), torch.full_like(zero_row[..., 0], float("inf"))], 1)
    dlse_f = None if dlse is None else torch.cat([dlse.reshape(B, Hq * n).to(ct), zero_row[..., 0]], 1)
    dq = torch.zeros(B, Hq * n + 1, shape.head_dim, dtype=ct, device=q.device)
    dk = torch.zeros(B, Hkv * nk, shape.head_dim, dtype=ct, device=q.device)
    dv = torch.zeros(B, Hkv * nk, shape.v_dim, dtype=ct, device=q.device)
    tiny = torch.finfo(ct).tiny

    def run(spec):
        c = chunks.make(spec)
        U, T, R = c.units, c.tile, c.width
        Qg = gather_rows(qf, c.rows, U, T)
        Kg = gather_rows(kf, c.kv_rows, U, R)
        Vg = gather_rows(vf, c.kv_rows, U, R)
        dOg = gather_rows(dof, c.out_rows, U, T)
        p = probabilities(Qg, Kg, c, lse_f.index_select(1, c.out_rows).view(B, U, T, 1))
        p = p.div_(p.sum(-1, keepdim=True).clamp_min_(tiny))         # sink rows: 0 / tiny = 0
        gv = torch.matmul(p.transpose(-1, -2), dOg).reshape(B, U * R, -1)
        dp = torch.matmul(dOg, Vg.transpose(-1, -2))
        shift = (p * dp).sum(-1, keepdim=True)                        # delta_i
        if dlse_f is not None:
            shift = shift.sub_(dlse_f.index_select(1, c.out_rows).view(B, U, T, 1))
        ds = dp.sub_(shift).mul_(p)
        gq = torch.matmul(ds, Kg).mul_(scale).reshape(B, U * T, -1)
        gk = torch.matmul(ds.transpose(-1, -2), Qg).mul_(scale).reshape(B, U * R, -1)
        return c.out_rows, c.kv_rows, gq, gk, gv

    def commit(spec, part):                  # one chunk at a time, in one order: see run_items
        out_rows, kv_rows, gq, gk, gv = part
        dv.index_add_(1, kv_rows, gv)
        dq.index_add_(1, out_rows, gq)
        dk.index_add_(1, kv_rows, gk)

    run_items(chunks.specs, run, cost=chunks.cost, commit=commit)
    return dq[:, :-1].reshape(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, groups: List[TileGroup],
             bounds: RowBounds, shape: AttnShape, scale: float, dlse: Optional[Tensor] = None,
             slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``dq, dk, dv`` (shapes and dtypes of ``q, k, v``) by tile-wise recomputation
    with the saved ``lse``; ``dlse``: the gradient of the log-sum-exp (None: 0)."""
    def probabilities(Qg, Kg, c, lse_g):
        return torch.exp_(_biased_scores(Qg, Kg, c.bias, scale).sub_(lse_g))

    elements = min(torch_tiles.CHUNK_ELEMENTS, BACKWARD_CHUNK_ELEMENTS) if q.device.type == "cpu" else None
    chunks = ChunkMaker(groups, bounds, shape, compute_dtype(q.dtype), slopes, elements)
    return tiled_backward(dout, q, k, v, lse, chunks, shape, scale, probabilities, dlse)


def few_queries_forward(q: Tensor, k: Tensor, v: Tensor, bounds: RowBounds, shape: AttnShape,
                        scale: float, slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The forward for a few query rows (decoding steps, ``n <= FEW_QUERIES``): every head's rows
    against the union of their blocks, counts by comparing with the rows' block bounds.
    ``O(H n R (d + s))`` for key ranges of ``R`` keys, no tile plan. Same ``out [B, Hq, n, dv]``
    and ``lse [B, Hq, n]`` as :func:`forward` (and the same bias, ``slopes`` included). On CPU the
    heads run in groups of a size fixed by the call (about :data:`FEW_QUERIES_ELEMENTS` scores
    each; a small step is one group) on threads with one intra-op thread: the same result whatever
    the threads."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    start, end = bounds.start, bounds.end                                     # [H, n, s] key rows
    dev = start.device
    rows = torch.arange(n, device=dev) + bounds.delta                         # the queries as key rows
    lo = start.amin(dim=(1, 2))                                               # [H]
    hi = end.amax(dim=(1, 2))
    if bounds.causal:
        hi = torch.clamp(hi, max=int(rows[-1]) + 1)
    R = max(1, int((hi - lo).max()))
    slopes = None if slopes is None else slopes.to(device=dev, dtype=ct)
    out = torch.empty(B, Hq, n, shape.v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, n, dtype=ct, device=q.device)

    def run(h: slice):                                                        # heads h, H of them
        cols = lo[h, None] + torch.arange(R, device=dev)                      # [H, R]
        inside = (start[h, :, :, None] <= cols[:, None, None, :]) & (cols[:, None, None, :] < end[h, :, :, None])
        count = inside.sum(2)                                                 # [H, n, R]
        keep = (count > 0) & (cols < hi[h, None])[:, None, :]
        if bounds.causal:
            keep &= cols[:, None, :] <= rows[None, :, None]
        bias = torch.where(keep, count.to(ct).log(), torch.full((), float("-inf"), dtype=ct, device=dev))
        if slopes is not None:   # the window op: ALiBi inside the window
            dist = (rows[None, :, None] - cols[:, None, :]).abs().to(ct)
            bias = bias - slopes[h, None, None] * dist
        kv = (torch.arange(h.start, h.stop, device=dev) // shape.group)[:, None]   # [H, 1] kv head of each head
        idx = cols.clamp(max=shape.kv_len - 1)
        K, V = k[:, kv, idx].to(ct), v[:, kv, idx].to(ct)                     # [B, H, R, d]
        scores = torch.matmul(q[:, h].to(ct), K.transpose(-1, -2)).mul_(scale).add_(bias)
        out[:, h] = torch.matmul(torch.softmax(scores, -1), V)
        lse[:, h] = torch.logsumexp(scores, -1)

    per = max(1, FEW_QUERIES_ELEMENTS // (B * n * R)) if q.device.type == "cpu" else Hq   # heads per group
    run_items([slice(h, min(h + per, Hq)) for h in range(0, Hq, per)], run, cost=lambda h: h.stop - h.start)
    return out, lse
