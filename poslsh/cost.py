"""What a query costs: the keys it visits under positional LSH and under an ALiBi window.

A query at position ``i`` visits the union of its ``s`` blocks. Under random binning the distance
``back_t`` from ``i`` back to the start of its block in sample ``t`` satisfies, for integers
``x >= 0``, ``P(back_t >= x) = P(i - x shares i's block) = L*(x) = e^{-x / sigma}`` (and likewise
the distance forward), independently over i.i.d. samples. The union of the blocks is the
contiguous range ``[i - max_t back_t, i + max_t fwd_t]`` (restricted to ``j <= i`` when causal),
so far from the sequence's ends

    ``E[keys] = 1 + E[max_t back_t] (+ E[max_t fwd_t]),
    E[max_t back_t] = sum_{x >= 1} (1 - (1 - e^{-x / sigma})^s)  (~ sigma H_s, H_s the harmonic number)``

(expectation is linear, so the two-sided count needs no joint law). A window of ``w`` keeps
``w + 1`` keys per causal query (``2 w + 1`` two-sided). These are the expected values for i.i.d.
samples; correlated samplers (``"grouped"``) have smaller unions, measured rather than computed.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["poslsh_keys_per_query", "window_keys_per_query", "cost_matched_window"]


def _sigma(sigma) -> Tensor:
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"sigma must be finite and > 0, got {s.tolist()}")
    return s


def _mean_max_back(sigma: Tensor, s: int) -> Tensor:
    """``E[max of s distances back to the block start]`` per sigma (the series, to 1e-12 relative)."""
    out = torch.empty_like(sigma)
    for h, sig in enumerate(sigma.tolist()):
        # terms 1 - (1 - e^{-x/sig})^s fall below 1e-16 once x > sig (log s + 37): sum them all
        top = max(1, math.ceil(sig * (math.log(s) + 37.0)))
        x = torch.arange(1, top + 1, dtype=torch.float64)
        out[h] = -torch.expm1(s * torch.log1p(-torch.exp(-x / sig))).sum()
    return out


def poslsh_keys_per_query(sigma, s: int, *, causal: bool = True) -> Tensor:
    """Expected keys a query visits with ``s`` i.i.d. random-binning masks, per head (float64
    ``[H]``), far from the sequence's ends: the union of its blocks (module docstring)."""
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ValueError(f"s must be an int >= 1, got {s!r}")
    back = _mean_max_back(_sigma(sigma), s)
    return 1.0 + back if causal else 1.0 + 2.0 * back


def window_keys_per_query(window, *, causal: bool = True) -> Tensor:
    """Keys a query visits under a window of ``window`` (``[H]``), far from the ends."""
    w = torch.as_tensor(window, dtype=torch.float64).reshape(-1)
    return w + 1.0 if causal else 2.0 * w + 1.0


def cost_matched_window(sigma, s: int) -> Tensor:
    """The per-head window (int64 ``[H]``) whose keys per query equal positional LSH's at ``s``
    i.i.d. samples (rounded to the nearest integer; the same two-sided or causal)."""
    return torch.round(_mean_max_back(_sigma(sigma), s)).to(torch.int64)
