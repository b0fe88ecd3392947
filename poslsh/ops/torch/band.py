"""The window op's band kernels on the torch backend: exact ALiBi cut at per-head windows
``|i - j| <= w_h`` for self-attention or queries and keys at given positions (no packed
documents: those take the general tiles of :mod:`.kernels`).

Per head the queries are cut into tiles of ``T`` rows and the keys into blocks of ``T`` rows
aligned with them (query row ``i`` is key row ``i + delta``). Tile ``u`` sees the
``c = ceil(w / T)`` key blocks before its own, and when not causal the ``c`` after it: a contiguous
range of ``R = (c + 1) T`` (``(2c + 1) T``) key rows. So

* a chunk of tiles is a *view* of q, k and v (``as_strided`` over any row stride, the transposed
  ``[B, n, H, d]`` layout of models too): nothing is gathered or copied;
* the bias (``-m_h |i - j|`` inside the window, ``-inf`` outside it and after the query when
  causal) is one ``[T, R]`` template for every tile, broadcast into the scores by the matmul;
* a tile whose key range passes an end of the keys (the first ``c``; the last, or the last
  ``c`` when not causal) runs alone with its range cut to the keys that exist and the matching
  columns of the template: no padding, no mask, and every row sees at least its own key.

A chunk is ``baddbmm`` (scores plus template), ``softmax``, ``bmm`` with the values straight into the
output rows, and the lse ``log sum_j e^{s_ij} = max_j s_ij - log max_j p_ij``. Backward: the same
tiles recomputed (``softmax`` again, so the probabilities sum to 1 exactly, which flash-attention
2's ``ds = P (dP - delta)`` needs at large logits; see :func:`~.kernels.tiled_backward`),
``dq`` written per tile, ``dk`` and ``dv`` added block by block into the key rows. Chunks run on
threads (:mod:`.workers`): a chunk returns its key gradients and they are added one chunk at
a time in one fixed order (the chunks of a head and of the heads sharing a key head reach the same
key blocks), so the gradients are bitwise the same whatever the threads. Cost per head
``O(n_q R d)``; memory ``O(n d)`` plus the chunks.
"""
from __future__ import annotations

import functools
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..._validation import AttnShape, compute_dtype
from .workers import run_items

__all__ = ["Band", "bands", "forward", "backward", "CHUNK_ELEMENTS"]

# Scores per chunk: a chunk's scores, probabilities and their products stay in a core's L2 cache.
CHUNK_ELEMENTS = 1 << 18
# Tile rows by window, ``(w below, T)`` in order: a tall tile wastes ~T / (w + 1) of its key range
# on keys after its rows' windows, a thin one runs small, inefficient matmuls. Measured on one
# core at n = 16384, d = 64, causal, every T in 16 ... 256 (the backward, 5 matmuls per chunk
# against 2, prefers taller tiles).
FORWARD_TILES = ((64, 16), (512, 32), (1024, 64), (math.inf, 128))
BACKWARD_TILES = ((16, 16), (256, 32), (512, 64), (math.inf, 128))


class Band(NamedTuple):
    """One head's tiles: ``tile`` rows, ``blocks`` key blocks of ``tile`` rows on each side that a
    tile sees, ``width`` key rows per tile, the window ``window`` and the ``[tile, width]``
    ``template`` (compute dtype): ALiBi's bias, ``-inf`` where a key is not seen."""

    tile: int
    blocks: int
    width: int
    window: int
    template: Tensor


def tile_rows(window: int, backward: bool = False) -> int:
    return next(T for below, T in (BACKWARD_TILES if backward else FORWARD_TILES) if window < below)


@functools.lru_cache(maxsize=64)
def _template(T: int, c: int, window: int, slope: float, causal: bool, dtype, device) -> Tensor:
    R = (c + 1) * T if causal else (2 * c + 1) * T
    dist = (c * T + torch.arange(T, device=device)[:, None] - torch.arange(R, device=device)[None]).to(dtype)
    seen = (dist >= 0) & (dist <= window) if causal else dist.abs() <= window
    return torch.where(seen, dist.abs() * -slope, torch.full((), float("-inf"), dtype=dtype, device=device))


def bands(slopes: Tensor, window: Tensor, n_q: int, n_k: int, delta: int, causal: bool, dtype, device,
          backward: bool = False) -> List[Band]:
    """Every head's :class:`Band` (the backward's tiles with ``backward``); windows past the
    farthest query-key distance are cut there."""
    farthest = max(n_q - 1 + delta, n_k - 1 - delta, 0)
    out = []
    for m, w in zip(slopes.tolist(), window.tolist()):
        w = int(min(w, farthest))
        T = tile_rows(w, backward)
        c = -(-w // T)
        out.append(Band(T, c, (c + 1) * T if causal else (2 * c + 1) * T, w, _template(T, c, w, m, causal, dtype, device)))
    return out


def _tiles(x: Tensor, row: int, count: int, T: int, rows: int) -> Tensor:
    """Rows ``[row + u T, row + u T + rows)`` of ``x [N, d]`` for ``u < count``: a ``[count, rows, d]`` view."""
    return x[row:].as_strided((count, rows, x.shape[1]), (T * x.stride(0), x.stride(0), 1))


class _Rows:
    """The rows of q, k, v (and dout) of one batch row and head in the compute dtype, with unit
    column stride: views of the inputs when they already are (any row stride), else one copy
    per (batch row, key/value head)."""

    def __init__(self, ct):
        self.ct, self._seen = ct, {}

    def __call__(self, x: Tensor, b: int, h: int) -> Tensor:
        key = (id(x), b, h)
        if key not in self._seen:
            r = x[b, h].to(self.ct)
            self._seen[key] = r if r.stride(-1) == 1 else r.contiguous()
        return self._seen[key]


class _Item(NamedTuple):
    """``tiles`` query tiles of one (batch row ``b``, head ``h``) from tile ``u0``, of ``rows <= T``
    rows each, against ``width`` key rows each from key row ``k0`` (tile by tile ``+T``), which are
    template columns ``[col, col + width)``. The body of a head is chunks of whole tiles; a tile whose
    key range passes an end of the keys, or whose rows pass the last query, is an item alone with its
    range cut to what exists (so every view is in range and every row sees its own key)."""

    band: Band
    b: int
    h: int
    u0: int
    tiles: int
    rows: int
    k0: int
    width: int
    col: int

    def cost(self) -> int:
        return self.tiles * self.rows * self.width


def _items(band: Band, b: int, h: int, n_q: int, n_k: int, delta: int) -> List[_Item]:
    T, c, R = band.tile, band.blocks, band.width
    U = -(-n_q // T)
    start = lambda u: u * T + delta - c * T                    # noqa: E731  the first key row of tile u
    lo = min(U, max(0, -(-(c * T - delta) // T)))
    hi = max(lo, min(U, n_q // T, (n_k - R - delta + c * T) // T + 1))
    per = max(1, CHUNK_ELEMENTS // (T * R))
    out = [_Item(band, b, h, u, min(per, hi - u), T, start(u), R, 0) for u in range(lo, hi, per)]
    for u in [*range(lo), *range(hi, U)]:
        k0, k1 = max(0, start(u)), min(n_k, start(u) + R)
        out.append(_Item(band, b, h, u, 1, min(T, n_q - u * T), k0, k1 - k0, k0 - start(u)))
    return out


def _probabilities(it: _Item, Q: Tensor, K: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """Scores (with the bias) and probabilities, ``[tiles, rows, width]`` each."""
    bias = it.band.template[:it.rows, it.col:it.col + it.width]
    s = torch.baddbmm(bias, Q, K.transpose(1, 2), alpha=scale)
    return s, torch.softmax(s, -1)


def _plan(q, slopes, window, shape: AttnShape, causal: bool, delta: int, ct, backward: bool):
    plan = bands(slopes, window, shape.seqlen, shape.kv_len, delta, causal, ct, q.device, backward)
    items = [it for h, band in enumerate(plan) for b in range(shape.batch)
             for it in _items(band, b, h, shape.seqlen, shape.kv_len, delta)]
    return items, _Rows(ct)


def forward(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, window: Tensor, shape: AttnShape, scale: float,
            causal: bool, delta: int = 0, need_lse: bool = True) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype) and ``lse [B, Hq, n]`` (compute dtype; uninitialised when not
    ``need_lse``) of the window op; query row ``i`` is key row ``i + delta``."""
    B, Hq, n, dv, g = shape.batch, shape.q_heads, shape.seqlen, shape.v_dim, shape.group
    ct = compute_dtype(q.dtype)
    out = torch.empty(B, Hq, n, dv, dtype=ct, device=q.device)
    lse = torch.empty(B, Hq, n, dtype=ct, device=q.device)
    items, rows = _plan(q, slopes, window, shape, causal, delta, ct, backward=False)

    def run(it: _Item):
        T, r0 = it.band.tile, it.u0 * it.band.tile
        Q = _tiles(rows(q, it.b, it.h), r0, it.tiles, T, it.rows)
        V = _tiles(rows(v, it.b, it.h // g), it.k0, it.tiles, T, it.width)
        s, p = _probabilities(it, Q, _tiles(rows(k, it.b, it.h // g), it.k0, it.tiles, T, it.width), scale)
        r1 = r0 + (it.tiles - 1) * T + it.rows
        torch.bmm(p, V, out=out[it.b, it.h, r0:r1].view(it.tiles, it.rows, dv))
        if need_lse:
            torch.sub(s.amax(-1), p.amax(-1).log_(), out=lse[it.b, it.h, r0:r1].view(it.tiles, it.rows))

    for it in items:                  # the compute-dtype rows, made before the threads share them
        rows(q, it.b, it.h), rows(k, it.b, it.h // g), rows(v, it.b, it.h // g)
    run_items(items, run, cost=_Item.cost)
    return out.to(q.dtype), lse


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, dlse: Optional[Tensor], slopes: Tensor, window: Tensor,
             shape: AttnShape, scale: float, causal: bool, delta: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (dtypes of q, k, v) of the window op by recomputing each chunk's probabilities;
    ``dlse [B, Hq, n]``: the gradient reaching the lse (None: 0)."""
    B, Hq, Hkv, n, nk, g = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.kv_len, shape.group
    d, dv = shape.head_dim, shape.v_dim
    ct = compute_dtype(q.dtype)
    dq = torch.empty(B, Hq, n, d, dtype=ct, device=q.device)
    dk = torch.zeros(B, Hkv, nk, d, dtype=ct, device=q.device)
    dvv = torch.zeros(B, Hkv, nk, dv, dtype=ct, device=q.device)
    items, rows = _plan(q, slopes, window, shape, causal, delta, ct, backward=True)
    dlse_ct = None if dlse is None else dlse.to(ct)

    def run(it: _Item):
        T, r0, u, R = it.band.tile, it.u0 * it.band.tile, it.tiles, it.width
        r1 = r0 + (u - 1) * T + it.rows
        Q, dO = (_tiles(rows(x, it.b, it.h), r0, u, T, it.rows) for x in (q, dout))
        K, V = (_tiles(rows(x, it.b, it.h // g), it.k0, u, T, R) for x in (k, v))
        _, p = _probabilities(it, Q, K, scale)
        dp = torch.bmm(dO, V.transpose(1, 2))
        shift = (p * dp).sum(-1, keepdim=True)                       # delta_i = sum_j P_ij dP_ij
        if dlse_ct is not None:
            shift = shift.sub_(dlse_ct[it.b, it.h, r0:r1].view(u, it.rows, 1))
        ds = dp.sub_(shift).mul_(p)
        torch.bmm(ds, K, out=dq[it.b, it.h, r0:r1].view(u, it.rows, d)).mul_(scale)   # rows of this item only
        return torch.bmm(ds.transpose(1, 2), Q), torch.bmm(p.transpose(1, 2), dO)

    def commit(it: _Item, part):             # one item at a time, in one order: see run_items
        dk_t, dv_t = part
        T, u, R = it.band.tile, it.tiles, it.width
        gk, gv = dk[it.b, it.h // g], dvv[it.b, it.h // g]
        if u == 1:
            gk[it.k0:it.k0 + R].add_(dk_t[0], alpha=scale)
            gv[it.k0:it.k0 + R].add_(dv_t[0])
            return
        blocks = u + R // T - 1                # the key blocks these tiles reach, from row k0
        kb, vb = gk[it.k0:it.k0 + blocks * T].view(blocks, T, d), gv[it.k0:it.k0 + blocks * T].view(blocks, T, dv)
        dk_t, dv_t = dk_t.view(u, R // T, T, d), dv_t.view(u, R // T, T, dv)
        for j in range(R // T):                # tile t's key block j is block t + j of the range
            kb[j:j + u].add_(dk_t[:, j], alpha=scale)
            vb[j:j + u].add_(dv_t[:, j])

    for it in items:
        rows(q, it.b, it.h), rows(dout, it.b, it.h), rows(k, it.b, it.h // g), rows(v, it.b, it.h // g)
    run_items(items, run, cost=_Item.cost, commit=commit)
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype)
