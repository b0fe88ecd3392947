"""The window op's positional kind: :class:`AlibiWindow`, exact ALiBi cut at a window per head.

Head ``h`` of a query at position ``p`` sees the keys ``[p - w_h, p + w_h]`` with the ALiBi logit
bias ``-m_h |p - j|``; every other key gets no weight. :func:`make_window` validates slopes and
windows into one (value checks become runtime asserts under ``torch.compile``);
:func:`windows_in_sigmas` is the ``w_h = c sigma_h`` rule.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .._compat import one_rate
from ..alibi import as_per_head
from ..positional import Positional

__all__ = ["AlibiWindow", "make_window", "windows_in_sigmas", "NO_WINDOW"]

NO_WINDOW = torch.iinfo(torch.int64).max     # a window past every sequence: exact ALiBi
# The steepest slope a float32 kernel is given. Any steeper slope (float64 holds up to 1.8e308) means
# the same: a key 1 position away weighs e^{-2^125} relative to the query itself, 0 in every dtype
# (unless logits differ by ~4e37), so the query attends to itself alone. 2^125 stays finite in
# float32 times log2(e) (the Triton kernels' base 2) up to 4 positions away; beyond, -inf is exact.
STEEPEST_SLOPE = 2.0 ** 125


@dataclass(frozen=True, eq=False)
class AlibiWindow(Positional):
    """Exact ALiBi cut at a window per head: head ``h`` keeps the keys with ``|i - j| <= window[h]``
    and gives them the ALiBi logit bias ``-slopes[h] * |i - j|``; every other key gets no weight.
    Build one with :func:`make_window` (which checks the values).

    Attributes:
        slopes: float64 ``[H]``, ``m_h >= 0`` (``1 / sigma_h``).
        window: int64 ``[H]``, ``w_h >= 0`` (0: a query sees itself only; ``>= n``: exact ALiBi).
    """

    slopes: Tensor
    window: Tensor

    op = "window"
    heads_are = "slopes and window give"
    public_name = "poslsh.AlibiWindow"

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

    def for_compute(self, dtype: torch.dtype) -> "AlibiWindow":
        """Below float64 the slopes are capped at :data:`STEEPEST_SLOPE` (a steeper one becomes ``inf``
        in float32, and ``inf * 0`` NaN on the diagonal): the same attention, as the float64 oracle gives
        it. No sync: a clamp of ``[H]`` per call."""
        if dtype == torch.float64:
            return self
        return AlibiWindow(self.slopes.clamp(max=STEEPEST_SLOPE), self.window)

    def tensors(self) -> Tuple[Tensor, Tensor]:
        """``(slopes [H] float64, window [H] int64)``."""
        return self.slopes, self.window

    def reach(self, positions: Tensor, seq_len: int) -> Tuple[Tensor, Tensor]:
        """Per head the keys ``[p - w_h, p + w_h + 1)`` clipped to ``[0, seq_len)``: int64 ``[H, P]``."""
        w = self.window.to(positions.device).clamp(max=seq_len)[:, None]      # clamped: p + w stays in range
        pos = positions.to(torch.int64)[None]
        return (pos - w).clamp_min(0), (pos + w + 1).clamp_max(seq_len)

    def cache_bound(self, *, per_head: bool = False) -> Union[int, List[int]]:
        """A causal stream keeps ``max_h w_h`` keys (``w_h`` for head ``h`` alone)."""
        heads = [int(w) for w in self.window.tolist()]
        return heads if per_head else max(heads)

    def dense_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``-m_h |i - j|`` inside the window, ``-inf`` outside: float64 ``[H, P, Q]``."""
        dist = (q_pos.to(torch.float64)[:, None] - k_pos.to(torch.float64)[None, :]).abs()[None]
        slopes, window = self.slopes.to(dist.device)[:, None, None], self.window.to(dist.device)[:, None, None]
        return (-slopes * dist).masked_fill(dist > window, float("-inf"))

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return other.device == self.device and self.same_as(other)

    def __hash__(self) -> int:
        return hash((self.op, self.num_heads))


def _require(ok: Tensor, message: str) -> None:
    """A check on tensor values: a ValueError eagerly; inside torch.compile a runtime assert with the
    same message (a Python ``bool`` of a traced tensor would break the graph)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)


def make_window(slopes=None, window: Union[int, Tensor, None] = None, num_heads: Optional[int] = None, *,
                sigma=None) -> AlibiWindow:
    """Validate ALiBi ``slopes`` (``[H]``, finite, ``>= 0``; or ``sigma=`` ``[H]``, ``slopes = 1 / sigma``) and
    ``window`` (an int for every head, or ``[H]`` integers ``>= 0``) into an :class:`AlibiWindow`;
    ``num_heads``, when given, must match."""
    slopes = one_rate(slopes, sigma, want="slopes", where="make_window")
    m = as_per_head(slopes, "slopes").detach().to(torch.float64)
    _require(torch.isfinite(m).all() & (m >= 0).all(), "slopes: ALiBi slopes must be finite and >= 0")
    if num_heads is not None and m.numel() != num_heads:
        raise ValueError(f"slopes: got {m.numel()} slopes for {num_heads} query heads")
    if window is None:
        raise TypeError("make_window: pass window= (an int, or int [H]: keys with |i - j| <= window attend)")
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


def windows_in_sigmas(c: float, sigma=None, *, slopes=None) -> Tensor:
    """``w_h = ceil(c sigma_h)`` (int64 ``[H]``; ``sigma`` ``[H]``, or by keyword ``slopes=``): the dropped keys
    weigh at most ``e^{-c}`` each, relative to the query itself."""
    sig = as_per_head(one_rate(slopes, sigma, want="sigma", where="windows_in_sigmas"), "sigma").to(torch.float64)
    return torch.ceil(sig * float(c) - 1e-9).to(torch.int64)
