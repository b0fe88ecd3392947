"""Theorem 2.2: the output error of positional-LSH attention, from the instance's statistics
``beta*_P`` and ``||P||_{2,inf}``."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .bounds import _check_delta, _check_ns, psi

__all__ = ["InstanceStats", "instance_stats", "delta_p", "output_error_bound", "smallest_constant"]


# ------------------------------------------------------------ Theorem 2.2
class InstanceStats(NamedTuple):
    beta_star: Tensor   # [H] min_i sum_j P_ij L*_ij
    p_2inf: Tensor      # [H] ||P||_{2,inf} = max_i sqrt(sum_j P_ij^2)


def instance_stats(q: Tensor, k: Tensor, sigma: Tensor, *, causal: bool = True,
                   scale: Optional[float] = None, row_chunk: int = 512) -> InstanceStats:
    """``beta*_P`` and ``||P||_{2,inf}`` of an attention instance (dense, row-chunked).

    Args:
        q, k: ``[H, n, d]`` (keys already expanded to the query heads for GQA).
        sigma: ``[H]`` bandwidths ``1 / m_h``.
    """
    H, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    pos = torch.arange(n, dtype=torch.float64, device=q.device)
    sig = torch.as_tensor(sigma, dtype=torch.float64, device=q.device)
    beta = torch.full((H,), float("inf"), dtype=torch.float64, device=q.device)
    p2 = torch.zeros(H, dtype=torch.float64, device=q.device)
    for r0 in range(0, n, row_chunk):
        r1 = min(n, r0 + row_chunk)
        scores = torch.einsum("hid,hjd->hij", q64[:, r0:r1], k64) * scale
        if causal:
            scores = scores.masked_fill(pos[None, r0:r1, None] < pos[None, None, :], float("-inf"))
        P = torch.softmax(scores, dim=-1)
        lstar = torch.exp(-(pos[r0:r1, None] - pos[None, :]).abs()[None] / sig[:, None, None])
        beta = torch.minimum(beta, (P * lstar).sum(-1).amin(-1))
        p2 = torch.maximum(p2, P.pow(2).sum(-1).sqrt().amax(-1))
    return InstanceStats(beta, p2)


def delta_p(p_2inf: float, *, n: int, num_samples: int, sigma: float, delta: float, C: float = 1.0) -> float:
    """``Delta_P = C min(Psi ||P||_{2,inf}, 1) sqrt(log(n/delta) / s)``, ``s = num_samples`` (keyword-only
    after ``p_2inf``: the order of 0.2 was ``(p_2inf, sigma, n, s, delta, C)``)."""
    s = num_samples
    _check_ns(n, s)
    _check_delta(delta)
    return C * min(psi(sigma) * p_2inf, 1.0) * math.sqrt(math.log(n / delta) / s)


def output_error_bound(beta_star: float, p_2inf: float, v_max: float, *, n: int, num_samples: int, sigma: float,
                       delta: float, C: float = 1.0) -> float:
    """Theorem 2.2 item 2: ``||T* - T~||_max <= 2 Delta_P / (beta* - Delta_P) ||V||_max``
    when ``Delta_P < beta*``; ``inf`` when the condition fails (keyword-only after ``v_max``: the order of
    0.2 was ``(..., v_max, sigma, n, s, delta, C)``)."""
    dp = delta_p(p_2inf, n=n, num_samples=num_samples, sigma=sigma, delta=delta, C=C)
    return 2.0 * dp / (beta_star - dp) * v_max if dp < beta_star else float("inf")


def smallest_constant(observed_error: float, beta_star: float, p_2inf: float, v_max: float, *,
                      n: int, num_samples: int, sigma: float, delta: float) -> Tuple[float, bool]:
    """The smallest ``C`` for which Theorem 2.2's bound covers ``observed_error`` (keyword-only after
    ``v_max``: the order of 0.2 was ``(..., v_max, sigma, n, s, delta)``).

    Solves ``2 C D / (beta* - C D) v_max = err`` with ``D = Delta_P / C``:
    ``C = err beta* / (D (2 v_max + err))``. Returns ``(C, ok)``; ``ok`` is False
    when the instance is degenerate (``D = 0`` with a nonzero error).
    """
    D = delta_p(p_2inf, n=n, num_samples=num_samples, sigma=sigma, delta=delta, C=1.0)
    if observed_error <= 0:
        return 0.0, True
    if D <= 0:
        return float("inf"), False
    return observed_error * beta_star / (D * (2.0 * v_max + observed_error)), True
