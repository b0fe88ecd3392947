"""The paper's guarantees (Theorems 2.1 and 2.2) as functions, and the matrix
norms they bound, computed without ``O(s n^2)`` work.

Bounds carry the paper's universal constant ``C`` as an explicit parameter
(default 1: the theorems only say it exists; the paper app's ``poslsh audit``
measures the smallest ``C`` that makes them hold on real inputs). The window's truncation
bound (exact ALiBi cut at a window, the rival of positional LSH) lives in :mod:`poslsh.window_theory`.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .partitions import Partitions
from .widths import GammaWidths
from .window_theory import alibi_window, logit_range, window_error_bound, window_tail_ratio

__all__ = [
    "psi", "alibi_norm_bound", "spectral_expectation_bound", "spectral_tail_probability",
    "spectral_deviation_bound", "max_norm_tail_probability", "max_norm_deviation_bound",
    "samples_for_max_norm", "grouped_max_norm_tail_probability", "grouped_max_norm_deviation_bound",
    "max_norm_bound_for", "block_size_bound", "runtime_bound", "MaskErrors", "mask_error_norms",
    "max_norm_error", "spectral_norm_error", "mask_error_matvec", "InstanceStats", "instance_stats",
    "delta_p", "output_error_bound",
    # any positional LSH (paper section 5): N-D ALiBi, other kernels
    "dense_mask_errors", "kernel_instance_stats", "delta_p_prime", "general_output_error_bound",
    "realized_output_error_bound",
    # exact ALiBi cut at a window (poslsh.window_theory)
    "window_tail_ratio", "window_error_bound", "alibi_window", "logit_range",
]


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
        raise ValueError(f"need n >= 1 and s >= 1, got n={n}, s={s}")


def _check_delta(delta: float, upper: float = 1.0) -> None:
    if not (0.0 < delta < upper):
        raise ValueError(f"delta must be in (0, {upper:g}), got {delta}")


# ------------------------------------------------------------ Theorem 2.1
def spectral_expectation_bound(n: int, s: int, sigma: float, C: float = 1.0) -> float:
    """Eq. (1): ``E||L* - M~|| <= C Psi (sqrt(log n / s) + log n / s)``."""
    _check_ns(n, s)
    ln = math.log(max(n, 2))
    return C * psi(sigma) * (math.sqrt(ln / s) + ln / s)


def spectral_tail_probability(eps: float, n: int, s: int, sigma: float, C: float = 1.0) -> float:
    """Eq. (2): ``Pr[||L* - M~|| >= eps] <= n exp(-C s min(eps^2/Psi^2, eps/Psi))`` (capped at 1)."""
    _check_ns(n, s)
    r = eps / psi(sigma)
    return min(1.0, n * math.exp(-C * s * min(r * r, r)))


def spectral_deviation_bound(n: int, s: int, sigma: float, delta: float, C: float = 1.0) -> float:
    """The ``eps`` at which eq. (2)'s tail probability equals ``delta``."""
    _check_ns(n, s)
    _check_delta(delta)
    x = math.log(n / delta) / (C * s)
    return psi(sigma) * (math.sqrt(x) if x <= 1.0 else x)


def max_norm_tail_probability(eps: float, n: int, s: int) -> float:
    """Eq. (3): ``Pr[||L* - M~||_max >= eps] <= 2 n^2 exp(-2 s eps^2)`` (capped at 1)."""
    _check_ns(n, s)
    return min(1.0, 2.0 * n * n * math.exp(-2.0 * s * eps * eps))


def max_norm_deviation_bound(n: int, s: int, delta: float) -> float:
    """The ``eps`` at which eq. (3) gives confidence ``1 - delta``: ``sqrt(log(2 n^2/delta) / (2 s))``."""
    _check_ns(n, s)
    _check_delta(delta)
    return math.sqrt(math.log(2.0 * n * n / delta) / (2.0 * s))


def samples_for_max_norm(eps: float, n: int, delta: float) -> int:
    """Smallest ``s`` with ``||L* - M~||_max < eps`` at confidence ``1 - delta`` by eq. (3)."""
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


def block_size_bound(sigma: float, s: int, delta: float) -> float:
    """Eq. (4): ``Pr[b_max > 1 + sigma (3 ln(s/delta) + 2)] < delta`` for ``delta in (0, 1/e)``."""
    _check_sigma(sigma)
    _check_ns(1, s)
    _check_delta(delta, 1.0 / math.e)
    return 1.0 + sigma * (3.0 * math.log(s / delta) + 2.0)


def runtime_bound(n: int, d: int, s: int, sigma: float, delta: float) -> float:
    """Theorem 2.2 item 1 (up to constants): ``n d (sigma s log(s/delta) + 1)`` operations."""
    return n * d * (sigma * s * math.log(s / delta) + 1.0)


# ------------------------------------------------- norms of L* - M~ (exact)
class MaskErrors(NamedTuple):
    spectral: Tensor   # [H] ||L* - M~||
    max: Tensor        # [H] ||L* - M~||_max


def _row_chunk_counts(start: Tensor, end: Tensor, n: int, r0: int, r1: int) -> Tensor:
    """``count[i, j]`` for rows ``i in [r0, r1)`` from the blocks ``[start, end)`` of
    one head (all samples): a 2-D difference array restricted to the row chunk."""
    hit = (start < r1) & (end > r0)
    a, e = start[hit], end[hit]
    top, bot = a.clamp(min=r0) - r0, e.clamp(max=r1) - r0
    diff = torch.zeros(r1 - r0 + 1, n + 1, dtype=torch.int32)
    ones = torch.ones_like(a, dtype=torch.int32)
    for rows, cols, sign in ((top, a, 1), (top, e, -1), (bot, a, -1), (bot, e, 1)):
        diff.index_put_((rows, cols), sign * ones, accumulate=True)
    return diff.cumsum(0).cumsum(1)[: r1 - r0, :n]


def max_norm_error(partitions: Partitions, n: int, *, row_chunk: int = 1024) -> Tensor:
    """``||L* - M~||_max`` per head, float64 ``[H]``: ``O(n^2 + #blocks)`` time
    per head (row-chunked difference arrays), ``O(row_chunk * n)`` memory."""
    if partitions.sigma is None:
        raise ValueError("partitions have no sigma (fixed blocks): L* is undefined")
    if partitions.distribution != GammaWidths():
        raise ValueError(f"L* is ALiBi's kernel (Gamma(2) widths) but these widths are {partitions.distribution.name}: "
                         "compare dense_mean(n) with expected_mean(n)")
    p = partitions.to("cpu")
    blk = p.blocks(n)
    s = p.num_samples
    pos = torch.arange(n, dtype=torch.float64)
    out = torch.zeros(p.num_heads, dtype=torch.float64)
    for h in range(p.num_heads):
        sel = blk.head == h
        start, end = blk.start[sel], blk.start[sel] + blk.length[sel]
        sigma = float(p.sigma[h])
        best = 0.0
        for r0 in range(0, n, row_chunk):
            r1 = min(n, r0 + row_chunk)
            m = _row_chunk_counts(start, end, n, r0, r1).to(torch.float64) / s
            lstar = torch.exp(-(pos[r0:r1, None] - pos[None, :]).abs() / sigma)
            best = max(best, float((lstar - m).abs().max()))
        out[h] = best
    return out


def _numpy():
    """numpy and scipy are needed only for the spectral norm (Lanczos): imported there."""
    try:
        import numpy
        import scipy.sparse.linalg  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the spectral norm needs numpy and scipy ({e.name} is missing): "
                          "pip install numpy scipy (or poslsh[theory])") from None
    return numpy


def _toeplitz_exp_matvec(x, sigma: float):
    """``L* x`` for ``L*_ij = exp(-|i-j|/sigma)`` via circulant embedding and FFT, ``O(n log n)``."""
    np = _numpy()
    n = x.shape[0]
    col = np.exp(-np.arange(n) / sigma)
    circ = np.concatenate([col, [0.0], col[:0:-1]])
    fx = np.fft.rfft(np.concatenate([x, np.zeros(n)]), n=2 * n)
    return np.fft.irfft(np.fft.rfft(circ) * fx, n=2 * n)[:n]


def mask_error_matvec(start, end, s: int, sigma: float, n: int):
    """``x -> (L* - M~) x`` for one head in ``O(n log n + #blocks)`` (numpy arrays); ``M~ x`` is a
    sum of per-block sums computed with prefix sums (no matrix)."""
    np = _numpy()

    def matvec(x):
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        prefix = np.concatenate([[0.0], np.cumsum(x)])
        sums = prefix[end] - prefix[start]
        spread = np.bincount(start, sums, minlength=n + 1) - np.bincount(end, sums, minlength=n + 1)
        return _toeplitz_exp_matvec(x, sigma) - np.cumsum(spread)[:n] / s

    return matvec


def spectral_norm_error(partitions: Partitions, n: int, *, tol: float = 1e-6,
                        dense_below: int = 384) -> Tensor:
    """``||L* - M~||`` per head, float64 ``[H]``. Small ``n``: dense eigenvalues.
    Otherwise Lanczos (``scipy.sparse.linalg.eigsh``) on the symmetric matrix,
    using :func:`mask_error_matvec`: ``O(n log n + #blocks)`` per iteration. Needs numpy and scipy."""
    np = _numpy()
    from scipy.sparse.linalg import LinearOperator, eigsh

    if partitions.sigma is None:
        raise ValueError("partitions have no sigma (fixed blocks): L* is undefined")
    if partitions.distribution != GammaWidths():
        raise ValueError(f"L* is ALiBi's kernel (Gamma(2) widths) but these widths are {partitions.distribution.name}: "
                         "compare dense_mean(n) with expected_mean(n)")
    p = partitions.to("cpu")
    blk = p.blocks(n)
    out = torch.zeros(p.num_heads, dtype=torch.float64)
    for h in range(p.num_heads):
        sel = blk.head == h
        start = blk.start[sel].numpy()
        end = (blk.start[sel] + blk.length[sel]).numpy()
        mv = mask_error_matvec(start, end, p.num_samples, float(p.sigma[h]), n)
        if n <= dense_below:
            dense = np.stack([mv(col) for col in np.eye(n)], axis=1)
            out[h] = float(np.abs(np.linalg.eigvalsh((dense + dense.T) / 2)).max())
            continue
        op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
        v0 = np.random.default_rng(0).standard_normal(n)
        vals = eigsh(op, k=1, which="LM", tol=tol, v0=v0, return_eigenvectors=False,
                     maxiter=max(1000, 20 * n))
        out[h] = float(np.abs(vals).max())
    return out


def mask_error_norms(partitions: Partitions, n: int) -> MaskErrors:
    """Both norms of ``L* - M~`` per head (see the two functions above)."""
    return MaskErrors(spectral_norm_error(partitions, n), max_norm_error(partitions, n))


# ------------------------------------------------------------ Theorem 2.2
class InstanceStats(NamedTuple):
    beta_star: Tensor   # [H] min_i sum_j P_ij L*_ij
    p_2inf: Tensor      # [H] ||P||_{2,inf} = max_i sqrt(sum_j P_ij^2)


def instance_stats(q: Tensor, k: Tensor, sigma: Tensor, *, causal: bool = True,
                   scale: Optional[float] = None, row_chunk: int = 512) -> InstanceStats:
    """``beta*_P`` and ``||P||_{2,inf}`` of an attention instance (dense, row-chunked).

    Args:
        q, k: ``[H, n, d]`` (keys already expanded to the query heads for GQA).
        sigma: ``[H]`` bandwidths.
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


def delta_p(p_2inf: float, sigma: float, n: int, s: int, delta: float, C: float = 1.0) -> float:
    """``Delta_P = C min(Psi ||P||_{2,inf}, 1) sqrt(log(n/delta) / s)``."""
    _check_ns(n, s)
    _check_delta(delta)
    return C * min(psi(sigma) * p_2inf, 1.0) * math.sqrt(math.log(n / delta) / s)


def output_error_bound(beta_star: float, p_2inf: float, v_max: float, sigma: float, n: int, s: int,
                       delta: float, C: float = 1.0) -> float:
    """Theorem 2.2 item 2: ``||T* - T~||_max <= 2 Delta_P / (beta* - Delta_P) ||V||_max``
    when ``Delta_P < beta*``; ``inf`` when the condition fails."""
    dp = delta_p(p_2inf, sigma, n, s, delta, C)
    return 2.0 * dp / (beta_star - dp) * v_max if dp < beta_star else float("inf")


def smallest_constant(observed_error: float, beta_star: float, p_2inf: float, v_max: float,
                      sigma: float, n: int, s: int, delta: float) -> Tuple[float, bool]:
    """The smallest ``C`` for which Theorem 2.2's bound covers ``observed_error``.

    Solves ``2 C D / (beta* - C D) v_max = err`` with ``D = Delta_P / C``:
    ``C = err beta* / (D (2 v_max + err))``. Returns ``(C, ok)``; ``ok`` is False
    when the instance is degenerate (``D = 0`` with a nonzero error).
    """
    D = delta_p(p_2inf, sigma, n, s, delta, 1.0)
    if observed_error <= 0:
        return 0.0, True
    if D <= 0:
        return float("inf"), False
    return observed_error * beta_star / (D * (2.0 * v_max + observed_error)), True


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


def delta_p_prime(n: int, s: int, delta: float, C: float = 1.0) -> float:
    """Section 5: ``Delta'_P = C sqrt(log(n/delta) / s)`` (any positional LSH; no Psi, no ``||P||_{2,inf}``)."""
    _check_ns(n, s)
    _check_delta(delta)
    return C * math.sqrt(math.log(n / delta) / s)


def general_output_error_bound(beta_star: float, v_max: float, n: int, s: int, delta: float,
                               C: float = 1.0) -> float:
    """Theorem 2.2 for any positional LSH: ``||T - T~||_max <= 2 Delta'_P / (beta* - Delta'_P) ||V||_max``
    when ``Delta'_P < beta*`` (``inf`` otherwise), with probability ``1 - delta``."""
    dp = delta_p_prime(n, s, delta, C)
    return 2.0 * dp / (beta_star - dp) * v_max if dp < beta_star else float("inf")


def realized_output_error_bound(beta_star: float, max_error: float, v_max: float) -> float:
    """The deterministic step of Theorem 2.2 (eqs. 8, 10, 14) with the *realised*
    ``eps = ||L - M~||_max`` of a draw: ``||T - T~||_max <= 2 eps / (beta* - eps) ||V||_max``
    when ``eps < beta*`` (``inf`` otherwise). Holds for every draw, any positional LSH."""
    return 2.0 * max_error / (beta_star - max_error) * v_max if max_error < beta_star else float("inf")
