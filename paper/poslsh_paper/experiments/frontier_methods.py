"""The estimators ``poslsh frontier`` compares, as positional weight matrices, and the one
chunked float64 oracle that measures them all against exact ALiBi.

Every method of the study is attention with positional weights ``W``:
``T_i = sum_j A_ij W_ij v_j / sum_j A_ij W_ij`` (``A_ij = e^{s_ij}``, ``s_ij = scale q_i . k_j``):

* exact ALiBi: ``W = L*`` (``e^{-|i-j|/sigma}``), or cut at a window ``w``: ``L*`` where ``|i-j| <= w``;
* positional LSH: ``W = count`` (the samples in which ``i`` and ``j`` share a block; one softmax);
* the hybrid: ``L*`` on an exact band ``|i-j| <= w0``, and beyond it a sparse tail: key ``j`` kept with
  probability ``p = min(1, c e^{-(|i-j| - w0)/sigma})`` at weight ``L*/p`` (numerator and
  denominator unbiased; drawn where ``p >= TAIL_EPS``: the keys beyond hold less than
  ``TAIL_EPS / c`` of the kernel mass past ``w0``).

A :class:`Method` weighs a :class:`Chunk` (query rows ``[r0, r1)``, their keys, ``A`` and ``A * L*``)
and returns ``A * W`` over the keys within its reach (zero: not attended; causal methods give
no weight to ``j > i``). :func:`attention_passes` runs query chunks: the logits of a chunk are
computed once and every method reuses them, memory ``O(chunk n)``. The oracle computes the keys
within :func:`certified_reach`, beyond which the window theorem
(:func:`poslsh.theory.window_error_bound`) certifies a change below ``EXACT_TOL`` of the value range
in every output; :func:`chunked_alibi_attention` is that oracle alone (equal to
:func:`poslsh.reference.alibi_attention_reference`, tested).

Cost = keys per query: the mean over queries of the keys with nonzero weight (for positional
LSH the union of the query's ``s`` blocks, which for causal attention is one contiguous run
``[i - max_t back_t(i), i]``; for the window ``min(i, w) + 1``, i.e. ``w + 1`` once ``i >= w``).
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from poslsh import theory
from poslsh.partitions import Partitions

__all__ = ["TAIL_EPS", "EXACT_TOL", "Chunk", "Method", "alibi_method", "count_method", "hybrid_method",
           "attention_passes", "certified_reach", "chunked_alibi_attention", "block_reach", "poslsh_keys",
           "window_keys", "hybrid_keys", "match_window", "match_hybrid", "evaluate_head"]

TAIL_EPS = 1e-6
EXACT_TOL = 1e-13      # the oracle's certified truncation (dropped mass; error <= this * value range)


class Chunk(NamedTuple):
    """Query rows ``[r0, r1)`` against keys ``[k0, k1)``: ``dist = i - j`` (int64), ``a = e^{s_ij - top_i}``
    (0 where a key is not visible) and ``al = a * L*`` (float64 ``[r1 - r0, k1 - k0]``)."""
    r0: int
    r1: int
    k0: int
    k1: int
    dist: Tensor
    a: Tensor
    al: Tensor

    def cols(self, reach_left: int, reach_right: int) -> Tuple[int, int]:
        """The column slice of the keys within ``reach`` of the chunk's rows."""
        lo, hi = max(self.k0, self.r0 - reach_left), min(self.k1, self.r1 + reach_right)
        return lo - self.k0, hi - self.k0


class Method(NamedTuple):
    """One estimator on one head: ``weigh(chunk) -> (lo, hi, a * W)`` over the chunk's columns
    ``[lo, hi)``; ``reach``: the largest ``|i - j|`` it gives weight to."""
    reach: int
    weigh: Callable[[Chunk], Tuple[int, int, Tensor]]


def alibi_method(sigma: float, n: int, causal: bool, window: Optional[int] = None) -> Method:
    """``L*`` (``window=None``), or ``L*`` cut at ``|i - j| <= window``."""
    reach = n if window is None else int(window)

    def weigh(ch: Chunk):
        lo, hi = ch.cols(reach, 0 if causal else reach)
        if window is None:
            return lo, hi, ch.al[:, lo:hi]
        return lo, hi, ch.al[:, lo:hi] * (ch.dist[:, lo:hi].abs() <= reach)
    return Method(reach, weigh)


def block_reach(partitions: Partitions, head: int, s: int, n: int) -> Tuple[Tensor, Tensor]:
    """How far back and forward every position's block reaches in the first ``s`` samples of one
    head: ``back[t, i] = i - start_t(i)``, ``fwd[t, i] = end_t(i) - 1 - i`` (int64 ``[s, n]``),
    from the core geometry (:meth:`~poslsh.partitions.Partitions.block_bounds`)."""
    one = Partitions(partitions.widths[head:head + 1, :s], partitions.offsets[head:head + 1, :s])
    i = torch.arange(n)
    start, end = one.block_bounds(n, i)
    return i - start[0], end[0] - 1 - i


def count_method(back: Tensor, fwd: Tensor, causal: bool) -> Method:
    """Positional LSH's ``count_ij`` from :func:`block_reach`: for ``j = i - d <= i`` the samples with
    ``back_t(i) >= d`` (every block holding ``i`` holds ``[start_t(i), i]``), likewise forward."""
    def by_distance(reach_rows: Tensor):                    # [s, c] -> counts by distance [c, D + 1]
        D = int(reach_rows.max())
        hist = torch.zeros(reach_rows.shape[1], D + 2, dtype=torch.float64)
        hist.scatter_add_(1, reach_rows.T, torch.ones(reach_rows.T.shape, dtype=torch.float64))
        return hist.flip(1).cumsum(1).flip(1)[:, :D + 1], D

    def weigh(ch: Chunk):
        cb, db = by_distance(back[:, ch.r0:ch.r1])
        cf, df = (None, 0) if causal else by_distance(fwd[:, ch.r0:ch.r1])
        lo, hi = ch.cols(db, df)
        d = ch.dist[:, lo:hi]
        w = torch.where((d >= 0) & (d <= db), cb.gather(1, d.clamp(0, db)), 0.0)
        if not causal:
            w = w + torch.where((d < 0) & (-d <= df), cf.gather(1, (-d).clamp(0, df)), 0.0)
        return lo, hi, ch.a[:, lo:hi] * w
    return Method(int(max(back.max(), 0 if causal else fwd.max())), weigh)


def _tail_reach(sigma: float, w0: int, c: float) -> int:
    """Beyond ``w0 + this`` the tail's keep probability is below :data:`TAIL_EPS`."""
    return 0 if c <= 0 else max(0, math.ceil(sigma * math.log(max(c / TAIL_EPS, 1.0))))


def hybrid_method(sigma: float, causal: bool, w0: int, c: float, generator: torch.Generator) -> Method:
    """Exact band ``|i - j| <= w0`` plus the importance-sampled sparse tail (module docstring);
    every call draws new keeps from ``generator`` (chunks in order: reproducible)."""
    reach = w0 + _tail_reach(sigma, w0, c)

    def weigh(ch: Chunk):
        lo, hi = ch.cols(reach, 0 if causal else reach)
        ad = ch.dist[:, lo:hi].abs().to(torch.float64)
        p = torch.clamp(c * torch.exp(-(ad - w0) / sigma), max=1.0)
        kept = (torch.rand(ad.shape, generator=generator, dtype=torch.float64) < p) & (ad <= reach)
        al = ch.al[:, lo:hi]
        return lo, hi, torch.where(ad <= w0, al, torch.where(kept, al / p, 0.0))
    return Method(reach, weigh)


# ------------------------------------------------------------------ the one pass
def attention_passes(q: Tensor, k: Tensor, v: Tensor, sigma: float, methods: Sequence[Method], *, causal: bool,
                     scale: Optional[float] = None, chunk: int = 256) -> Iterator[tuple]:
    """Query chunks of positional-weight attention for one head, float64.

    Args:
        q: ``[n, d]``; k: ``[n, d]``; v: ``[n, dv]`` (any float dtype; computed in float64).
        sigma: the head's ALiBi bandwidth (``L*`` of the chunks); methods: the estimators. The logits
            of a chunk are computed once, over the keys within the largest reach, for all of them.
    Yields:
        ``(r0, r1, spread, outs)``: ``spread [c]`` the logit range ``max_j s_ij - min_j s_ij`` over the
        keys computed, and per method ``(out [c, dv], keys [c], den [c])`` (``keys``: keys with nonzero
        weight; ``den = sum_j A_ij W_ij`` relative to ``e^{max_j s_ij}``).
    """
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    n, d = q64.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    reach = max(m.reach for m in methods)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        k0, k1 = max(0, r0 - reach), (r1 if causal else min(n, r1 + reach))
        dist = torch.arange(r0, r1)[:, None] - torch.arange(k0, k1)[None, :]
        s = (q64[r0:r1] @ k64[k0:k1].T) * scale
        if causal:
            later = dist < 0
            top = s.masked_fill(later, -math.inf).amax(1, keepdim=True)
            spread = top[:, 0] - s.masked_fill(later, math.inf).amin(1)
            a = torch.exp(s - top).masked_fill_(later, 0.0)
        else:
            top = s.amax(1, keepdim=True)
            spread = top[:, 0] - s.amin(1)
            a = torch.exp(s - top)
        ch = Chunk(r0, r1, k0, k1, dist, a, a * torch.exp(-dist.abs().to(torch.float64) / sigma))
        outs = []
        for m in methods:
            lo, hi, aw = m.weigh(ch)
            den = aw.sum(1)
            outs.append((aw @ v64[k0 + lo:k0 + hi] / den[:, None], (aw > 0).sum(1), den))
        yield r0, r1, spread, outs


def certified_reach(q: Tensor, k: Tensor, v: Tensor, sigma: float, *, causal: bool, scale: float,
                    tol: float = EXACT_TOL) -> int:
    """The window beyond which exact ALiBi's keys change no output by more than ``tol`` times the
    value range (:func:`poslsh.theory.smallest_window` with the Cauchy-Schwarz logit range
    ``2 scale max ||q_i|| max ||k_j||``): the oracle computes only those keys."""
    if not math.isfinite(sigma):
        return q.shape[0]
    R = 2.0 * scale * float(q.to(torch.float64).norm(dim=-1).max()) * float(k.to(torch.float64).norm(dim=-1).max())
    return int(theory.smallest_window(tol, sigma, R, causal=causal, n=q.shape[0]))


def chunked_alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, causal: bool = False,
                            scale: Optional[float] = None, window=None, chunk: int = 256) -> Tensor:
    """Exact ALiBi attention (cut at ``window`` when given: an int or int ``[Hq]``) in query chunks,
    float64, memory ``O(chunk n)``: what :func:`poslsh.reference.alibi_attention_reference` computes densely. Keys
    farther than :func:`certified_reach` are skipped (their weight changes no output by more than
    ``EXACT_TOL`` times the value range, by the window theorem).

    Args: q ``[B, Hq, n, d]``; k, v ``[B, Hkv, n, d|dv]`` (GQA); slopes ``[Hq]`` (``> 0``).
    Returns ``[B, Hq, n, dv]`` float64.
    """
    B, H, n, d = q.shape
    group = H // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    slopes = torch.as_tensor(slopes, dtype=torch.float64).reshape(-1)
    wins = [None] * H if window is None else torch.as_tensor(window).reshape(-1).expand(H).tolist()
    out = torch.empty(B, H, n, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            qh, kh, vh = q[b, h], k[b, h // group], v[b, h // group]
            sigma = 1.0 / float(slopes[h])
            exact = alibi_method(sigma, n, causal, certified_reach(qh, kh, vh, sigma, causal=causal, scale=scale))
            method = exact if wins[h] is None else alibi_method(sigma, n, causal, min(wins[h], exact.reach))
            for r0, r1, _, outs in attention_passes(qh, kh, vh, sigma, [method], causal=causal, scale=scale,
                                                    chunk=chunk):
                out[b, h, r0:r1] = outs[0][0]
    return out


# ------------------------------------------------------------------ costs
def poslsh_keys(back: Tensor, fwd: Tensor, causal: bool) -> float:
    """Mean keys per query of positional LSH: the union of each query's blocks (:func:`block_reach`)."""
    keys = 1 + back.amax(0) + (0 if causal else fwd.amax(0))
    return float(keys.to(torch.float64).mean())


def window_keys(w: int, n: int, causal: bool) -> float:
    """Mean keys per query of the window ``w``: ``min(i, w) + 1`` (+ ``min(n - 1 - i, w)`` two-sided)."""
    i = torch.arange(n)
    keys = torch.clamp(i, max=w) + 1 + (0 if causal else torch.clamp(n - 1 - i, max=w))
    return float(keys.to(torch.float64).mean())


def hybrid_keys(w0: int, c: float, sigma: float, n: int, causal: bool) -> float:
    """Expected mean keys per query of the hybrid: the band plus ``sum_d p_d`` over the tail."""
    m = torch.arange(1, n + 1, dtype=torch.float64)
    p = torch.clamp(c * torch.exp(-m / sigma), max=1.0) * (m <= _tail_reach(sigma, w0, c))
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), p.cumsum(0)])     # cum[M] = sum_{m <= M} p_m
    i = torch.arange(n)
    tail = cum[(i - w0).clamp(min=0)] + (0 if causal else cum[(n - 1 - i - w0).clamp(min=0)])
    return window_keys(w0, n, causal) + float(tail.mean())


def _closest(f: Callable[[int], float], target: float, hi: int) -> int:
    """The ``x in [0, hi]`` with ``f(x)`` closest to ``target`` (``f`` non-decreasing; ties: smaller)."""
    lo, top = 0, hi
    while lo < top:                                          # first x with f(x) >= target
        mid = (lo + top) // 2
        lo, top = (mid + 1, top) if f(mid) < target else (lo, mid)
    cands = [x for x in (lo - 1, lo) if 0 <= x <= hi]
    return min(cands, key=lambda x: (abs(f(x) - target), x))


def match_window(keys: float, n: int, causal: bool) -> int:
    """The window whose mean keys per query is closest to ``keys``."""
    return _closest(lambda w: window_keys(w, n, causal), keys, n - 1)


def match_hybrid(keys: float, sigma: float, share: float, n: int, causal: bool) -> Tuple[int, float]:
    """``(w0, c)`` of the hybrid with about ``keys`` keys per query, a fraction ``share`` of them in the
    sampled tail: ``c = share * keys / sigma`` (the tail keeps about ``c sigma`` keys), ``w0`` matched."""
    c = share * keys / sigma
    return _closest(lambda w0: hybrid_keys(w0, c, sigma, n, causal), keys, n - 1), c


# ------------------------------------------------------------------ measuring one head
def evaluate_head(q: Tensor, k: Tensor, v: Tensor, sigma: float, methods: Sequence[Method], *, causal: bool,
                  scale: Optional[float] = None, chunk: int = 256) -> Tuple[List[dict], dict]:
    """Errors of every method against exact ALiBi on one head (float64, one pass).

    Returns ``(rows, head)``: one dict per method with ``max`` (``||T - T*||_max``), ``mae`` (mean
    absolute error), ``relf`` (``||T - T*||_F / ||T*||_F``), ``keys`` (mean keys per query) and
    ``dropped`` (``max_i`` of the fraction of exact ALiBi's softmax mass outside the method's support,
    ``1 - den / den*``: meaningful for windows); and ``head``: ``logit_range`` (the largest spread
    over the keys the oracle computes) and ``value_range`` (``max_c`` of ``max_j v_jc - min_j v_jc``),
    for :func:`poslsh.theory.window_error_bound`, and ``exact_reach`` (:func:`certified_reach`)."""
    n, dv = q.shape[0], v.shape[1]
    scale = 1.0 / math.sqrt(q.shape[1]) if scale is None else float(scale)
    reach = certified_reach(q, k, v, sigma, causal=causal, scale=scale)
    exact = alibi_method(sigma, n, causal, reach)
    m = len(methods)
    mx, ab, sq, dropped = [0.0] * m, [0.0] * m, [0.0] * m, [0.0] * m
    keys = [0] * m
    ref_sq, spread_max = 0.0, 0.0
    for _, _, spread, outs in attention_passes(q, k, v, sigma, [exact, *methods], causal=causal, scale=scale,
                                               chunk=chunk):
        t_star, _, den_star = outs[0]
        ref_sq += float(t_star.pow(2).sum())
        spread_max = max(spread_max, float(spread.max()))
        for i, (t, kk, den) in enumerate(outs[1:]):
            err = t - t_star
            mx[i] = max(mx[i], float(err.abs().max()))
            ab[i] += float(err.abs().sum())
            sq[i] += float(err.pow(2).sum())
            keys[i] += int(kk.sum())
            dropped[i] = max(dropped[i], float((1.0 - den / den_star).max()))
    rows = [dict(max=mx[i], mae=ab[i] / (n * dv), relf=math.sqrt(sq[i] / ref_sq), keys=keys[i] / n,
                 dropped=max(0.0, dropped[i])) for i in range(m)]
    v64 = v.to(torch.float64)
    vr = float((v64.amax(0) - v64.amin(0)).max())
    return rows, dict(logit_range=spread_max, value_range=vr, exact_reach=reach)
