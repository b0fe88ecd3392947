"""Error records of one partition draw: the rows ``poslsh convergence`` and
``poslsh audit`` aggregate.

A *draw* is one :class:`~poslsh.partitions.Partitions` of ``s_max`` partitions
per head; its nested prefixes are the samples of size ``s`` (see
:mod:`poslsh_paper.analysis.mask_counts`). :func:`mask_records` measures the masks
alone, :func:`input_records` also the attention output on one input's real
Q/K/V, and :func:`cross_check` compares the fast routes with the library.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from poslsh import theory
from poslsh.alibi import alibi_sigmas
from poslsh.partitions import Partitions, sample_partitions
from poslsh.sampling import parse_sampler
from poslsh.seeding import stable_seed
from poslsh_paper.analysis.mask_counts import (approx_output, causal_weights, dense_from_band, exact_output, mask_max_error,
                          mask_spectral_error, nested_counts)
from poslsh_paper.analysis.qkv import LayerQKV

__all__ = ["default_heads", "equivalent_samples", "sampler_draws", "mask_records", "input_records", "cross_check",
           "fit_slope", "FIT_MIN_S", "ROW_FIELDS"]

# Slopes are fitted on s >= FIT_MIN_S: s >> log n, the asymptotic 1/sqrt(s) regime.
FIT_MIN_S = 100

# The columns of an :func:`input_records` row (``rows.csv`` of ``poslsh convergence``).
ROW_FIELDS = ["input", "source", "sampler", "layer", "head", "kv_head", "sigma", "s", "groups", "n", "spectral", "max",
              "b_max", "t_err", "beta_star", "p_2inf", "v_max"]


def default_heads(num_heads: int, k: int = 4) -> List[int]:
    """``k`` query heads spanning small to large ALiBi ``sigma`` for ``num_heads``
    heads: the heads at evenly spaced ranks of ``sigma`` (smallest and largest
    included), returned in increasing ``sigma``. For 9 heads: ``[8, 2, 4, 7]``,
    ``sigma = 1.41, 8, 32, 256``."""
    sig = alibi_sigmas(num_heads)
    order = torch.argsort(sig).tolist()
    k = min(k, num_heads)
    ranks = sorted({int(round(x)) for x in np.linspace(0, num_heads - 1, k)})
    return [order[r] for r in ranks]


def fit_slope(s: Sequence[float], y: Sequence[float], min_s: float = 1) -> Optional[float]:
    """Least-squares slope of ``log y`` against ``log s`` over ``s >= min_s``
    (``None`` with fewer than two usable points)."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(s, y) if a >= min_s and b > 0]
    if len(pts) < 2:
        return None
    x, yy = np.array(pts).T
    return float(np.polyfit(x, yy, 1)[0])


def equivalent_samples(ref_s: Sequence[float], ref_err: Sequence[float], err: float) -> Tuple[float, bool]:
    """The sample size at which a reference error curve (mean error of i.i.d. samples at
    the sizes ``ref_s``) reaches ``err``: log-log linear interpolation between the first
    two measured points that bracket it; outside the measured range, extrapolated from
    the nearest end with the asymptotic slope ``-1/2`` (then the flag is True)."""
    pts = sorted((float(s), float(e)) for s, e in zip(ref_s, ref_err) if e > 0)
    if not pts or not err > 0:
        return float("nan"), True
    for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
        if e0 >= err >= e1 and e0 > e1:
            t = math.log(e0 / err) / math.log(e0 / e1)
            return math.exp(math.log(s0) + t * math.log(s1 / s0)), False
    s_end, e_end = pts[-1] if err < pts[-1][1] else pts[0]
    return s_end * (e_end / err) ** 2, True


def sampler_draws(sigmas: Sequence[float], samples: Sequence[int], sampler: str,
                  seed_parts: tuple) -> List[Tuple[List[int], Partitions]]:
    """The partition draws that measure ``sampler`` at every ``s`` in ``samples``, as
    ``(sizes, partitions)`` pairs: ``"iid"`` is one draw of ``max(samples)`` whose nested
    prefixes are the samples (seeded by ``stable_seed(*seed_parts)``, as always); a
    correlated sampler has no nested prefixes (a prefix of a grouped draw is not a
    grouped draw), so it gets one independent draw per ``s``, seeded by
    ``stable_seed(*seed_parts, sampler, s)``."""
    sig = torch.tensor([float(x) for x in sigmas], dtype=torch.float64)
    samples = sorted(int(s) for s in samples)
    method, k = parse_sampler(sampler)
    if method == "iid":
        return [(samples, sample_partitions(sig, samples[-1], seed=stable_seed(*seed_parts)))]
    return [([s], sample_partitions(sig, s, seed=stable_seed(*seed_parts, sampler, s), sampler=method,
                                    group_size=k)) for s in samples]


def _groups(partitions: Partitions, s: int) -> float:
    """The independent groups of the sample of size ``s`` (its bound's ``G``)."""
    if partitions.groups is None:
        return float(s)
    if s != partitions.num_samples:
        raise ValueError(f"correlated partitions have no nested prefixes: got s={s} of {partitions.num_samples}; "
                         "draw one per s (sampler_draws)")
    return partitions.effective_groups()


def mask_records(partitions: Partitions, n: int, samples: Sequence[int], *, spectral: bool = True,
                 trial: int = 0, sampler: str = "iid") -> List[dict]:
    """``||L* - M~||`` (if ``spectral``), ``||L* - M~||_max`` and ``b_max`` for every
    head of ``partitions`` (``[H, s_max]``) and every nested sample size (correlated
    partitions: their own size only): one dict per (head, s) with keys ``trial,
    sampler, head_index, sigma, s, groups, n, spectral, max, b_max``."""
    rows = []
    for hi in range(partitions.num_heads):
        sigma = float(partitions.sigma[hi])
        for snap in nested_counts(partitions.widths[hi], partitions.offsets[hi], n, samples):
            rows.append(dict(trial=trial, sampler=sampler, head_index=hi, sigma=sigma, s=snap.s,
                             groups=_groups(partitions, snap.s), n=n,
                             spectral=mask_spectral_error(snap, sigma) if spectral else float("nan"),
                             max=mask_max_error(snap, sigma), b_max=snap.width))
    return rows


def input_records(qkv: Dict[int, LayerQKV], heads: Sequence[int], sigmas: Sequence[float],
                  samples: Sequence[int], partitions: Partitions, *, index: int = 0, source: str = "",
                  progress=None, spectral: bool = True, cache: Optional[dict] = None,
                  sampler: str = "iid") -> List[dict]:
    """All measurements for one input.

    Args:
        qkv: ``{layer: LayerQKV}`` of this input (``q [Hq, n, d]``, ``k / v [Hkv, n, d]``).
        heads: query heads; ``sigmas`` their ALiBi bandwidths.
        samples: sample sizes (nested prefixes of ``partitions``; correlated
            partitions: their own size only, see :func:`sampler_draws`).
        partitions: ``[len(heads), max(samples)]`` partitions (this input's draw).
        progress: called with ``1`` after each head.
        spectral: also compute ``||L* - M~||`` (the costliest mask norm).
        cache: a dict kept across calls on the same ``qkv`` (several draws): the
            attention weights and exact outputs are then computed once.
        sampler: the name recorded in each row (how ``partitions`` were drawn).
    Returns:
        one dict per (layer, head, s) with the keys :data:`ROW_FIELDS`.
    """
    samples = sorted(int(s) for s in samples)
    layers = sorted(qkv)
    n = qkv[layers[0]].q.shape[1]
    rows: List[dict] = []
    for hi, (h, sigma) in enumerate(zip(heads, sigmas)):
        sigma = float(sigma)
        weights, exact = {}, {}
        for layer in layers:
            if cache is not None and (layer, h) in cache:
                weights[layer], exact[layer] = cache[(layer, h)]
                continue
            q, k, v = qkv[layer].head(h)
            weights[layer] = causal_weights(q, k)
            exact[layer] = exact_output(weights[layer], v, sigma)
            if cache is not None:
                cache[(layer, h)] = (weights[layer], exact[layer])
        # the mask norms depend on (sigma, s, draw) only: computed once, shared by the layers
        for snap in nested_counts(partitions.widths[hi], partitions.offsets[hi], n, samples):
            mx = mask_max_error(snap, sigma)
            sp_err = mask_spectral_error(snap, sigma) if spectral else float("nan")
            lower = dense_from_band(snap.band, snap.width)
            for layer in layers:
                _, _, v = qkv[layer].head(h)
                tt = approx_output(weights[layer], v, lower, snap.width)
                ex = exact[layer]
                rows.append(dict(
                    input=index, source=source, sampler=sampler, layer=layer, head=h, kv_head=qkv[layer].kv_head(h),
                    sigma=sigma, s=snap.s, groups=_groups(partitions, snap.s), n=n, spectral=sp_err, max=mx,
                    b_max=snap.width,
                    t_err=float((ex.t - tt).abs().max()), beta_star=ex.beta_star, p_2inf=ex.p_2inf,
                    v_max=ex.v_max))
            del lower
        del weights, exact
        if progress is not None:
            progress(1)
    return rows


def cross_check(qkv: Dict[int, LayerQKV], heads: Sequence[int], sigmas: Sequence[float], s: int,
                partitions: Partitions) -> dict:
    """Agreement of the fast routes with the library on one input (first layer of
    ``qkv``, first ``s`` partitions): ``T*`` vs :func:`poslsh.reference.alibi_attention_reference`, ``T~``
    vs ``poslsh_attention(backend="torch")``, and the mask norms vs
    :mod:`poslsh.theory`. Returns the largest differences (the spectral one relative)."""
    from poslsh.attention import poslsh_attention
    from poslsh.reference import alibi_attention_reference

    layer = sorted(qkv)[0]
    L = qkv[layer]
    n = L.q.shape[1]
    prefix = Partitions(partitions.widths[:, :s], partitions.offsets[:, :s], partitions.sigma)
    lib_max = theory.max_norm_error(prefix, n)
    lib_spec = theory.spectral_norm_error(prefix, n, tol=1e-8)
    d_exact = d_approx = d_max = d_spec = 0.0
    for hi, (h, sigma) in enumerate(zip(heads, sigmas)):
        q, k, v = (x.double()[None, None] for x in L.head(h))
        one = Partitions(prefix.widths[hi:hi + 1], prefix.offsets[hi:hi + 1], prefix.sigma[hi:hi + 1])
        ref_exact = alibi_attention_reference(q, k, v, torch.tensor([1.0 / float(sigma)], dtype=torch.float64),
                                              causal=True)[0, 0]
        ref_approx = poslsh_attention(q, k, v, one, causal=True, backend="torch")[0, 0]
        snap = next(nested_counts(partitions.widths[hi], partitions.offsets[hi], n, [s]))
        a = causal_weights(*L.head(h)[:2])
        ex = exact_output(a, L.head(h)[2], float(sigma))
        tt = approx_output(a, L.head(h)[2], dense_from_band(snap.band, snap.width), snap.width)
        d_exact = max(d_exact, float((ex.t - ref_exact).abs().max()))
        d_approx = max(d_approx, float((tt - ref_approx).abs().max()))
        d_max = max(d_max, abs(mask_max_error(snap, float(sigma)) - float(lib_max[hi])))
        d_spec = max(d_spec, abs(mask_spectral_error(snap, float(sigma)) - float(lib_spec[hi]))
                     / float(lib_spec[hi]))
    return dict(layer=layer, s=s, exact_vs_alibi_attention=d_exact, approx_vs_poslsh_attention_torch=d_approx,
                max_norm_vs_theory=d_max, spectral_rel_vs_theory=d_spec)
