"""What a query costs under an ALiBi window, and the window that costs what positional LSH costs.

A window of ``w`` keeps ``w + 1`` keys per causal query (``2 w + 1`` two-sided), far from the ends.
Positional LSH with ``s`` i.i.d. samples visits ``1 + E[max_t back_t]`` (``poslsh.cost``), so the
window of equal cost is ``w_h = round(E[max_t back_t])`` per head (the same two-sided or causal).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._compat import one_rate, renamed_keywords
from ..cost import check_num_samples_int, expected_reach

__all__ = ["window_keys_per_query", "cost_matched_window"]


def window_keys_per_query(window, *, causal: bool = True) -> Tensor:
    """Keys a query visits under a window of ``window`` (``[H]``), far from the ends."""
    w = torch.as_tensor(window, dtype=torch.float64).reshape(-1)
    return w + 1.0 if causal else 2.0 * w + 1.0


@renamed_keywords(s="num_samples")
def cost_matched_window(sigma=None, num_samples: int = None, *, slopes=None) -> Tensor:
    """The per-head window (int64 ``[H]``) whose keys per query equal positional LSH's at ``num_samples``
    i.i.d. samples (rounded to the nearest integer; the same two-sided or causal). ``sigma`` ``[H]``, or by
    keyword ``slopes=`` (``1 / sigma``)."""
    sigma = one_rate(slopes, sigma, want="sigma", where="cost_matched_window")
    return torch.round(expected_reach(sigma, check_num_samples_int(num_samples))).to(torch.int64)
