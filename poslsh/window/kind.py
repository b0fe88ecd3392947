"""The window op's positional kind: :class:`AlibiWindow`, exact ALiBi cut at a window per head.

Head ``h`` of a query at position ``p`` sees the keys ``[p - w_h, p + w_h]`` with the ALiBi logit
bias ``-m_h |p - j|``; every other key gets no weight. :func:`make_window` validates slopes and
windows into one (value checks become runtime asserts under ``torch.compile``);
:func:`windows_in_sigmas` is the ``w_h = c sigma_h`` rule.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from .._validation import check_has_values, require_values as _require
from ..alibi import as_per_head
from ..positional import Positional

__all__ = ["AlibiWindow", "make_window", "windows_in_sigmas", "as_windows", "NO_WINDOW", "STEEPEST_SLOPE"]

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


_PAST_INT64 = 2.0 ** 63


def _scalar_window(x) -> int:
    """One window given as a Python number: an int, or a whole float (``inf``: exact ALiBi); past
    int64 it is :data:`NO_WINDOW` (a window ``>= n`` is exact ALiBi)."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"window must be an int, a sequence of ints or an integer tensor [H] of per-head windows, "
                        f"got {type(x).__name__}")
    if not isinstance(x, numbers.Integral):
        x = float(x)
        if math.isnan(x) or (math.isfinite(x) and x != math.floor(x)):
            raise ValueError(f"window: per-head windows must be whole numbers of positions, got {x!r}")
    if x < 0:
        raise ValueError(f"window: windows must be >= 0 (keys with |i - j| <= window attend), got {x!r}")
    return NO_WINDOW if x >= _PAST_INT64 else int(x)


def as_windows(values: Tensor) -> Tensor:
    """Float windows as int64, every one at or past 2^63 (``inf`` too) :data:`NO_WINDOW`, instead of
    the cast's wrap-around (values below 2^63 are integers in float64, so the cast is exact there)."""
    t = values.to(torch.float64)
    cast = t.clamp(min=-_PAST_INT64, max=_PAST_INT64 - 1024).to(torch.int64)
    return torch.where(t >= _PAST_INT64, torch.full_like(cast, NO_WINDOW), cast)


def make_window(slopes, window: Union[int, Tensor, None] = None, num_heads: Optional[int] = None) -> AlibiWindow:
    """Validate ALiBi ``slopes`` (``[H]``, finite, ``>= 0``) and ``window`` (one for every head, or ``[H]`` as a
    sequence or a tensor; whole numbers ``>= 0``; ``None``, ``inf`` or a window past int64: :data:`NO_WINDOW`,
    no cut, exact ALiBi) into an :class:`AlibiWindow`; ``num_heads``, when given, must match."""
    m = as_per_head(check_has_values(slopes, "slopes"), "slopes").detach().to(torch.float64)
    _require(torch.isfinite(m).all() & (m >= 0).all(), "slopes: ALiBi slopes must be finite and >= 0")
    if num_heads is not None and m.numel() != num_heads:
        raise ValueError(f"slopes: got {m.numel()} slopes for {num_heads} query heads")
    if window is None:
        window = NO_WINDOW
    if isinstance(window, (list, tuple)):
        window = torch.tensor([_scalar_window(x) for x in window], dtype=torch.int64)
    if isinstance(window, Tensor) and window.dim() <= 1 and not window.dtype.is_complex and window.dtype != torch.bool:
        given = check_has_values(window, "window").detach().reshape(-1)
        if given.dtype.is_floating_point:
            _require((given == given.round()).all(), "window: per-head windows must be whole numbers of positions")
        _require((given >= 0).all(), "window: windows must be >= 0 (keys with |i - j| <= window attend), got "
                 + ("a negative one" if torch.compiler.is_compiling() else str(given.tolist())))
        if given.dtype.is_floating_point:
            given = as_windows(given)
        w = given.to(device=m.device, dtype=torch.int64)
        if w.numel() == 1:
            w = w.expand(m.numel()).clone()
    elif isinstance(window, Tensor):
        raise TypeError(f"window must be an integer tensor [H] of per-head windows, got {window.dtype} "
                        f"{tuple(window.shape)}")
    else:
        w = torch.full((m.numel(),), _scalar_window(window), dtype=torch.int64, device=m.device)
    if w.numel() != m.numel():
        raise ValueError(f"window: got {w.numel()} windows for {m.numel()} heads")
    return AlibiWindow(m, w)


def windows_in_sigmas(c: float, sigma) -> Tensor:
    """``w_h = ceil(c sigma_h)`` (int64 ``[H]``; ``sigma`` ``[H]``, ``1 / slopes``): the dropped keys
    weigh at most ``e^{-c}`` each, relative to the query itself. ``c >= 0`` (``inf``: exact ALiBi); a window
    past int64 is :data:`NO_WINDOW`."""
    if isinstance(c, Tensor) and c.numel() == 1:
        c = float(c)
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or math.isnan(c) or c < 0:
        raise ValueError(f"c must be a number >= 0 (the window in units of sigma_h), got {c!r}")
    sig = as_per_head(check_has_values(sigma, "sigma"), "sigma").to(torch.float64)
    return as_windows(torch.ceil(sig * float(c) - 1e-9))
