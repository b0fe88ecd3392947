"""The samplers behind :func:`poslsh.partitions.sample_partitions` (pure tensor draws).

Every scheme draws masks whose *marginal* law is the paper's: width
``b ~ Gamma(2, sigma)``, offset ``c | b ~ U[0, b)``, so every slot's mask has
``E[M_t] = L*`` and ``E[M~] = L*`` holds exactly. They differ in how the ``s``
masks of a head depend on each other:

* ``"iid"``: independent masks (the paper).
* ``"stratified"``: independent masks, widths from ``s`` Gamma(2, sigma) quantile
  strata of probability ``1/s`` (one width per stratum), offsets ``U[0, b)``; the
  slots are then randomly permuted. Hoeffding's argument (eq. 3) holds verbatim.
* ``"grouped"``: ``G`` independent groups of nearly equal sizes ``k_g``. Group ``g``
  draws one width from the ``g``-th quantile stratum of probability ``k_g / s``
  (inverse CDF: ``sigma * gammaincinv(2, u)``), one phase ``V_g ~ U[0, 1)``, and its
  ``k_g`` masks share that width with the evenly spaced offsets
  ``c = b frac(V_g + m / k_g)``, ``m = 0..k_g-1``: ``k_g`` shifted copies of one grid,
  whose boundaries together form the lattice ``V_g b + Z b / k_g``. The ``s`` slots
  are randomly permuted.

Why every slot is exact: a random slot lies in group ``g`` with probability
``k_g / s``, the probability of stratum ``g``; given ``g``, ``u`` is uniform on the
stratum, so ``u ~ U[0, 1)`` and ``b = F^-1(u) ~ Gamma(2, sigma)``; and
``frac(V_g + m / k_g) ~ U[0, 1)`` independently of ``u``, so ``c | b ~ U[0, b)``.
The random permutation makes this hold for every slot index, not only on average.

Group sizes: ``group_size=k`` gives ``G = max(2, ceil(s / k))`` groups (at least two:
a single group of shifted grids is worse than i.i.d. on the spectral norm);
``group_size=None`` means ``k = DEFAULT_GROUP_SIZE = 4`` (the prototype study's
compromise, confirmed by ``poslsh convergence``: ``docs/sampling.md``);
``group_size="sqrt"`` gives ``G = max(2, round(sqrt(s)))`` (the issue's rule; better on
the max norm at large ``s``, worse on the spectral norm and the output error); ``s = 1``
is one group of one mask (the i.i.d. law). Sizes differ by at most one.

This module draws the numbers (and checks a given group structure); :mod:`poslsh.partitions`
validates the arguments, wraps the result in a :class:`~poslsh.partitions.Partitions` and
owns the geometry.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["SAMPLERS", "DEFAULT_GROUP_SIZE", "parse_sampler", "check_groups", "group_sizes", "draw_iid", "draw_grouped", "gamma2_quantile",
           "lattice_points"]

SAMPLERS = ("iid", "stratified", "grouped")
DEFAULT_GROUP_SIZE = 4
TINY = torch.finfo(torch.float64).tiny
MAX_WIDTH = 1e300   # widths are clamped here (a single block for any sequence)


def parse_sampler(spec: str) -> Tuple[str, Union[int, str, None]]:
    """A sampler as the experiments name it -> ``(method, group_size)``: ``"iid"``,
    ``"stratified"``, ``"grouped"`` (``group_size=None``: groups of at most 4),
    ``"grouped-k<k>"`` or ``"grouped-sqrt"`` (``G = max(2, round(sqrt(s)))``)."""
    spec = str(spec)
    if spec in SAMPLERS:
        return spec, None
    if spec == "grouped-sqrt":
        return "grouped", "sqrt"
    method, _, k = spec.partition("-k")
    if method == "grouped" and k.isdigit() and int(k) >= 1:
        return method, int(k)
    raise ValueError(f"unknown sampler {spec!r}: use iid, stratified, grouped, grouped-k<size> (e.g. grouped-k4) "
                     "or grouped-sqrt")


def group_sizes(num_samples: int, method: str, group_size: Union[int, str, None] = None) -> List[int]:
    """The sizes ``k_g`` of the independent groups of ``num_samples`` slots (the
    i.i.d. and stratified schemes: ``s`` groups of one)."""
    s = num_samples
    if method != "grouped" or s == 1:
        return [1] * s
    k = DEFAULT_GROUP_SIZE if group_size is None else group_size
    G = max(2, round(math.sqrt(s))) if k == "sqrt" else max(2, -(-s // k))
    G = min(G, s)
    return [s // G + (g < s % G) for g in range(G)]


def _x_minus_log1p(x: Tensor) -> Tensor:
    """``x - log(1 + x)`` for ``x >= 0`` without cancellation near 0 (series below 1e-2)."""
    series = x * x * (0.5 - x * (1 / 3 - x * (0.25 - x * (0.2 - x * (1 / 6 - x / 7)))))
    return torch.where(x < 1e-2, series, x - torch.log1p(x))


def gamma2_quantile(u: Tensor) -> Tensor:
    """The inverse CDF of Gamma(2, 1), float64 (equals ``scipy.special.gammaincinv(2, u)``
    to about 1e-15 relative: tested). ``F(x) = 1 - e^-x (1 + x)``, so ``F(x) = u`` is
    ``x - log(1 + x) = -log(1 - u)``: an increasing convex equation, solved by Newton's method
    from ``sqrt(2 L)`` (left of the root), which then converges monotonically."""
    u = u.to(torch.float64)
    target = -torch.log1p(-u.clamp(0.0, 1.0))                  # L in [0, inf]
    x = torch.where(target < 1.0, torch.sqrt(2.0 * target), target + torch.log1p(target))
    for _ in range(60):
        step = (_x_minus_log1p(x) - target) * (1.0 + x) / x.clamp_min(torch.finfo(torch.float64).tiny)
        x = torch.where((target > 0) & torch.isfinite(target), (x - step).clamp_min(0.0), x)
    return torch.where(target > 0, x, torch.zeros_like(x))


def draw_iid(sig: Tensor, s: int, generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
    """``s`` independent (width, offset) pairs per head for CPU float64 ``sig [H]``."""
    H = sig.numel()
    # Gamma(2, sigma) = sigma * (E1 + E2) with E ~ Exp(1); 1 - U avoids log(0).
    u = torch.rand(3, H, s, dtype=torch.float64, generator=generator)
    widths = -sig[:, None] * (torch.log1p(-u[0]) + torch.log1p(-u[1]))
    # Clamp to finite widths: sigma near float64's max would overflow to inf (and a NaN
    # offset); any width beyond 1e300 is one block for every representable sequence.
    widths = widths.clamp(min=TINY, max=MAX_WIDTH)
    return widths, u[2] * widths


def draw_grouped(sig: Tensor, sizes: List[int], generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor, Tensor]:
    """Groups of shifted grids with stratified widths (see the module docstring):
    ``(widths, offsets, groups)``, ``[H, s]`` each (groups: int64 group id per slot,
    groups numbered by stratum, smallest widths first). ``sizes = [1] * s`` is the
    stratified scheme."""
    H, G, s = sig.numel(), len(sizes), sum(sizes)
    k = torch.tensor(sizes, dtype=torch.float64)
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(k, 0)]) / s     # stratum g = [e_g, e_g+1)
    r = torch.rand(2, H, G, dtype=torch.float64, generator=generator)
    u = (edges[:-1] + r[0] * (k / s)).clamp(max=1.0)
    widths_g = sig[:, None] * gamma2_quantile(u)
    widths_g = widths_g.clamp(min=TINY, max=MAX_WIDTH)
    group = torch.repeat_interleave(torch.arange(G), torch.tensor(sizes))                 # [s] slot -> group
    rank = torch.arange(s) - torch.repeat_interleave(torch.cumsum(torch.tensor(sizes), 0) - torch.tensor(sizes),
                                                     torch.tensor(sizes))                   # m within its group
    phase = torch.remainder(r[1][:, group] + (rank.to(torch.float64) / k[group]), 1.0)      # frac(V_g + m / k_g)
    widths = widths_g[:, group]
    offsets = phase * widths
    perm = torch.argsort(torch.rand(H, s, dtype=torch.float64, generator=generator), dim=1)
    groups = group.expand(H, s)
    return widths.gather(1, perm), offsets.gather(1, perm), groups.gather(1, perm).contiguous()


def lattice_points(lo: Tensor, hi: Tensor, origin: Tensor, spacing: Tensor) -> Tensor:
    """``#{origin + z * spacing in (lo, hi]}`` over the integers ``z`` (float64 in,
    int64 out; ``lo <= hi``, elementwise with broadcasting)."""
    return (torch.floor((hi - origin) / spacing) - torch.floor((lo - origin) / spacing)).to(torch.int64)


def check_groups(widths: Tensor, offsets: Tensor, groups) -> Tensor:
    """``groups`` as int64, checked to describe groups of shifted grids (see
    :class:`~poslsh.partitions.Partitions`); one-line ``ValueError`` otherwise."""
    g = groups
    if not isinstance(g, Tensor) or g.shape != widths.shape or g.dtype.is_floating_point or g.dtype == torch.bool:
        raise ValueError(f"groups must be an integer tensor of the widths' shape {tuple(widths.shape)} "
                         f"(or None), got {type(g).__name__} {tuple(getattr(g, 'shape', ()))}")
    g = g.to(torch.int64)
    G = int(g.max()) + 1 if g.numel() else 0
    sizes = torch.zeros(g.shape[0], max(G, 1), dtype=torch.int64, device=g.device).scatter_add_(1, g.clamp(min=0),
                                                                                               torch.ones_like(g))
    if int(g.min()) < 0 or not bool((sizes > 0).all()) or not bool((sizes == sizes[:1]).all()):
        raise ValueError("groups must number the groups 0..G-1, every group present, with the same sizes in "
                         "every head")
    width = torch.zeros_like(sizes, dtype=torch.float64).scatter_(1, g, widths)
    if not bool((width.gather(1, g) == widths).all()):
        raise ValueError("the masks of a group must share one width (groups of shifted grids)")
    k = sizes.gather(1, g).to(torch.float64)
    key = torch.remainder(k * offsets / widths, 1.0)            # the group's lattice phase, per mask
    origin = torch.full_like(width, float("inf")).scatter_reduce(1, g, offsets, "amin")
    ref = torch.remainder(k * origin.gather(1, g) / widths, 1.0)
    if not bool(((torch.remainder(key - ref + 0.5, 1.0) - 0.5).abs() <= 1e-6).all()):
        raise ValueError("the offsets of a group of k masks must be one lattice c + Z b / k "
                         "(c = b frac(V + m / k)): these groups are not shifted grids")
    return g
