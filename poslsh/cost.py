"""What a query costs: the keys it visits under positional LSH and under a window, and the window
that costs what positional LSH costs (:func:`cost_matched_window`).

A query at position ``i`` visits the union of its ``s`` blocks. Under random binning the distance
``back_t`` from ``i`` back to the start of its block in sample ``t`` satisfies, for integers
``x >= 0``, ``P(back_t >= x) = P(i - x shares i's block) = L*(x) = e^{-x / sigma}`` (and likewise
the distance forward), independently over i.i.d. samples. The union of the blocks is the
contiguous range ``[i - max_t back_t, i + max_t fwd_t]`` (restricted to ``j <= i`` when causal),
so far from the sequence's ends

    ``E[keys] = 1 + E[max_t back_t] (+ E[max_t fwd_t]),
    E[max_t back_t] = sum_{x >= 1} (1 - (1 - e^{-x / sigma})^s)  (~ sigma H_s, H_s the harmonic number)``

(expectation is linear, so the two-sided count needs no joint law). These are the expected values
for i.i.d. samples; correlated samplers (``"grouped"``) have smaller unions, measured rather than computed.

A window of ``w`` keeps ``w + 1`` keys per causal query (``2 w + 1`` two-sided), far from the ends, so
the window of equal cost is ``w_h = round(E[max_t back_t])`` per head (the same two-sided or causal).
The rate here is the bandwidth ``sigma_h = 1 / m_h`` (from ALiBi slopes: ``1 / slopes``).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["poslsh_keys_per_query", "expected_reach", "window_keys_per_query", "cost_matched_window",
           "check_num_samples_int"]


def check_sigma(sigma) -> Tensor:
    s = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"sigma must be finite and > 0, got {s.tolist()}")
    return s


def check_num_samples_int(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    return num_samples


def expected_reach(sigma, num_samples: int) -> Tensor:
    """``E[max_t back_t]`` per head (float64 ``[H]``): how far back (or forward) the union of
    ``num_samples`` i.i.d. blocks reaches from a query, far from the ends (the series, to 1e-12 relative)."""
    sigma, num_samples = check_sigma(sigma), check_num_samples_int(num_samples)
    out = torch.empty_like(sigma)
    for h, sig in enumerate(sigma.tolist()):
        # terms 1 - (1 - e^{-x/sig})^s fall below 1e-16 once x > sig (log s + 37): sum them all
        top = max(1, math.ceil(sig * (math.log(num_samples) + 37.0)))
        x = torch.arange(1, top + 1, dtype=torch.float64)
        out[h] = -torch.expm1(float(num_samples) * torch.log1p(-torch.exp(-x / sig))).sum()
    return out


def poslsh_keys_per_query(sigma, num_samples: int, *, causal: bool = True) -> Tensor:
    """Expected keys a query visits with ``num_samples`` i.i.d. random-binning masks, per head (float64
    ``[H]``), far from the sequence's ends: the union of its blocks (module docstring). ``sigma`` ``[H]``."""
    back = expected_reach(sigma, check_num_samples_int(num_samples))
    return 1.0 + back if causal else 1.0 + 2.0 * back


def window_keys_per_query(window, *, causal: bool = True) -> Tensor:
    """Keys a query visits under a window of ``window`` (``[H]``), far from the ends."""
    w = torch.as_tensor(window, dtype=torch.float64).reshape(-1)
    return w + 1.0 if causal else 2.0 * w + 1.0


def cost_matched_window(sigma, num_samples: int) -> Tensor:
    """The per-head window (int64 ``[H]``) whose keys per query equal positional LSH's at ``num_samples``
    i.i.d. samples (rounded to the nearest integer; the same two-sided or causal). ``sigma`` ``[H]``."""
    return torch.round(expected_reach(sigma, check_num_samples_int(num_samples))).to(torch.int64)
