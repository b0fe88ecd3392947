"""How much exact ALiBi loses when it is cut at a window: a rigorous, attainable bound on the
dropped softmax mass and the output error, and its inverse (the smallest window for a tolerance).

Setting. Head ``h`` with bandwidth ``sigma = 1 / m_h``, ``q = e^{-1/sigma}``, logits
``s_ij = scale * q_i . k_j`` (no positional bias), exact ALiBi weights
``a_ij = e^{s_ij - |i - j| / sigma}`` over the keys ``J_i`` query ``i`` may see (``j <= i`` when
causal, all ``n`` keys otherwise). The window ``w`` keeps ``W_i = {j in J_i : |i - j| <= w}`` and
drops ``D_i = J_i \\ W_i``. With ``Z_W = sum_{W_i} a_ij`` and ``Z_D = sum_{D_i} a_ij`` the dropped
fraction of the softmax mass is ``delta_i = Z_D / (Z_W + Z_D)``.

The logit range ``R`` (why a spread). Softmax is shift invariant, so only logit *differences*
can matter: the bound needs ``R >= max_{j in D_i} s_ij - min_{j in W_i} s_ij`` for every query
``i`` (the largest dropped logit minus the smallest kept one). Any bound on the spread
``max_j s_ij - min_j s_ij`` over the visible keys qualifies (:func:`logit_range` measures it), and
so does ``2 A`` when ``|s_ij| <= A`` (e.g. ``A = scale max ||q_i|| max ||k_j||`` by Cauchy-Schwarz);
the spread is the weaker assumption (it never exceeds ``2 max |s_ij|``).

Theorem. Let ``S_i = sum_{j in W_i} q^{|i-j|}`` and ``T_i = sum_{j in D_i} q^{|i-j|}`` (the ALiBi
kernel's mass inside and outside the window) and ``rho = max_i T_i / S_i``. Then for every query

    delta_i <= e^R rho / (1 + e^R rho)                                       (dropped mass)
    |T*_ic - T^w_ic| = delta_i |T^D_ic - T^w_ic| <= delta_i (max_j v_jc - min_j v_jc) <= 2 delta_i ||V||_max

where ``T*`` is exact ALiBi attention, ``T^w`` the windowed one and ``T^D`` attention over the
dropped keys alone. Proof: with ``M = max_{D_i} s_ij`` and ``m = min_{W_i} s_ij``,
``Z_D <= e^M T_i`` and ``Z_W >= e^m S_i``, so ``delta_i = 1 / (1 + Z_W / Z_D) <= 1 / (1 + e^{m - M} / rho)
<= 1 / (1 + e^{-R} / rho)``. For the output, ``T*_i = (Z_W T^w_i + Z_D T^D_i) / (Z_W + Z_D)
= (1 - delta_i) T^w_i + delta_i T^D_i``, hence ``T*_i - T^w_i = delta_i (T^D_i - T^w_i)``, and both
``T^D_ic`` and ``T^w_ic`` are convex combinations of the ``v_jc``. Both inequalities are attained:
put every dropped logit at ``m + R`` and every kept one at ``m`` at the query that attains ``rho``
(equality in the first), and values ``+1`` on dropped keys, ``-1`` on kept ones (equality in the
second, error ``2 delta``).

The ratio ``rho`` in closed form (geometric series, ``t(a) = sum_{d=w+1}^{a} q^d``):

* causal (``W_i = {i-w..i}``): ``T_i / S_i`` grows with ``i``; the last query gives
  ``rho = (q^{w+1} - q^n) / (1 - q^{w+1})``, and ``q^{w+1} / (1 - q^{w+1})`` for any ``n`` (``n=None``);
* two-sided: a query with ``a`` keys on its left and ``b`` on its right has
  ``S = 1 + g(min(w,a)) + g(min(w,b))``, ``T = t(a) + t(b)`` (``g(m) = sum_{d=1}^m q^d``). With one
  side short of ``w`` the ratio grows as that side shrinks (the edge query, ``a = 0``, is the worst,
  giving the causal value); with both sides full ``S`` is fixed and ``t`` is concave, so the middle
  query is the worst: ``rho_mid = q^{w+1} (2 - q^{a-w} - q^{b-w}) / (1 + q - 2 q^{w+1})``,
  ``a, b = floor/ceil((n-1)/2)``. So ``rho = max(rho_edge, rho_mid)``, and for any ``n``
  ``2 q^{w+1} / (1 + q - 2 q^{w+1})``.

So the error decays like ``e^{R - w / sigma}``: the window a tolerance needs is about
``sigma (R + ln(1 / tol))`` (:func:`smallest_window`), linear in ``R``. On real attention the bound's
``R`` (the worst case over keys) exceeds the effective gap between dropped and kept logits, so it
over-states the error by up to ``e^{R - R_eff}`` but the window it prescribes only by
``sigma (R - R_eff)`` positions (``docs/frontier.md`` measures both on SmolLM2).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .kind import NO_WINDOW

__all__ = ["window_tail_ratio", "window_error_bound", "smallest_window", "logit_range", "logit_range_bound"]

Number = Union[int, float, Tensor]


def _per_head(x: Number, name: str, *, integer: bool = False) -> Tensor:
    t = torch.as_tensor(x, dtype=torch.float64).detach().cpu().reshape(-1)
    if t.numel() < 1 or not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite numbers (one, or one per head), got {x!r}")
    if integer and not bool((t == t.round()).all() and (t >= 0).all()):
        raise ValueError(f"{name} must be whole numbers >= 0 (positions), got {t.tolist()}")
    return t


def _broadcast(**named: Tensor):
    """The per-head arguments broadcast to one length: each has one value (every head) or one per head,
    else a ValueError naming the first per-head argument and the one that disagrees."""
    sizes = {name: t.numel() for name, t in named.items()}
    first = next((name for name, size in sizes.items() if size > 1), None)
    for name, size in sizes.items():
        if size > 1 and size != sizes[first]:
            raise ValueError(f"{first} has {sizes[first]} values but {name} has {size}: give one value (every head) "
                             "or one per head, the same heads for every argument")
    return torch.broadcast_tensors(*named.values())


def _check_n(n: Optional[int]) -> Optional[int]:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be None (any length) or an int >= 1, got {n!r}")
    return n


def _log_rho(w: Tensor, sigma: Tensor, causal: bool, n: Optional[int]) -> Tensor:
    """``log rho`` (float64, broadcast of ``w`` and ``sigma``); ``-inf`` when nothing is dropped."""
    x = (w + 1) / sigma                                           # q^{w+1} = e^{-x}
    log_edge = -x - torch.log(-torch.expm1(-x))                   # q^{w+1} / (1 - q^{w+1})
    if n is not None:
        far = torch.clamp((n - 1 - w) / sigma, min=0.0)           # q^n / q^{w+1} = e^{-(n-1-w)/sigma}
        log_edge = torch.where(w >= n - 1, torch.full_like(log_edge, -math.inf),
                               log_edge + torch.log(-torch.expm1(-far)))
    if causal:
        return log_edge
    inv = 1.0 / sigma
    # 1 + q - 2 q^{w+1} = (1 - q^{w+1}) + q (1 - q^w), each term by expm1 (no cancellation)
    log_den = torch.log(-torch.expm1(-x) - torch.exp(-inv) * torch.expm1(-w * inv))
    if n is None:
        return math.log(2.0) - x - log_den
    a, b = (n - 1) // 2, n - 1 - (n - 1) // 2
    full = w <= a                                                 # the middle query has both sides full
    tails = -torch.expm1(-(a - w).clamp(min=0) * inv) - torch.expm1(-(b - w).clamp(min=0) * inv)
    log_mid = torch.where(full & (tails > 0), -x + torch.log(tails.clamp(min=1e-300)) - log_den,
                          torch.full_like(x, -math.inf))
    return torch.maximum(log_edge, log_mid)


def window_tail_ratio(w: Number, sigma: Number, *, causal: bool = True, n: Optional[int] = None) -> Tensor:
    """``rho = max_i T_i / S_i``: the ALiBi kernel's mass outside the window over its mass inside,
    at the worst query (closed form, see the module docstring), float64 ``[H]``.

    Args:
        w: window (an int, or ``[H]`` whole numbers ``>= 0``): keys with ``|i - j| <= w`` are kept.
        sigma: bandwidth(s) ``1 / m_h`` (a number or ``[H]``), ``> 0``.
        causal: keys ``j <= i`` only.
        n: sequence length; ``None``: the supremum over every length.
    """
    w_t, sig = _broadcast(w=_per_head(w, "w", integer=True), sigma=_per_head(sigma, "sigma"))
    if bool((sig <= 0).any()):
        raise ValueError(f"sigma must be > 0, got {sig.tolist()}")
    return torch.exp(_log_rho(w_t, sig, bool(causal), _check_n(n)))


def window_error_bound(w: Number, sigma: Number, logit_range: Number, *, causal: bool = True,
                       n: Optional[int] = None, value_range: Optional[Number] = None) -> Tensor:
    """Upper bound on what cutting exact ALiBi at window ``w`` loses, per head (float64 ``[H]``).

    Without ``value_range``: the dropped fraction of every query's softmax mass,
    ``max_i delta_i <= e^R rho / (1 + e^R rho)``. With ``value_range >= max_c (max_j v_jc - min_j v_jc)``
    (``2 ||V||_max`` always qualifies): the output error ``||T* - T^w||_max <= delta * value_range``.
    Both are attained by some input (module docstring: statement, proof, closed forms).

    Args:
        w: window (int or ``[H]``), keys with ``|i - j| <= w`` kept.
        sigma: ALiBi bandwidths ``1 / m_h`` (number or ``[H]``).
        logit_range: ``R >= max_{dropped j} s_ij - min_{kept j} s_ij`` for every query, e.g. the spread
            ``max_j s_ij - min_j s_ij`` of the unbiased logits ``s_ij = scale q_i . k_j`` (number or ``[H]``).
        causal: keys ``j <= i`` only. n: sequence length (``None``: any length, the supremum).
        value_range: see above (number or ``[H]``).
    """
    named = dict(w=_per_head(w, "w", integer=True), sigma=_per_head(sigma, "sigma"),
                 logit_range=_per_head(logit_range, "logit_range"))
    if value_range is not None:
        named["value_range"] = _per_head(value_range, "value_range")
    w_t, sig, R, *vr = _broadcast(**named)
    if bool((sig <= 0).any()):
        raise ValueError(f"sigma must be > 0, got {sig.tolist()}")
    if bool((R < 0).any()):
        raise ValueError(f"logit_range must be >= 0 (a spread of logits), got {R.tolist()}")
    bound = torch.sigmoid(R + _log_rho(w_t, sig, bool(causal), _check_n(n)))
    if value_range is None:
        return bound
    if bool((vr[0] < 0).any()):
        raise ValueError(f"value_range must be >= 0, got {vr[0].tolist()}")
    return bound * vr[0]


def smallest_window(tol: Number, sigma: Number, logit_range: Number, *, causal: bool = True,
                    n: Optional[int] = None, value_range: Optional[Number] = None) -> Tensor:
    """The smallest window per head whose :func:`window_error_bound` is ``<= tol``: int64 ``[H]``
    (``w - 1`` misses the tolerance, unless ``w = 0``; past ``2^53`` the bound is evaluated at the
    float64 nearest each window). With ``n`` the window never exceeds ``n - 1`` (which drops nothing);
    with ``n=None`` it holds at every length, and a window past int64 (``sigma`` beyond ~1e17) is
    :data:`~poslsh.window.kind.NO_WINDOW`, which drops nothing at any length a tensor can have. The
    inverse of :func:`window_error_bound` (same order: what is asked for first, then the bandwidths and
    the range).

    Args:
        tol: the tolerance (``> 0``; number or ``[H]``) on the dropped mass, or on ``||T* - T^w||_max``
            when ``value_range`` is given.
        sigma: ALiBi bandwidths ``1 / m_h`` (number or ``[H]``).
        logit_range, causal, n, value_range: as in :func:`window_error_bound`.
    """
    named = dict(tol=_per_head(tol, "tol"), sigma=_per_head(sigma, "sigma"),
                 logit_range=_per_head(logit_range, "logit_range"))
    if value_range is not None:
        named["value_range"] = _per_head(value_range, "value_range")
    tl, sig, R, *vr = _broadcast(**named)
    if bool((tl <= 0).any()):
        raise ValueError(f"tol must be > 0, got {tl.tolist()}")
    if bool((sig <= 0).any()):
        raise ValueError(f"sigma must be > 0, got {sig.tolist()}")
    n = _check_n(n)

    def bound(w: Tensor) -> Tensor:
        return window_error_bound(w, sig, R, causal=causal, n=n, value_range=value_range)

    # Closed form for n = None (rho(w) <= r solved for w), an upper end for the bisection below; in
    # log space, since r = e^{-R} m / (1 - m) underflows past R ~ 745 (m: the tolerance on the mass).
    mass_tol = tl / vr[0] if vr else tl                          # value_range 0: inf (any window)
    anything = mass_tol >= 1                                      # the bound is < 1: every window does
    m = torch.where(anything, torch.full_like(mass_tol, 0.5), mass_tol)
    log_r = -R + torch.log(m) - torch.log1p(-m)
    if causal:
        need = torch.logaddexp(torch.zeros_like(log_r), -log_r)  # log(1 + 1 / r)
    else:                                                         # log(2 (1 + r) / (r (1 + q)))
        need = (math.log(2.0) + torch.logaddexp(torch.zeros_like(log_r), log_r) - log_r
                - torch.log1p(torch.exp(-1.0 / sig)))
    hi = torch.where(anything, torch.zeros_like(need), torch.clamp(torch.ceil(sig * need) + 1.0, min=0.0))
    if n is not None:
        hi = hi.clamp(max=float(n - 1))
    past_int64 = 2.0 ** 63
    while True:                                                   # rounding: make hi feasible
        bad = (hi < past_int64) & (bound(hi.clamp(max=past_int64)) > tl)
        if not bool(bad.any()):
            break
        hi = torch.where(bad, hi + torch.clamp(hi, min=1.0), hi)
    beyond = hi >= past_int64                                     # NO_WINDOW: nothing dropped at any length
    # Bisection on integers (int64: floats past 2^53 have no midpoints); invariant: bound(lo) > tol or lo = -1.
    hi_i = torch.where(beyond, torch.zeros_like(hi), hi).to(torch.int64)
    lo_i = torch.full_like(hi_i, -1)
    while bool((hi_i - lo_i > 1).any()):
        active = hi_i - lo_i > 1
        mid = lo_i + (hi_i - lo_i) // 2
        ok = bound(mid.clamp(min=0).to(torch.float64)) <= tl
        hi_i, lo_i = torch.where(ok & active, mid, hi_i), torch.where(~ok & active, mid, lo_i)
    return torch.where(beyond, torch.full_like(hi_i, NO_WINDOW), hi_i)


def logit_range(q: Tensor, k: Tensor, *, causal: bool = True, scale: Optional[float] = None,
                chunk: int = 1024) -> Tensor:
    """The largest per-query logit spread ``max_i (max_j s_ij - min_j s_ij)`` of each query head over
    the keys it may see (``s_ij = scale q_i . k_j``, no bias): a valid ``logit_range`` for
    :func:`window_error_bound` and :func:`smallest_window` on this input. Dense in query chunks: ``O(n^2 d)`` time,
    ``O(chunk n)`` memory, float64.

    Args:
        q: ``[B, Hq, n, d]``; k: ``[B, Hkv, n, d]`` (``Hq`` a multiple of ``Hkv``: GQA).
    Returns:
        float64 ``[Hq]`` (the maximum over the batch).
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
            or q.shape[1] % k.shape[1] != 0 or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [B, Hq, n, d] and k [B, Hkv, n, d] (Hq a multiple of Hkv) expected, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    B, H, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kx = k.to(torch.float64).repeat_interleave(H // k.shape[1], dim=1)
    out = torch.zeros(H, dtype=torch.float64, device=q.device)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        c1 = r1 if causal else n
        s = torch.einsum("bhid,bhjd->bhij", q[:, :, r0:r1].to(torch.float64), kx[:, :, :c1]) * scale
        if causal:
            later = torch.arange(c1, device=q.device)[None, :] > torch.arange(r0, r1, device=q.device)[:, None]
            hi_, lo_ = s.masked_fill(later, -math.inf).amax(-1), s.masked_fill(later, math.inf).amin(-1)
        else:
            hi_, lo_ = s.amax(-1), s.amin(-1)
        out = torch.maximum(out, (hi_ - lo_).amax(dim=(0, 2)))
    return out


def logit_range_bound(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """An ``O(B H n d)`` bound on each query head's logit spread ``max_i (max_j s_ij - min_j s_ij)`` over
    ``q [B, Hq, nq, d]`` and ``k [B, Hkv, nk, d]`` (``s = scale q . k``, any keys, no bias): float64 ``[Hq]``,
    ``2 |scale| max_i ||q_i|| max_j ||k_j - kbar||`` (max over the batch; ``kbar`` the keys' mean), by
    Cauchy-Schwarz: ``|q_i . (k_j - k_l)| <= ||q_i|| ||k_j - k_l|| <= 2 ||q_i|| max_j ||k_j - kbar||``. Looser than
    :func:`logit_range` (which is exact and dense), and what a call's certified window needs: a bound, no
    ``n x n``."""
    qd, kd = q.detach().to(torch.float64), k.detach().to(torch.float64)
    qn = qd.norm(dim=-1).amax(dim=(0, 2))                                                 # [Hq]
    kn = (kd - kd.mean(dim=2, keepdim=True)).norm(dim=-1).amax(dim=(0, 2))                # [Hkv]
    return 2.0 * abs(float(scale)) * qn * kn.repeat_interleave(qd.shape[1] // kd.shape[1])
