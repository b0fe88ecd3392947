"""Dense oracles in ``D`` dimensions: exact 2-D (N-D) ALiBi attention, attention with any
positional kernel, and the positional-LSH estimator with the mean box mask ``M~``.

Tokens carry integer coordinates ``[n, D]`` (an ``H x W`` grid of patches in raster order:
:func:`~poslsh.partitions_nd.grid_coords`); *causal* means raster (token) order: token ``i``
sees tokens ``j <= i``. Every one of them materialises ``[B, H, n, n]`` scores through
:func:`poslsh.reference.dense_attention`, the one dense attention: references, not fast paths.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._validation import check_heads, check_qkv
from .kernels import WidthDistribution
from .partitions_nd import PartitionsND, _validate_sigma_nd, check_coords, check_grid, expected_mask, grid_coords
from .reference import dense_attention

__all__ = ["coords_for", "alibi_nd_bias", "alibi_nd_matrix", "alibi_nd_attention", "kernel_attention",
           "poslsh_attention_nd_reference"]


def coords_for(n: int, coords: Optional[Tensor] = None, grid: Optional[Tuple[int, int]] = None) -> Tensor:
    """The token coordinates of a call: ``coords [n, D]`` or a ``grid (height, width)`` with
    ``height * width = n`` (exactly one of them)."""
    if (coords is None) == (grid is None):
        raise ValueError("pass exactly one of coords ([n, D] integer coordinates) and grid ((height, width))")
    if grid is not None:
        h, w = check_grid(grid)
        if h * w != n:
            raise ValueError(f"grid {h}x{w} has {h * w} tokens but q has seqlen {n}")
        return grid_coords(h, w)
    c = check_coords(coords)
    if c.shape[0] != n:
        raise ValueError(f"coords give {c.shape[0]} tokens but q has seqlen {n}")
    return c


def alibi_nd_bias(coords: Tensor, slopes, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Additive N-D ALiBi bias ``-sum_a m_{h,a} |x_a - y_a|`` (``= -m_h ||x - y||_1`` for one
    slope per head), ``[H, n, n]`` in ``dtype``. ``slopes``: ``[H]`` or per-axis ``[H, D]`` (``1 / sigma``).
    Built head by head and axis by axis in ``dtype`` (float64 unless a lower one is asked for), so
    memory is the output plus two ``[n, n]`` buffers (a 128 x 128 grid in float32: 4 GiB + 2 GiB)."""
    x = check_coords(coords)
    m = _as_slopes(slopes, x.shape[1])
    ct = torch.float64 if dtype == torch.float64 else torch.float32      # distances are small integers: exact
    xf = x.to(ct)
    out = torch.zeros(m.shape[0], x.shape[0], x.shape[0], dtype=dtype, device=x.device)
    for a in range(x.shape[1]):
        dist = (xf[:, None, a] - xf[None, :, a]).abs_()
        for h in range(m.shape[0]):
            out[h].sub_(dist * float(m[h, a]))
    return out


def _as_slopes(slopes, dims: int) -> Tensor:
    t = slopes if isinstance(slopes, Tensor) else torch.as_tensor(slopes, dtype=torch.float64)
    t = t.detach().to(torch.float64)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() == 1:
        t = t[:, None].expand(-1, dims)
    if t.dim() != 2 or t.shape[1] != dims:
        raise ValueError(f"slopes must be [H] or [H, {dims}] (per head and axis), got shape {tuple(t.shape)}")
    if not bool((torch.isfinite(t) & (t >= 0)).all()):
        raise ValueError("ALiBi slopes must be finite and >= 0")
    return t


def alibi_nd_matrix(coords: Tensor, sigma) -> Tensor:
    """``L**_xy = exp(-sum_a |x_a - y_a| / sigma_{h,a})``, float64 ``[H, n, n]`` (2-D ALiBi's kernel)."""
    x = check_coords(coords)
    return torch.exp(alibi_nd_bias(x, 1.0 / _validate_sigma_nd(sigma, x.shape[1])))


def alibi_nd_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, coords: Optional[Tensor] = None,
                       grid: Optional[Tuple[int, int]] = None, causal: bool = False,
                       scale: Optional[float] = None) -> Tensor:
    """Exact N-D ALiBi attention ``softmax(q k^T * scale - m_h ||x_i - x_j||_1) v`` (the weights
    multiplied by ``L**``).

    Args:
        q: ``[B, Hq, n, d]``; k, v: ``[B, Hkv, n, d]`` / ``[B, Hkv, n, dv]`` (``Hq`` a multiple of ``Hkv``).
        slopes: ``[Hq]`` or ``[Hq, D]`` slopes ``m = 1 / sigma``.
        coords: ``[n, D]`` integer token coordinates, or grid: ``(height, width)`` in raster order.
        causal: token ``i`` attends to ``j <= i`` only (raster order).
    Returns:
        ``[B, Hq, n, dv]`` (computed in float32, or float64 for float64 input). Dense.
    """
    shape = check_qkv(q, k, v)
    x = coords_for(shape.seqlen, coords, grid)
    bias = alibi_nd_bias(x, slopes).to(q.device)
    if bias.shape[0] != shape.q_heads:
        raise ValueError(f"got {bias.shape[0]} slopes for {shape.q_heads} query heads")
    return dense_attention(q, k, v, bias, causal=causal, scale=scale)


def kernel_attention(q: Tensor, k: Tensor, v: Tensor, sigma, distribution: Optional[WidthDistribution] = None, *,
                     coords: Optional[Tensor] = None, grid: Optional[Tuple[int, int]] = None, causal: bool = False,
                     scale: Optional[float] = None) -> Tensor:
    """Attention with the weights multiplied by the exact expected mask ``L = E[M]`` of a width
    distribution (:func:`~poslsh.partitions_nd.expected_mask`): the target that positional LSH
    with that distribution estimates. ``sigma``: ``[Hq]`` or ``[Hq, D]``. Shapes as in
    :func:`alibi_nd_attention`; where ``L = 0`` (compact kernels) the key is masked."""
    shape = check_qkv(q, k, v)
    x = coords_for(shape.seqlen, coords, grid)
    L = expected_mask(x, sigma, distribution).to(q.device)
    if L.shape[0] != shape.q_heads:
        raise ValueError(f"got {L.shape[0]} bandwidths for {shape.q_heads} query heads")
    return dense_attention(q, k, v, torch.log(L), allowed=L > 0, causal=causal, scale=scale)


def poslsh_attention_nd_reference(q: Tensor, k: Tensor, v: Tensor, partitions: PartitionsND, *,
                                  coords: Optional[Tensor] = None, grid: Optional[Tuple[int, int]] = None,
                                  causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """The positional-LSH estimator with the mean box mask ``M~``, densely (float64 oracle).

    ``T~_i = sum_t sum_{j in box_t(i)} e^{s_ij} v_j / sum_t sum_{j in box_t(i)} e^{s_ij}``: one
    softmax with the bias ``log count_ij`` (``count_ij`` = samples in which ``i`` and ``j`` share a
    box on every axis; ``-inf`` where 0). Shapes as in :func:`alibi_nd_attention`;
    ``partitions`` has ``Hq`` heads and ``D`` = the coordinates' axes.
    """
    if not isinstance(partitions, PartitionsND):
        raise TypeError(f"partitions must be a poslsh.PartitionsND, got {type(partitions).__name__}")
    shape = check_qkv(q, k, v)
    check_heads(partitions, shape.q_heads)
    x = coords_for(shape.seqlen, coords, grid)
    count = partitions.to(q.device).dense_count(x.to(q.device)).to(torch.float64)
    return dense_attention(q, k, v, torch.log(count), causal=causal, scale=scale)
