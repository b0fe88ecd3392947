"""ALiBi (Press et al., 2021): slopes, dense bias and the kernel matrix L*.

ALiBi adds ``-slope_h * |i - j|`` to the attention logits of head ``h``; in the
paper's notation the attention weights are multiplied by
``L*_ij = exp(-|i - j| / sigma_h)`` with ``sigma_h = 1 / slope_h``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["alibi_slopes", "alibi_sigmas", "alibi_bias", "alibi_matrix", "AlibiWindow", "make_window"]


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


def _as_1d(values, name: str) -> Tensor:
    t = values if isinstance(values, Tensor) else torch.as_tensor(values, dtype=torch.float64)
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of per-head values, got shape {tuple(t.shape)}")
    return t


def alibi_bias(n: int, slopes, *, causal: bool = False, dtype: torch.dtype = torch.float32,
               device=None, num_queries: Optional[int] = None) -> Tensor:
    """Dense additive ALiBi bias, shape ``[H, nq, n]``: ``-m_h * |i - j|``.

    Rows are the last ``nq = num_queries`` positions (default ``n``: all of them;
    fewer for queries decoded against a KV cache of ``n`` keys). With
    ``causal=True`` keys after the query get ``-inf``. This is a dense tensor:
    meant for references, tests, baselines and short decoding steps.
    """
    slopes = _as_1d(slopes, "slopes")
    device = slopes.device if device is None else device
    nq = n if num_queries is None else int(num_queries)
    kpos = torch.arange(n, device=device, dtype=torch.float64)
    qpos = kpos[n - nq:]
    dist = (qpos[:, None] - kpos[None, :]).abs()
    bias = -slopes.to(device=device, dtype=torch.float64)[:, None, None] * dist
    if causal:
        bias = bias.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return bias.to(dtype)


def alibi_matrix(n: int, sigma, *, device=None) -> Tensor:
    """The ALiBi kernel matrix ``L*_ij = exp(-|i - j| / sigma_h)``, float64 ``[H, n, n]``."""
    sigma = _as_1d(sigma, "sigma").to(torch.float64)
    device = sigma.device if device is None else device
    pos = torch.arange(n, device=device, dtype=torch.float64)
    dist = (pos[:, None] - pos[None, :]).abs()
    return torch.exp(-dist / sigma.to(device)[:, None, None])


@dataclass(frozen=True)
class AlibiWindow:
    """Exact ALiBi cut at a window per head: head ``h`` keeps the keys with ``|i - j| <= window[h]``
    and gives them the ALiBi logit bias ``-slopes[h] * |i - j|``; every other key gets no weight.

    Attributes:
        slopes: float64 ``[H]``, ``m_h >= 0`` (``1 / sigma_h``).
        window: int64 ``[H]``, ``w_h >= 0`` (0: a query sees itself only; ``>= n``: exact ALiBi).
    """

    slopes: Tensor
    window: Tensor

    @property
    def num_heads(self) -> int:
        return self.slopes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.slopes.device

    def to(self, device) -> "AlibiWindow":
        if self.slopes.device == torch.device(device):
            return self
        return AlibiWindow(self.slopes.to(device), self.window.to(device))


def _require(ok: Tensor, message: str) -> None:
    """A check on tensor values: a ValueError eagerly; inside torch.compile a runtime assert with the
    same message (a Python ``bool`` of a traced tensor would break the graph)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def make_window(slopes, window: Union[int, Tensor], num_heads: Optional[int] = None) -> AlibiWindow:
    """Validate ALiBi ``slopes`` (``[H]``, finite, ``>= 0``) and ``window`` (an int for every head,
    or ``[H]`` integers ``>= 0``) into an :class:`AlibiWindow`; ``num_heads``, when given, must match."""
    m = _as_1d(slopes, "slopes").detach().to(torch.float64)
    _require(torch.isfinite(m).all() & (m >= 0).all(), "slopes: ALiBi slopes must be finite and >= 0")
    if num_heads is not None and m.numel() != num_heads:
        raise ValueError(f"slopes: got {m.numel()} slopes for {num_heads} query heads")
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        w = torch.full((m.numel(),), int(window), dtype=torch.int64, device=m.device)
    elif isinstance(window, Tensor) and window.dim() <= 1 and not window.dtype.is_complex and window.dtype != torch.bool:
        if window.dtype.is_floating_point:
            _require((window == window.round()).all(), "window: per-head windows must be whole numbers of positions")
        w = window.detach().reshape(-1).to(device=m.device, dtype=torch.int64)
        if w.numel() == 1:
            w = w.expand(m.numel()).clone()
    else:
        raise TypeError(f"window must be an int or an integer tensor [H] of per-head windows, got "
                        f"{type(window).__name__}")
    if w.numel() != m.numel():
        raise ValueError(f"window: got {w.numel()} windows for {m.numel()} heads")
    _require((w >= 0).all(), "window: windows must be >= 0 (keys with |i - j| <= window attend), got "
             + ("a negative one" if torch.compiler.is_compiling() else str(w.tolist())))
    return AlibiWindow(m, w)
