"""Any positional LSH (paper section 5: N-D ALiBi, other kernels): the bounds that hold for every
scheme with ``E[M] = L``, and their dense inputs."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .bounds import _check_delta, _check_ns
from .norms import MaskErrors
from .output import InstanceStats

__all__ = ["dense_mask_errors", "kernel_instance_stats", "delta_p_prime", "general_output_error_bound",
           "realized_output_error_bound"]


# ------------------------------------- any positional LSH (paper section 5)
# For a positional bias L with an LSH scheme (E[M] = L: N-D ALiBi, other kernels) eq. (3) holds
# as is (Hoeffding + a union bound over the n^2 entries: `max_norm_tail_probability` and
# `max_norm_deviation_bound` apply unchanged, with n the number of tokens), and Theorem 2.2 holds
# with Delta'_P = C sqrt(log(n/delta)/s) in place of Delta_P. The spectral bounds (1), (2) and the
# block-size bound (4) are ALiBi-specific and are not claimed here.
def dense_mask_errors(L: Tensor, M: Tensor) -> MaskErrors:
    """``||L - M~||`` (spectral) and ``||L - M~||_max`` per head from dense matrices.

    Args:
        L: ``[H, n, n]`` the expected mask (e.g. :func:`poslsh.reference.alibi_matrix_nd`).
        M: ``[H, n, n]`` the empirical mean mask (:meth:`poslsh.PartitionsND.dense_mean`).
    Returns:
        :class:`MaskErrors` of float64 ``[H]`` tensors. Both matrices are symmetric, so the
        spectral norm is the largest ``|eigenvalue|``: dense ``O(n^3)``, small ``n`` only.
    """
    if L.shape != M.shape or L.dim() != 3 or L.shape[1] != L.shape[2]:
        raise ValueError(f"L and M must both be [H, n, n], got {tuple(L.shape)} and {tuple(M.shape)}")
    diff = L.to(torch.float64) - M.to(torch.float64)
    spectral = torch.linalg.eigvalsh((diff + diff.transpose(1, 2)) / 2).abs().amax(-1)
    return MaskErrors(spectral, diff.abs().amax((1, 2)))


def kernel_instance_stats(q: Tensor, k: Tensor, L: Tensor, *, causal: bool = False,
                          scale: Optional[float] = None) -> InstanceStats:
    """``beta*_P = min_i sum_j P_ij L_ij`` and ``||P||_{2,inf}`` for any positional bias ``L``.

    Args:
        q, k: ``[H, n, d]`` (keys expanded to the query heads for GQA).
        L: ``[H, n, n]`` the positional kernel matrix (dense, small ``n``).
        causal: token ``i`` attends to ``j <= i`` (token order).
    """
    H, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("hid,hjd->hij", q.to(torch.float64), k.to(torch.float64)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    P = torch.softmax(scores, dim=-1)
    return InstanceStats((P * L.to(P)).sum(-1).amin(-1), P.pow(2).sum(-1).sqrt().amax(-1))


def delta_p_prime(n: int, num_samples: int, delta: float, C: float = 1.0) -> float:
    """Section 5: ``Delta'_P = C sqrt(log(n/delta) / s)``, ``s = num_samples`` (any positional LSH; no Psi,
    no ``||P||_{2,inf}``)."""
    s = num_samples
    _check_ns(n, s)
    _check_delta(delta)
    return C * math.sqrt(math.log(n / delta) / s)


def general_output_error_bound(beta_star: float, v_max: float, n: int, num_samples: int, delta: float,
                               C: float = 1.0) -> float:
    """Theorem 2.2 for any positional LSH: ``||T - T~||_max <= 2 Delta'_P / (beta* - Delta'_P) ||V||_max``
    when ``Delta'_P < beta*`` (``inf`` otherwise), with probability ``1 - delta``."""
    dp = delta_p_prime(n, num_samples, delta, C)
    return 2.0 * dp / (beta_star - dp) * v_max if dp < beta_star else float("inf")


def realized_output_error_bound(beta_star: float, max_error: float, v_max: float) -> float:
    """The deterministic step of Theorem 2.2 (eqs. 8, 10, 14) with the *realised*
    ``eps = ||L - M~||_max`` of a draw: ``||T - T~||_max <= 2 eps / (beta* - eps) ||V||_max``
    when ``eps < beta*`` (``inf`` otherwise). Holds for every draw, any positional LSH."""
    return 2.0 * max_error / (beta_star - max_error) * v_max if max_error < beta_star else float("inf")
