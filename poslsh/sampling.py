"""The samplers behind :func:`poslsh.partitions.sample_partitions` (pure tensor draws) and
the checks of their arguments.

Every scheme draws masks whose *marginal* law is the width distribution's (default
:class:`~poslsh.widths.GammaWidths` ``(2)``: ``b ~ Gamma(2, sigma)``, ALiBi) with the offset
``c | b ~ U[0, b)``, so every slot's mask has ``E[M_t] = k`` (the distribution's kernel,
``L*`` for Gamma(2)) and ``E[M~] = k`` holds exactly. They differ in how the ``s`` masks of a
head depend on each other:

* ``"iid"``: independent masks (the paper); any width distribution.
* ``"stratified"``: independent masks, widths from ``s`` quantile strata of probability
  ``1/s`` (one width per stratum), offsets ``U[0, b)``; the slots are then randomly
  permuted. Hoeffding's argument (eq. 3) holds verbatim.
* ``"grouped"``: ``G`` independent groups of nearly equal sizes ``k_g``. Group ``g``
  draws one width from the ``g``-th quantile stratum of probability ``k_g / s``
  (inverse CDF: ``sigma * gammaincinv(m, u)`` for Gamma(m)), one phase ``V_g ~ U[0, 1)``, and
  its ``k_g`` masks share that width with the evenly spaced offsets
  ``c = b frac(V_g + m / k_g)``, ``m = 0..k_g-1``: ``k_g`` shifted copies of one grid,
  whose boundaries together form the lattice ``V_g b + Z b / k_g``. The ``s`` slots
  are randomly permuted.

The correlated schemes need the distribution's quantile function (``quantile(u, sigma)``):
:class:`~poslsh.widths.GammaWidths` (any shape) and :class:`~poslsh.widths.FixedWidth` have
one; a distribution without it is refused with ``sampler="iid"`` named as the way out.

Why every slot is exact: a random slot lies in group ``g`` with probability
``k_g / s``, the probability of stratum ``g``; given ``g``, ``u`` is uniform on the
stratum, so ``u ~ U[0, 1)`` and ``b = F^-1(u)`` has the width distribution; and
``frac(V_g + m / k_g) ~ U[0, 1)`` independently of ``u``, so ``c | b ~ U[0, b)``.
The random permutation makes this hold for every slot index, not only on average.

Group sizes: ``group_size=k`` gives ``G = max(2, ceil(s / k))`` groups (at least two:
a single group of shifted grids is worse than i.i.d. on the spectral norm);
``group_size=None`` means ``k = DEFAULT_GROUP_SIZE = 4`` (the prototype study's
compromise, confirmed by ``poslsh convergence``: ``docs/sampling.md``);
``group_size="sqrt"`` gives ``G = max(2, round(sqrt(s)))`` (better on the max norm at
large ``s``, worse on the spectral norm and the output error); ``s = 1``
is one group of one mask (the i.i.d. law). Sizes differ by at most one.

This module draws the numbers, checks the samplers' arguments and a given group structure, and
counts a group's shared blocks by lattice arithmetic (:func:`group_count`);
:mod:`poslsh.partitions` wraps the draws in a :class:`~poslsh.partitions.Partitions` and owns
the geometry.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ._validation import check_has_values
from .widths import MAX_WIDTH, GammaWidths, WidthDistribution, gamma2_quantile

__all__ = ["SAMPLERS", "DEFAULT_GROUP_SIZE", "parse_sampler", "check_groups", "group_sizes", "draw", "draw_iid",
           "draw_grouped", "gamma2_quantile", "lattice_points", "group_count", "check_sigma", "check_num_samples",
           "check_sampler", "check_widths", "make_generator", "MAX_WIDTH"]

SAMPLERS = ("iid", "stratified", "grouped")
DEFAULT_GROUP_SIZE = 4
TINY = torch.finfo(torch.float64).tiny


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


def draw(sig: Tensor, num_samples: int, generator: Optional[torch.Generator], method: str = "iid",
         group_size: Union[int, str, None] = None,
         widths: Optional[WidthDistribution] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(widths, offsets, groups or None)`` of ``method`` for CPU float64 ``sig [H]``
    (``[H, s]`` each); ``"iid"`` also takes ``sig [H, D]`` (one draw per axis: ``[H, s, D]``)."""
    if method == "iid":
        return (*draw_iid(sig, num_samples, generator, widths), None)
    return draw_grouped(sig, group_sizes(num_samples, method, group_size), generator, widths)


def draw_iid(sig: Tensor, s: int, generator: Optional[torch.Generator],
             widths: Optional[WidthDistribution] = None) -> Tuple[Tensor, Tensor]:
    """``s`` independent (width, offset) pairs per head for CPU float64 ``sig [H]`` (or
    ``[H, D]``: per head and axis), ``[H, s]`` (``[H, s, D]``) each. Gamma(2) (the default)
    draws ``3 * H * s (* D)`` uniforms: ``sigma (E1 + E2)`` with ``E = -log(1 - U)``."""
    dist = GammaWidths() if widths is None else widths
    return dist.draw(sig.unsqueeze(1).expand(sig.shape[0], s, *sig.shape[1:]), generator)


def draw_grouped(sig: Tensor, sizes: List[int], generator: Optional[torch.Generator],
                 widths: Optional[WidthDistribution] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Groups of shifted grids with stratified widths (see the module docstring):
    ``(widths, offsets, groups)``, ``[H, s]`` each (groups: int64 group id per slot,
    groups numbered by stratum, smallest widths first). ``sizes = [1] * s`` is the
    stratified scheme. ``widths`` needs a ``quantile`` (default Gamma(2))."""
    dist = GammaWidths() if widths is None else widths
    H, G, s = sig.numel(), len(sizes), sum(sizes)
    k = torch.tensor(sizes, dtype=torch.float64)
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(k, 0)]) / s     # stratum g = [e_g, e_g+1)
    r = torch.rand(2, H, G, dtype=torch.float64, generator=generator)
    u = (edges[:-1] + r[0] * (k / s)).clamp(max=1.0)
    widths_g = dist.quantile(u, sig[:, None])
    widths_g = widths_g.clamp(min=TINY, max=MAX_WIDTH)
    group = torch.repeat_interleave(torch.arange(G), torch.tensor(sizes))                 # [s] slot -> group
    rank = torch.arange(s) - torch.repeat_interleave(torch.cumsum(torch.tensor(sizes), 0) - torch.tensor(sizes),
                                                     torch.tensor(sizes))                   # m within its group
    phase = torch.remainder(r[1][:, group] + (rank.to(torch.float64) / k[group]), 1.0)      # frac(V_g + m / k_g)
    w = widths_g[:, group]
    offsets = phase * w
    perm = torch.argsort(torch.rand(H, s, dtype=torch.float64, generator=generator), dim=1)
    groups = group.expand(H, s)
    return w.gather(1, perm), offsets.gather(1, perm), groups.gather(1, perm).contiguous()


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


def group_count(i, j, width, origin, size) -> Tensor:
    """In how many of a group's ``k = size`` masks positions ``i`` and ``j`` share a block.

    The group's masks share the width ``b`` and their bin boundaries together are the
    lattice ``origin + Z b / k`` (each point a boundary of exactly one mask, each mask's
    boundaries ``b`` apart). For ``i < j`` a mask separates them iff one of its
    boundaries lies in ``(i, j]``, and when ``j - i < b`` it has at most one there, so
    the count is ``k - #{lattice points in (i, j]}``, and ``0`` when that is negative
    (``j - i >= b``). ``O(1)`` per pair instead of ``k`` comparisons; equal to counting
    mask by mask with :func:`~poslsh.partitions.block_labels` (tested). Bins of width ``<= 1``
    hold one position each (the geometry's convention). Elementwise with broadcasting; returns
    int64 (``k`` where ``i == j``).
    """
    f64 = lambda x: torch.as_tensor(x, dtype=torch.float64)     # noqa: E731
    i, j, b, c, k = f64(i), f64(j), f64(width), f64(origin), f64(size)
    lo, hi = torch.minimum(i, j), torch.maximum(i, j)
    safe_b = torch.where(b > 1.0, b, torch.ones_like(b))         # narrow bins: answered below, never divided
    pts = lattice_points(lo, hi, c, safe_b / k)
    count = (k.to(torch.int64) - pts).clamp(min=0)
    apart = (hi - lo >= b) | ((b <= 1.0) & (hi > lo))
    return torch.where(apart, torch.zeros_like(count), count)


# ------------------------------------------------------------------ arguments
def check_sigma(sigma) -> Tensor:
    """Per-head bandwidths ``[H]`` (a tensor, a number or a list of numbers), finite and > 0."""
    if isinstance(sigma, Tensor):
        pass
    elif isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) or (
            isinstance(sigma, (list, tuple)) and all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                                     for x in sigma)):
        sigma = torch.as_tensor(sigma, dtype=torch.float64)
    else:
        raise TypeError(f"sigma must be a tensor, a number or a list of numbers (per-head bandwidths), "
                        f"got {type(sigma).__name__}")
    check_has_values(sigma, "sigma")
    if sigma.dim() == 0:
        sigma = sigma.reshape(1)
    if sigma.dim() != 1 or sigma.numel() < 1:
        raise ValueError(f"sigma must be a 1-D tensor of per-head bandwidths, got shape {tuple(sigma.shape)}")
    if not sigma.dtype.is_floating_point:
        sigma = sigma.to(torch.float64)
    bad = ~torch.isfinite(sigma) | (sigma <= 0)
    if bool(bad.any()):
        raise ValueError(f"every sigma must be finite and > 0; got {sigma.tolist()}")
    return sigma


def check_num_samples(num_samples) -> int:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    return num_samples


def make_generator(generator: Optional[torch.Generator], seed) -> Optional[torch.Generator]:
    """The CPU generator to draw from: ``generator``, a fresh one seeded with ``seed`` (an int
    ``torch.manual_seed`` accepts exactly: no silent flooring or overflow), or ``None`` (the
    global CPU RNG)."""
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("generator must be a CPU torch.Generator (sampling runs on the CPU for reproducibility)")
    if seed is None:
        return generator
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not -(2 ** 63) <= int(seed) < 2 ** 64:
        raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
    return torch.Generator().manual_seed(int(seed))


def check_sampler(method, group_size=None, *, name: str = "sampler") -> None:
    """One-line errors for a sampler (called ``name``) or group size no sampler accepts."""
    if method not in SAMPLERS:
        raise ValueError(f"{name} must be one of {', '.join(SAMPLERS)}, got {method!r}")
    if group_size is not None and (method != "grouped" or (group_size != "sqrt" and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1))):
        raise ValueError(f"group_size must be None, an int >= 1 or 'sqrt' with {name}='grouped', got {group_size!r} "
                         f"({name}={method!r})")


def check_widths(widths, method: str = "iid") -> WidthDistribution:
    """The width distribution of a draw (``None``: Gamma(2), ALiBi), checked to serve ``method``."""
    if widths is None:
        return GammaWidths()
    if not all(callable(getattr(widths, a, None)) for a in ("draw", "kernel")) or not hasattr(widths, "name"):
        raise TypeError(f"widths must be a width distribution of poslsh.widths (GammaWidths(m), FixedWidth(w)), "
                        f"got {type(widths).__name__}")
    if method != "iid" and not callable(getattr(widths, "quantile", None)):
        raise ValueError(f"sampler={method!r} stratifies widths through their quantile function, which "
                         f"widths={widths.name} does not have: use sampler='iid'")
    return widths
