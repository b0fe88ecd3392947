"""Launchers of the window op's kernels: exact ALiBi cut at per-head windows.

Head ``h`` keeps the keys with ``|i - j| <= w_h`` (``j <= i`` when causal; the query's own
document with packed documents, positions restarting in each) and adds ``-m_h |i - j|`` to
their logits. No plan: each query tile attends to one key range ``[first - w_h, last + w_h]``
(clipped to the sequence, the causal diagonal and the tile's documents), and the kernels compute
the bias from positions and the slope. Forward 1 launch, backward 3 (``delta``, dk/dv, dq).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

import triton

from . import _launch, _plan

LOG2E = math.log2(math.e)


def check_window(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, window: Tensor):
    """The kernels' constraints (:func:`._launch.check_inputs`) and the window's: float ``[Hq]``
    slopes and int ``[Hq]`` windows on ``q.device``. Returns ``B, Hq, Hkv, n, d, dv``."""
    if slopes.dim() != 1 or window.shape != slopes.shape or slopes.shape[0] != q.shape[1]:
        raise ValueError(f"window: slopes and windows must be [Hq={q.shape[1]}], got {tuple(slopes.shape)}, "
                         f"{tuple(window.shape)}")
    if slopes.device != q.device or window.device != q.device:
        raise ValueError("q, k, v and the window's slopes / windows must be on one device")
    dummy = torch.zeros(q.shape[1], 1, dtype=torch.float64, device=q.device)
    return _launch.check_inputs(q, k, v, dummy, dummy)[:6]


def _head_args(slopes: Tensor, window: Tensor, n: int, group: int):
    """int32 windows (capped at ``n``: wider sees everything), float32 slopes in base 2
    (``m_h log2 e``) and the head order (widest windows first)."""
    win = window.clamp(max=n).to(torch.int32).contiguous()
    slope2 = (slopes.to(torch.float64) * LOG2E).to(torch.float32).contiguous()
    order = _plan.head_order(win.to(torch.float64)[:, None] + 1.0, n, group)
    return win, slope2, order


def _docs(q: Tensor, n: int, doc_start: Optional[Tensor], doc_end: Optional[Tensor]):
    """``(START, END, batch stride, HAS_DOCS)``: int32 document starts / ends ``[B, n]``."""
    if doc_start is None:
        return q, q, 0, False
    if doc_end is None or doc_start.shape != doc_end.shape or doc_start.shape != (q.shape[0], n):
        raise ValueError(f"doc_start / doc_end must both be int64 [B, n] = [{q.shape[0]}, {n}]")
    st, en = (x.to(device=q.device, dtype=torch.int32).contiguous() for x in (doc_start, doc_end))
    return st, en, n, True


def _meta(q, d, dv, causal, tma, interpret, has_docs) -> dict:
    meta = _launch._meta(q, q.shape[2], d, dv, causal, tma, interpret, False)
    for unused in ("R_MAX", "SC", "LATTICE", "ROW_PLANS"):
        meta.pop(unused)
    meta["HAS_DOCS"] = has_docs
    return meta


def forward(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, window: Tensor, causal: bool, scale: float,
            doc_start: Optional[Tensor] = None, doc_end: Optional[Tensor] = None,
            blocks: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype), ``lse`` and ``lse_lo`` (fp32 ``[B, Hq, n]``, base 2:
    ``log2 sum_{|i-j| <= w_h} 2^(log2(e) (s_ij - m_h |i - j|))``)."""
    B, Hq, Hkv, n, d, dv = check_window(q, k, v, slopes, window)
    q, k, v = (_launch._last_dim_contiguous(x) for x in (q, k, v))
    interpret = _launch.use_interpreter(q)
    out = torch.empty(B, Hq, n, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, n, dtype=torch.float32, device=q.device)
    lse_lo = torch.empty_like(lse)
    if B == 0:
        return out, lse, lse_lo
    win, slope2, order = _head_args(slopes, window, n, Hq // Hkv)
    st, en, sxb, has_docs = _docs(q, n, doc_start, doc_end)
    common = _meta(q, d, dv, causal, _launch.use_tma(interpret, q, k, v), interpret, has_docs)
    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]) * B * Hq,)  # noqa: E731
    _launch._run("wfwd", interpret, blocks, grid,
                 dict(Q=q, K=k, V=v, WIN=win, SLOPE=slope2, ORDER=order, START=st, END=en, Out=out, LSE=lse,
                      LSE_LO=lse_lo, **_launch.strides("q", q), **_launch.strides("k", k), **_launch.strides("v", v),
                      **_launch.strides("o", out), sxb=sxb, n=n, B=B, Hq=Hq, G=Hq // Hkv, qk_scale=scale * LOG2E,
                      N_KEY=_launch._n_key(n)), common, q, paths=(None,))
    return out, lse, lse_lo


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_lo: Tensor,
             slopes: Tensor, window: Tensor, causal: bool, scale: float, dlse: Optional[Tensor] = None,
             doc_start: Optional[Tensor] = None, doc_end: Optional[Tensor] = None,
             blocks: Optional[dict] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` from the forward's ``out, lse, lse_lo``; ``dlse``: the gradient of the
    (base-2) lse, or None."""
    B, Hq, Hkv, n, d, dv = check_window(q, k, v, slopes, window)
    q, k, v, out, dout = (_launch._last_dim_contiguous(x) for x in (q, k, v, out, dout))
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    lse, lse_lo = lse.contiguous(), lse_lo.contiguous()
    interpret = _launch.use_interpreter(q)
    dq = torch.empty(B, Hq, n, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, n, d, dtype=k.dtype, device=q.device)
    dvv = torch.empty(B, Hkv, n, dv, dtype=v.dtype, device=q.device)
    if B == 0:
        return dq, dk, dvv
    G = Hq // Hkv
    win, slope2, order = _head_args(slopes, window, n, G)
    st, en, sxb, has_docs = _docs(q, n, doc_start, doc_end)
    delta = _launch.delta_pre(out, dout, dlse, interpret)
    common = _meta(q, d, dv, causal, _launch.use_tma(interpret, q, k, v, dout), interpret, has_docs)
    qk_scale = scale * LOG2E
    blocks = blocks or {}
    args = dict(Q=q, K=k, V=v, DO=dout, LSE=lse, LSE_LO=lse_lo, DELTA=delta, WIN=win, SLOPE=slope2, ORDER=order,
                START=st, END=en, **_launch.strides("q", q), **_launch.strides("k", k), **_launch.strides("v", v),
                **_launch.strides("d", dout), sxb=sxb, n=n, B=B, Hq=Hq, G=G, qk_scale=qk_scale, sm_scale=scale,
                N_KEY=_launch._n_key(n))
    grid = lambda M: (triton.cdiv(n, M["BLOCK_N"]) * B * Hkv,)  # noqa: E731
    _launch._run("wdkdv", interpret, blocks.get("dkdv"), grid,
                 dict(args, DK=dk, DVt=dvv, Hkv=Hkv, **_launch.strides("dk", dk), **_launch.strides("dv", dvv)),
                 common, q, paths=(None,))
    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]) * B * Hq,)  # noqa: E731
    _launch._run("wdq", interpret, blocks.get("dq"), grid, dict(args, DQ=dq, **_launch.strides("dq", dq)),
                 common, q, paths=(None,))
    return dq, dk, dvv
