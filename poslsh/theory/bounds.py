"""The paper's guarantees on the mask (Theorem 2.1, eqs. (1)-(4)) and the runtime bound, as
functions of the length ``n``, the number of samples and the bandwidth ``sigma``.

Bounds carry the paper's universal constant ``C`` as an explicit parameter (default 1: the
theorems only say it exists; the paper app's ``poslsh audit`` measures the smallest ``C`` that
makes them hold on real inputs).
"""
from __future__ import annotations

import math

from ..partitions import Partitions

__all__ = ["psi", "alibi_norm_bound", "spectral_expectation_bound", "spectral_tail_probability",
           "spectral_deviation_bound", "max_norm_tail_probability", "max_norm_deviation_bound",
           "samples_for_max_norm", "grouped_max_norm_tail_probability", "grouped_max_norm_deviation_bound",
           "max_norm_bound_for", "block_size_bound", "runtime_bound"]


# ----------------------------------------------------------------- constants
def psi(sigma: float) -> float:
    """``Psi_sigma = 1 + sigma + (e^{1/sigma} + 1) / (e^{1/sigma} - 1)``."""
    _check_sigma(sigma)
    return 1.0 + sigma + alibi_norm_bound(sigma)


def alibi_norm_bound(sigma: float) -> float:
    """Lemma 3.7: ``||L*|| <= (e^{1/sigma} + 1) / (e^{1/sigma} - 1) = coth(1 / (2 sigma))``."""
    _check_sigma(sigma)
    return 1.0 / math.tanh(0.5 / sigma)


def _check_sigma(sigma: float) -> None:
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")


def _check_ns(n: int, s: int) -> None:
    if n < 1 or s < 1:
        raise ValueError(f"need n >= 1 and num_samples >= 1, got n={n}, num_samples={s}")


def _check_delta(delta: float, upper: float = 1.0) -> None:
    if not (0.0 < delta < upper):
        raise ValueError(f"delta must be in (0, {upper:g}), got {delta}")


# ------------------------------------------------------------ Theorem 2.1
def spectral_expectation_bound(n: int, num_samples: int, sigma: float, C: float = 1.0) -> float:
    """Eq. (1): ``E||L* - M~|| <= C Psi (sqrt(log n / s) + log n / s)``, ``s = num_samples``."""
    s = num_samples
    _check_ns(n, s)
    ln = math.log(max(n, 2))
    return C * psi(sigma) * (math.sqrt(ln / s) + ln / s)


def spectral_tail_probability(eps: float, n: int, num_samples: int, sigma: float, C: float = 1.0) -> float:
    """Eq. (2): ``Pr[||L* - M~|| >= eps] <= n exp(-C s min(eps^2/Psi^2, eps/Psi))`` (capped at 1)."""
    s = num_samples
    _check_ns(n, s)
    r = eps / psi(sigma)
    return min(1.0, n * math.exp(-C * s * min(r * r, r)))


def spectral_deviation_bound(n: int, num_samples: int, sigma: float, delta: float, C: float = 1.0) -> float:
    """The ``eps`` at which eq. (2)'s tail probability equals ``delta``."""
    s = num_samples
    _check_ns(n, s)
    _check_delta(delta)
    x = math.log(n / delta) / (C * s)
    return psi(sigma) * (math.sqrt(x) if x <= 1.0 else x)


def max_norm_tail_probability(eps: float, n: int, num_samples: int) -> float:
    """Eq. (3): ``Pr[||L* - M~||_max >= eps] <= 2 n^2 exp(-2 s eps^2)`` (capped at 1), ``s = num_samples``."""
    s = num_samples
    _check_ns(n, s)
    return min(1.0, 2.0 * n * n * math.exp(-2.0 * s * eps * eps))


def max_norm_deviation_bound(n: int, num_samples: int, delta: float) -> float:
    """The ``eps`` at which eq. (3) gives confidence ``1 - delta``: ``sqrt(log(2 n^2/delta) / (2 s))``."""
    s = num_samples
    _check_ns(n, s)
    _check_delta(delta)
    return math.sqrt(math.log(2.0 * n * n / delta) / (2.0 * s))


def samples_for_max_norm(eps: float, n: int, delta: float) -> int:
    """Smallest ``num_samples`` with ``||L* - M~||_max < eps`` at confidence ``1 - delta`` by eq. (3)."""
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    _check_ns(n, 1)
    _check_delta(delta)
    return max(1, math.ceil(math.log(2.0 * n * n / delta) / (2.0 * eps * eps)))


# ------------------------------------------- eq. (3) for correlated masks
def _check_groups_count(n: int, groups: float) -> None:
    if n < 1 or not (isinstance(groups, (int, float)) and groups >= 1):
        raise ValueError(f"need n >= 1 and groups >= 1 (independent groups of masks), got n={n}, groups={groups!r}")


def grouped_max_norm_tail_probability(eps: float, n: int, groups: float) -> float:
    """Eq. (3) for masks drawn in ``G`` independent groups (``"grouped"``, ``"stratified"``):
    ``Pr[||L* - M~||_max >= eps] <= 2 n^2 exp(-2 G eps^2)`` (capped at 1).

    Eq. (3)'s Hoeffding argument needs independent bounded terms, and the masks of a
    group are dependent, but the groups are independent: ``M~_ij = sum_g (k_g / s) X_g``
    with ``X_g`` the mean of group ``g``'s masks at ``(i, j)``, in ``[0, 1]``, the ``X_g``
    independent, and ``E[M~_ij] = L*_ij`` (every mask is marginally exact). Hoeffding's
    inequality gives ``Pr[|M~_ij - L*_ij| >= eps] <= 2 exp(-2 eps^2 / sum_g (k_g/s)^2)``
    per entry, i.e. ``2 exp(-2 G eps^2)`` with ``G = s^2 / sum_g k_g^2``
    (:meth:`~poslsh.partitions.Partitions.effective_groups`: the number of groups when
    they have equal sizes, ``s`` for independent masks, where this is eq. (3) itself);
    a union bound over the ``n^2`` entries gives the statement. The price of the
    correlation is the rate: ``G ~ sqrt(s)`` or ``s / k`` independent terms instead of
    ``s``, although the measured error is lower (``docs/sampling.md``).
    """
    _check_groups_count(n, groups)
    return min(1.0, 2.0 * n * n * math.exp(-2.0 * groups * eps * eps))


def grouped_max_norm_deviation_bound(n: int, groups: float, delta: float) -> float:
    """The ``eps`` at which :func:`grouped_max_norm_tail_probability` equals ``delta``:
    ``sqrt(log(2 n^2 / delta) / (2 G))``."""
    _check_groups_count(n, groups)
    _check_delta(delta)
    return math.sqrt(math.log(2.0 * n * n / delta) / (2.0 * groups))


def max_norm_bound_for(partitions: Partitions, n: int, delta: float) -> float:
    """The max-norm deviation bound at confidence ``1 - delta`` that holds for how
    ``partitions`` were drawn: eq. (3) with ``s`` for i.i.d. masks (no groups), the
    grouped bound with ``G = partitions.effective_groups()`` otherwise (``= s`` for
    stratified masks: eq. (3) verbatim)."""
    if partitions.groups is None:
        return max_norm_deviation_bound(n, partitions.num_samples, delta)
    return grouped_max_norm_deviation_bound(n, partitions.effective_groups(), delta)


def block_size_bound(*, num_samples: int, sigma: float, delta: float) -> float:
    """Eq. (4): ``Pr[b_max > 1 + sigma (3 ln(s/delta) + 2)] < delta`` for ``delta in (0, 1/e)``, ``s = num_samples``
    (keyword-only: the order of 0.2 was ``(sigma, s, delta)``)."""
    s = num_samples
    _check_sigma(sigma)
    _check_ns(1, s)
    _check_delta(delta, 1.0 / math.e)
    return 1.0 + sigma * (3.0 * math.log(s / delta) + 2.0)


def runtime_bound(n: int, d: int, num_samples: int, sigma: float, delta: float) -> float:
    """Theorem 2.2 item 1 (up to constants): ``n d (sigma s log(s/delta) + 1)`` operations, ``s = num_samples``."""
    s = num_samples
    return n * d * (sigma * s * math.log(s / delta) + 1.0)
