"""Width distributions of random binning and the kernels they are an LSH for (paper section 5).

Random binning on one axis draws a bin width ``b ~ p`` and an offset ``c ~ U[0, b]`` and hashes
``u -> floor((u - c) / b)``. Two points at distance ``delta`` share a bin with probability
``k(delta) = E_b[max(0, 1 - |delta| / b)]``, so *any* width distribution is an LSH scheme for
its own shift-invariant kernel ``k``, and ``E[M] = k`` entrywise (on integer positions too).

* :class:`GammaWidths` (``b ~ Gamma(m, sigma)``): ``m = 2`` is ALiBi's Laplacian kernel
  ``exp(-|delta| / sigma)`` (the default everywhere); with ``x = |delta| / sigma`` the kernel
  is, in closed form, ``Q(m, x) - x Gamma(m - 1, x) / Gamma(m)`` (``Q`` the regularised upper
  incomplete gamma function): smoother than Laplacian near 0 for ``m > 2``, a cusp for ``m < 2``.
* :class:`FixedWidth` (``b = w``): the triangle kernel ``max(0, 1 - |delta| / w)``.

A distribution has ``name``, ``mean_width(sigma)``, ``draw(sigma, generator)`` (i.i.d. widths
and offsets), ``kernel(delta, sigma)`` and, for the stratified and grouped samplers of
:mod:`poslsh.sampling`, ``quantile(u, sigma)`` (the inverse CDF of the width). Both draw on the
CPU in float64 from a ``torch.Generator``; Gamma widths of integer shape are sums of ``m``
exponentials from ``m + 1`` uniforms per width (the last one places the offset), which for
``m = 2`` is exactly the stream :func:`poslsh.sample_partitions` has always drawn.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["GammaWidths", "FixedWidth", "WidthDistribution", "kernel_matrix", "kernel_by_quadrature",
           "gamma2_quantile", "gamma_quantile", "MAX_WIDTH"]

MAX_WIDTH = 1e300           # widths are clamped here (a single block for any sequence)
_TINY = torch.finfo(torch.float64).tiny
_EXACT_SUM_MAX_SHAPE = 16   # integer shapes up to this are sums of exponentials


def _as_float64(x) -> Tensor:
    return x.to(torch.float64) if isinstance(x, Tensor) else torch.as_tensor(x, dtype=torch.float64)


def _check_positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _draw_offsets(widths: Tensor, u: Tensor) -> Tuple[Tensor, Tensor]:
    # Clamp to finite widths: sigma near float64's max would overflow to inf (and a NaN
    # offset); any width beyond 1e300 is one block for every representable sequence.
    widths = widths.clamp(min=_TINY, max=MAX_WIDTH)
    return widths, u * widths


# ------------------------------------------------------------------ quantiles
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
        step = (_x_minus_log1p(x) - target) * (1.0 + x) / x.clamp_min(_TINY)
        x = torch.where((target > 0) & torch.isfinite(target), (x - step).clamp_min(0.0), x)
    return torch.where(target > 0, x, torch.zeros_like(x))


def gamma_quantile(shape: float, u: Tensor) -> Tensor:
    """The inverse CDF of Gamma(shape, 1), float64 (``scipy.special.gammaincinv``; tested to 1e-12
    relative). Shape 2 is :func:`gamma2_quantile`. Otherwise Newton's method in ``y = log x`` on the
    log of the smaller tail (``log P(shape, x) = log u`` for ``u < 1/2``, ``log Q = log(1 - u)``
    above): both are concave in ``y`` (the log of a Gamma variable has a log-concave density), so
    from the lower tail's power-law bound (left of the root) or a point right of the upper root
    the iterates converge monotonically. ``u = 0`` gives 0, ``u = 1`` infinity."""
    if shape == 2.0:
        return gamma2_quantile(u)
    a = float(shape)
    p = u.to(torch.float64).clamp(0.0, 1.0)
    upper = p >= 0.5
    log_tail = torch.log(torch.where(upper, 1.0 - p, p).clamp_min(1e-300))
    gln = math.lgamma(a)
    shape_t = torch.full_like(p, a)
    # lower: P(a, x) <= x^a / Gamma(a + 1), so this x has P <= u; upper: grow x until Q(a, x) <= 1 - u
    x = torch.exp((log_tail + math.lgamma(a + 1.0)) / a)
    hi = torch.full_like(p, max(a, 1.0))
    for _ in range(200):
        short = upper & (torch.log(torch.special.gammaincc(shape_t, hi)) > log_tail)
        if not bool(short.any()):
            break
        hi = torch.where(short, hi * 1.25, hi)
    y = torch.log(torch.where(upper, hi, x))
    for _ in range(60):
        x = torch.exp(y)
        log_t = torch.log(torch.where(upper, torch.special.gammaincc(shape_t, x),
                                        torch.special.gammainc(shape_t, x)))
        slope = torch.exp(a * y - x - gln - log_t)                 # x f(x) / tail: d log tail / d log x
        step = (log_t - log_tail) / torch.where(upper, -slope, slope)
        y = torch.where(torch.isfinite(step), y - step, y)
    x = torch.exp(y)
    return torch.where(p <= 0, torch.zeros_like(x), torch.where(p >= 1, torch.full_like(x, math.inf), x))


# --------------------------------------------------------------- distributions
@dataclass(frozen=True)
class GammaWidths:
    """Bin widths ``b ~ Gamma(shape=m, scale=sigma)``; ``m = 2`` (default) is ALiBi's kernel."""

    shape: float = 2.0    # m > 0; the kernel's bandwidth is the scale sigma given per head/axis

    def __post_init__(self):
        object.__setattr__(self, "shape", _check_positive("GammaWidths.shape", self.shape))

    @property
    def name(self) -> str:
        return f"gamma({self.shape:g})"

    def mean_width(self, sigma) -> Tensor:
        """``E[b] = m sigma``."""
        return self.shape * _as_float64(sigma)

    def draw(self, sigma: Tensor, generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
        """Widths and offsets (float64, CPU, each of ``sigma``'s shape) for scales ``sigma``."""
        sig = _as_float64(sigma).cpu()
        m = self.shape
        if float(m).is_integer() and m <= _EXACT_SUM_MAX_SHAPE:
            u = torch.rand(int(m) + 1, *sig.shape, dtype=torch.float64, generator=generator)
            # Gamma(m, sigma) = sigma * (E_1 + ... + E_m), E ~ Exp(1); 1 - U avoids log(0).
            total = torch.log1p(-u[0])
            for i in range(1, int(m)):
                total = total + torch.log1p(-u[i])
            return _draw_offsets(-sig * total, u[int(m)])
        g = _standard_gamma(m, sig.numel(), generator).view(sig.shape)
        return _draw_offsets(sig * g, torch.rand(sig.shape, dtype=torch.float64, generator=generator))

    def quantile(self, u: Tensor, sigma) -> Tensor:
        """The width at CDF level ``u`` (float64, broadcast over ``u`` and ``sigma``): ``sigma F^-1(u)``."""
        return _as_float64(sigma) * gamma_quantile(self.shape, u)

    def kernel(self, delta, sigma) -> Tensor:
        """``k(delta) = P[two points at distance delta share a bin]``, float64, broadcast
        over ``delta`` and ``sigma`` (closed form through scipy's incomplete gamma functions)."""
        import numpy as np
        from scipy import special

        x = np.asarray((_as_float64(delta).abs() / _as_float64(sigma)).numpy(), dtype=np.float64)
        m = self.shape
        q_m = special.gammaincc(m, x)
        if m > 1:      # x Gamma(m-1, x) / Gamma(m) = x Q(m-1, x) / (m-1)
            tail = x * special.gammaincc(m - 1, x) / (m - 1)
        elif m == 1:   # Gamma(0, x) = E_1(x); x E_1(x) -> 0 as x -> 0
            tail = np.where(x > 0, x * special.exp1(np.where(x > 0, x, 1.0)), 0.0)
        else:          # Gamma(m-1, x) = (Gamma(m, x) - x^(m-1) e^-x) / (m-1) for 0 < m < 1
            pow_exp = np.where(x > 0, np.exp(m * np.log(np.where(x > 0, x, 1.0)) - x), 0.0)
            tail = (x * q_m - pow_exp / special.gamma(m)) / (m - 1)
        return torch.as_tensor(q_m - tail, dtype=torch.float64).clamp(0.0, 1.0)


def _standard_gamma(m: float, count: int, generator: Optional[torch.Generator]) -> Tensor:
    """``count`` draws of Gamma(m, 1) by Marsaglia and Tsang's rejection method (float64, CPU),
    from ``generator`` only; shapes below 1 use ``Gamma(m) = Gamma(m + 1) U^(1/m)``."""
    a = m + 1.0 if m < 1 else m
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(count, dtype=torch.float64)
    todo = torch.arange(count)
    while todo.numel():
        x = torch.randn(todo.numel(), dtype=torch.float64, generator=generator)
        u = torch.rand(todo.numel(), dtype=torch.float64, generator=generator)
        v = (1.0 + c * x) ** 3
        ok = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp_min(_TINY)))
        out[todo[ok]] = d * v[ok]
        todo = todo[~ok]
    if m < 1:
        out = out * torch.rand(count, dtype=torch.float64, generator=generator).pow(1.0 / m)
    return out


@dataclass(frozen=True)
class FixedWidth:
    """Constant bin width ``b = width`` (random offset): the triangle kernel ``max(0, 1 - |delta|/width)``.
    The per-head ``sigma`` multiplies ``width`` (``sigma = 1``: exactly ``width``)."""

    width: float = 1.0    # bin width in units of sigma

    def __post_init__(self):
        object.__setattr__(self, "width", _check_positive("FixedWidth.width", self.width))

    @property
    def name(self) -> str:
        return f"fixed({self.width:g})"

    def mean_width(self, sigma) -> Tensor:
        return self.width * _as_float64(sigma)

    def draw(self, sigma: Tensor, generator: Optional[torch.Generator]) -> Tuple[Tensor, Tensor]:
        sig = _as_float64(sigma).cpu()
        u = torch.rand(sig.shape, dtype=torch.float64, generator=generator)
        return _draw_offsets(self.width * sig, u)

    def quantile(self, u: Tensor, sigma) -> Tensor:
        """Every level has the one width ``width * sigma`` (stratifying it changes nothing;
        the grouped sampler's shifted grids still spread the offsets evenly)."""
        return self.width * _as_float64(sigma) * torch.ones_like(_as_float64(u))

    def kernel(self, delta, sigma) -> Tensor:
        return (1.0 - _as_float64(delta).abs() / (self.width * _as_float64(sigma))).clamp(min=0.0)


WidthDistribution = Union[GammaWidths, FixedWidth]


def kernel_matrix(distribution: WidthDistribution, delta: Tensor, sigma: Tensor) -> Tensor:
    """``k(delta; sigma_h)`` for every head: float64 ``[H, *delta.shape]`` from distances ``delta``
    (float64) and per-head bandwidths ``sigma [H]``, on ``delta``'s device (dense: references, theory)."""
    return torch.stack([distribution.kernel(delta.cpu(), float(sg)) for sg in sigma.tolist()]).to(delta.device)


def kernel_by_quadrature(distribution: GammaWidths, delta: float, sigma: float) -> float:
    """``E_b[max(0, 1 - delta/b)]`` by numerical quadrature of the Gamma density (an
    independent check of :meth:`GammaWidths.kernel`; scalar ``delta >= 0``)."""
    from scipy import integrate, stats

    delta = abs(float(delta))
    density = stats.gamma(distribution.shape, scale=float(sigma)).pdf
    if delta == 0:
        return 1.0
    f = lambda b: (1.0 - delta / b) * density(b)  # noqa: E731
    # A finite piece holding the density's bulk, then the tail: quad on [delta, inf) alone
    # is only accurate to ~1e-8 here.
    mid = delta + (distribution.shape + 40.0) * float(sigma)
    opts = dict(epsabs=1e-14, epsrel=1e-12, limit=400)
    return float(integrate.quad(f, delta, mid, **opts)[0] + integrate.quad(f, mid, math.inf, **opts)[0])
