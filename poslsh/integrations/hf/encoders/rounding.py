"""The original models' float32 ALiBi table, kept in float64 models.

MosaicBERT, DNABERT-2 and Jina build the bias ``-m_h |i - j|`` as a float32 tensor (float32 slope
times float32 distance) even in a float64 model, so a head whose slope is not a power of two (12
heads: ``2^-0.5``, ``2^-1.5``, ...) carries ``f32(m_h d)``, off ``m_h d`` by up to ``2^-24 m_h d``.
In float32 the window op computes exactly that product (``d * -m`` in float32), so nothing is
needed. In float64 it computes ``m_h d`` unrounded, and the outputs differ from the original by
~1e-8; this module adds the difference back, exactly, from the op's own output and log-sum-exp:

with ``p_ij = exp(s_ij - m d_ij - lse_i)`` the op's probabilities and
``delta_ij = exp(m d_ij - f32(m d_ij)) - 1`` (the original's weight over the op's, minus 1),
``out'_i = out_i + sum_j p_ij delta_ij (v_j - out_i) / (1 + sum_j p_ij delta_ij)``
is the softmax with the original's bias (``Z' = Z (1 + sum p delta)``). The sum runs over the band
``|i - j| <= W_h``, ``W_h = ceil((R_h + 40) / m_h)``, ``R_h = 2 scale max ||q|| max ||k||``: the query's
own key is always in its sum, so ``lse_i >= s_ii`` and ``p_ij <= e^{|s_ij| + |s_ii| - m d} <= e^{R - m d}``,
below ``e^-40`` past the band, where ``|delta| <= 2^-24 m d``: the terms left out are below 1e-20 of
the values. Query tiles
against their band of keys: ``O(N W d)`` time, ``O(tile (tile + 2W))`` memory per tile (autograd
keeps the tiles: ``O(N W)``), only for the heads that need it and only in float64.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["inexact_heads", "f32_table_correction"]

TILE = 128
MARGIN = 40.0          # e^-40: the weight bound past the band


def inexact_heads(slopes32: Tensor) -> Tensor:
    """Bool ``[H]``: heads whose float32 products ``f32(m_h d)`` differ from ``m_h d`` (a slope that is
    not a power of two; a power of two is exact below ``d = 2^24``)."""
    mantissa, _ = torch.frexp(slopes32.to(torch.float64))
    return mantissa != 0.5


def _table_delta(slope32: float, dist: Tensor) -> Tensor:
    """``exp(m d - f32(m d)) - 1`` at integer distances ``dist`` (float64)."""
    m32 = torch.tensor(slope32, dtype=torch.float32, device=dist.device)
    rounded = (dist.to(torch.float32) * m32).to(torch.float64)
    return torch.expm1(dist * float(slope32) - rounded)


def f32_table_correction(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, slopes32: Tensor,
                         scale: float, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """``out`` of exact ALiBi with float64 slopes (``[1, H, N, dv]``, its ``lse [1, H, N]``) turned into
    the original's: the float32 table on the heads :func:`inexact_heads` names.

    Args:
        q, k, v: ``[1, H, N, d]`` float64 (one call's tokens; packed documents by ``cu_seqlens``).
        slopes32: ``[H]`` the float32 slopes (any float dtype holding float32 values).
        scale: the logit scale.
        cu_seqlens: int ``[D + 1]`` document offsets, or None (one document).
    Returns:
        ``[1, H, N, dv]``, differentiable in ``q, k, v`` (through ``out`` and ``lse`` too).
    """
    H, N = q.shape[1], q.shape[2]
    if cu_seqlens is None:
        doc = torch.zeros(N, dtype=torch.int64, device=q.device)
        longest = N
    else:
        cu = cu_seqlens.to(q.device, torch.int64)
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), cu.diff(), output_size=N)
        longest = int(cu.diff().max()) if cu.numel() > 1 else 0
    bound = (2.0 * abs(scale) * q.detach().norm(dim=-1).amax(-1) * k.detach().norm(dim=-1).amax(-1))[0]   # [H]
    heads = []
    for h in range(H):
        m = float(slopes32[h])
        if not bool(inexact_heads(slopes32[h:h + 1])[0]) or N < 2:
            heads.append(out[:, h])
            continue
        band = min(longest - 1, math.ceil((float(bound[h]) + MARGIN) / m))
        pieces = []
        for i0 in range(0, N, TILE):
            i1 = min(N, i0 + TILE)
            j0, j1 = max(0, i0 - band), min(N, i1 + band)
            s = torch.matmul(q[0, h, i0:i1], k[0, h, j0:j1].transpose(0, 1)) * scale              # [T, K]
            dist = (torch.arange(i0, i1, device=q.device)[:, None] - torch.arange(j0, j1, device=q.device)[None]).abs()
            dist = dist.to(torch.float64)
            seen = (doc[i0:i1, None] == doc[None, j0:j1]) & (dist <= band)
            p = torch.exp(s - m * dist - lse[0, h, i0:i1, None]).masked_fill(~seen, 0.0)
            w = p * _table_delta(m, dist)
            o = out[0, h, i0:i1]
            pieces.append(o + (w @ v[0, h, j0:j1] - w.sum(1, keepdim=True) * o) / (1.0 + w.sum(1, keepdim=True)))
        heads.append(torch.cat(pieces, 0)[None])
    return torch.stack(heads, 1)
