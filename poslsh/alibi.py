"""ALiBi (Press et al., 2021): slopes, dense bias and the kernel matrix L*.

ALiBi adds ``-slope_h * |i - j|`` to the attention logits of head ``h``; in the
paper's notation the attention weights are multiplied by
``L*_ij = exp(-|i - j| / sigma_h)`` with ``sigma_h = 1 / slope_h``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._validation import check_has_values, positions_needed

__all__ = ["alibi_slopes", "alibi_sigmas", "alibi_bias", "alibi_matrix", "as_per_head"]


def _power_of_two_slopes(num_heads: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(num_heads) - 3)))
    return [start * start**i for i in range(num_heads)]


def _slopes(num_heads: int) -> list[float]:
    if math.log2(num_heads).is_integer():
        return _power_of_two_slopes(num_heads)
    # Press et al.: take the slopes of the closest smaller power of two, then
    # interleave every other slope of the next power of two for the remainder.
    closest = 2 ** math.floor(math.log2(num_heads))
    return _power_of_two_slopes(closest) + _slopes(2 * closest)[0::2][: num_heads - closest]


def alibi_slopes(num_heads: int, *, dtype: torch.dtype = torch.float64, device=None) -> Tensor:
    """ALiBi slopes ``m_h`` for ``num_heads`` heads, shape ``[num_heads]``.

    For a power of two ``H`` the slopes are the geometric series
    ``2^(-8/H), 2^(-16/H), ..., 2^(-8)``; other head counts use the interleaved
    rule of the reference implementation (e.g. 12 heads -> the 8-head series plus
    every other slope of the 16-head series).
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    return torch.tensor(_slopes(num_heads), dtype=dtype, device=device)


def alibi_sigmas(num_heads: int, *, device=None) -> Tensor:
    """Per-head bandwidths ``sigma_h = 1 / m_h`` (float64, shape ``[num_heads]``)."""
    return 1.0 / alibi_slopes(num_heads, device=device)


def as_per_head(values, name: str) -> Tensor:
    """Per-head values as a 1-D tensor (a number is one head; raises naming ``name`` otherwise)."""
    t = values if isinstance(values, Tensor) else torch.as_tensor(values, dtype=torch.float64)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of per-head values, got shape {tuple(t.shape)}")
    return t


def alibi_bias(n: int, slopes, *, causal: bool = False, dtype: torch.dtype = torch.float32,
               device=None, num_queries: Optional[int] = None, q_start: Optional[int] = None) -> Tensor:
    """Dense additive ALiBi bias, shape ``[H, nq, n]``: ``-m_h * |i - j|`` for the keys at positions
    ``[0, n)`` and the ``nq = num_queries`` queries at ``[q_start, q_start + nq)`` (default ``nq = n``,
    ``q_start = 0``: self-attention; ``nq != n`` needs ``q_start``, e.g. ``n - nq`` for new tokens
    against a cache of ``n`` keys, flash-attention's bottom-right alignment). ``slopes`` ``[H]``. With ``causal=True`` keys after the query get ``-inf``.
    This is a dense tensor: meant for references, tests, baselines and short decoding steps.
    """
    slopes = as_per_head(check_has_values(slopes, "slopes"), "slopes")
    device = slopes.device if device is None else device
    nq = n if num_queries is None else int(num_queries)
    if q_start is None and nq != n:
        raise ValueError(positions_needed(nq, n, "alibi_bias(num_queries=...)"))
    kpos = torch.arange(n, device=device, dtype=torch.float64)
    qpos = torch.arange(nq, device=device, dtype=torch.float64) + (q_start or 0)
    dist = (qpos[:, None] - kpos[None, :]).abs()
    bias = -slopes.to(device=device, dtype=torch.float64)[:, None, None] * dist
    if causal:
        bias = bias.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return bias.to(dtype)


def alibi_matrix(n: int, sigma, *, device=None) -> Tensor:
    """The ALiBi kernel matrix ``L*_ij = exp(-|i - j| / sigma_h)``, float64 ``[H, n, n]`` (``sigma`` ``[H]``)."""
    sigma = as_per_head(sigma, "sigma").to(torch.float64)
    device = sigma.device if device is None else device
    pos = torch.arange(n, device=device, dtype=torch.float64)
    dist = (pos[:, None] - pos[None, :]).abs()
    return torch.exp(-dist / sigma.to(device)[:, None, None])
