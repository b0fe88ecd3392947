"""Positional LSH in ``D`` dimensions (paper section 5): random *boxes* over integer coordinates.

A token has integer coordinates ``x in Z^D`` (an image patch: ``(row, col)``). One sample
of one head draws a random-binning hash per axis, independently: width
``b_a ~ Gamma(2, sigma_a)`` (or another :mod:`poslsh.kernels` width distribution) and offset
``c_a ~ U[0, b_a]``. Two tokens share a block iff they share a bin on *every* axis, so a
block is an axis-aligned box and

    ``E[M_xy] = prod_a k(|x_a - y_a|; sigma_a) = exp(-||x - y||_1 / sigma)``  (Gamma(2), isotropic)

exactly: the 2-D ALiBi ``L**`` of the paper. Per axis the geometry is the 1-D one of
:mod:`poslsh.partitions` (``hash_positions``, ``bin_start``, ``block_labels``, ``block_bounds``):
one definition of where bins start and end, whatever the dimension.

Drawing runs on the CPU in float64 (a seed gives the same boxes on every device). With
``D = 1`` and the default widths, :func:`sample_partitions_nd` draws exactly the partitions of
:func:`poslsh.sample_partitions` for the same seed.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .kernels import GammaWidths, WidthDistribution
from .partitions import Partitions, _validate_seed, block_bounds, block_labels

__all__ = ["PartitionsND", "sample_partitions_nd", "grid_coords", "check_coords", "check_grid", "expected_mask"]


# ---------------------------------------------------------------- coordinates
def check_grid(grid) -> Tuple[int, int]:
    """``(height, width)`` of a token grid, both positive ints (raises naming ``grid``)."""
    if not isinstance(grid, (tuple, list)) or len(grid) != 2 or any(
            isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1 for g in grid):
        raise ValueError(f"grid must be (height, width) with two ints >= 1 (tokens per column and per row), "
                         f"got {grid!r}")
    return int(grid[0]), int(grid[1])


def grid_coords(height: int, width: int, *, device=None) -> Tensor:
    """Coordinates ``(row, col)`` of an ``height x width`` grid in raster order, int64 ``[n, 2]``
    (token ``i`` sits at ``(i // width, i % width)``)."""
    h, w = check_grid((height, width))
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    return torch.stack([rows, cols], 1)


def check_coords(coords, dims: Optional[int] = None) -> Tensor:
    """Validate token coordinates: a tensor ``[n, D]`` (``n >= 1``) of integers ``>= 0`` (an
    integer dtype, or floats holding integers). Returns them as int64. The kernel depends on
    differences only, so shift negative coordinates to start at 0."""
    if not isinstance(coords, Tensor):
        raise TypeError(f"coords must be a torch.Tensor of shape [n, D], got {type(coords).__name__}")
    if coords.dim() != 2 or coords.shape[0] < 1 or coords.shape[1] < 1:
        raise ValueError(f"coords must have shape [n, D] with n >= 1 tokens and D >= 1 axes, got {tuple(coords.shape)}")
    if dims is not None and coords.shape[1] != dims:
        raise ValueError(f"coords have D={coords.shape[1]} axes but the partitions have {dims}: "
                         f"pass coordinates of shape [n, {dims}]")
    if coords.dtype == torch.bool or coords.is_complex():
        raise TypeError(f"coords must hold integers, got dtype {coords.dtype}")
    if coords.dtype.is_floating_point:
        if not bool(torch.isfinite(coords).all()) or not bool((coords == coords.round()).all()):
            raise ValueError("coords must be integers (got non-integral or non-finite floats): round them or "
                             "pass an integer tensor")
    coords = coords.to(torch.int64)
    if bool((coords < 0).any()):
        raise ValueError(f"coords must be >= 0 (got minimum {int(coords.min())}): subtract coords.min(0) first, "
                         "the kernel depends on differences only")
    return coords


def _validate_sigma_nd(sigma, dims: Optional[int]) -> Tensor:
    """Per-head sigma ``[H]`` (same on every axis) or per-axis ``[H, D]`` -> float64 ``[H, D]``."""
    if isinstance(sigma, numbers.Real) and not isinstance(sigma, bool):
        sigma = torch.tensor([float(sigma)], dtype=torch.float64)
    elif isinstance(sigma, (list, tuple)):
        try:
            sigma = torch.as_tensor(sigma, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"sigma must be numbers, [H] or [H][D] nested lists, or a tensor: {e}") from None
    elif not isinstance(sigma, Tensor):
        raise TypeError(f"sigma must be a tensor [H] or [H, D], a number or a list, got {type(sigma).__name__}")
    sigma = sigma.detach().to(torch.float64)
    if sigma.dim() == 0:
        sigma = sigma.reshape(1)
    if sigma.dim() == 1:
        sigma = sigma[:, None].expand(-1, 2 if dims is None else dims).contiguous()
    elif sigma.dim() != 2:
        raise ValueError(f"sigma must be [H] (one bandwidth per head) or [H, D] (per head and axis), "
                         f"got shape {tuple(sigma.shape)}")
    elif dims is not None and sigma.shape[1] != dims:
        raise ValueError(f"sigma has {sigma.shape[1]} per-axis bandwidths per head but dims={dims}: pass sigma "
                         f"of shape [H] or [H, {dims}]")
    if sigma.shape[0] < 1 or sigma.shape[1] < 1:
        raise ValueError(f"sigma needs at least one head and one axis, got shape {tuple(sigma.shape)}")
    if not bool((torch.isfinite(sigma) & (sigma > 0)).all()):
        raise ValueError(f"every sigma must be finite and > 0, got {sigma.tolist()}")
    return sigma


# ----------------------------------------------------------------- partitions
@dataclass(frozen=True)
class PartitionsND:
    """``s`` random box partitions per head over ``D``-dimensional integer coordinates.

    Attributes:
        widths: ``[H, s, D]`` float64 bin widths per head, sample and axis (``> 0``).
        offsets: ``[H, s, D]`` float64 bin offsets (``0 <= c <= b``).
        sigma: ``[H, D]`` float64 bandwidths they were drawn for, or ``None`` (fixed boxes).
        distribution: the width distribution (``E[M]`` is its kernel), ``None`` for fixed boxes.
    """

    widths: Tensor
    offsets: Tensor
    sigma: Optional[Tensor] = None
    distribution: Optional[WidthDistribution] = field(default=None)

    def __post_init__(self):
        w, c = self.widths, self.offsets
        if not (isinstance(w, Tensor) and isinstance(c, Tensor)):
            raise TypeError("widths and offsets must be tensors")
        if w.dim() != 3 or w.shape != c.shape or min(w.shape) < 1:
            raise ValueError(f"widths and offsets must both be [H, s, D] with every size >= 1; got "
                             f"{tuple(w.shape)} and {tuple(c.shape)}")
        object.__setattr__(self, "widths", w.to(torch.float64))
        object.__setattr__(self, "offsets", c.to(torch.float64))
        if not bool((self.widths > 0).all()) or not bool(torch.isfinite(self.offsets).all()):
            raise ValueError("partition widths must be > 0 and offsets finite")
        if self.sigma is not None:
            sig = _validate_sigma_nd(self.sigma, w.shape[2]).to(w.device)
            if sig.shape[0] != w.shape[0]:
                raise ValueError(f"sigma has {sig.shape[0]} heads but widths have {w.shape[0]}")
            object.__setattr__(self, "sigma", sig)

    # ------------------------------------------------------------------ basics
    @property
    def num_heads(self) -> int:
        return self.widths.shape[0]

    @property
    def num_samples(self) -> int:
        return self.widths.shape[1]

    @property
    def dims(self) -> int:
        return self.widths.shape[2]

    @property
    def device(self) -> torch.device:
        return self.widths.device

    def to(self, device) -> "PartitionsND":
        """The same partitions with their tensors on ``device`` (still float64)."""
        if self.widths.device == torch.device(device):
            return self
        sigma = None if self.sigma is None else self.sigma.to(device)
        return PartitionsND(self.widths.to(device), self.offsets.to(device), sigma, self.distribution)

    def axis(self, a: int) -> Partitions:
        """The 1-D partitions of axis ``a`` (``[H, s]`` widths/offsets): its bins are the boxes' sides."""
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < self.dims:
            raise ValueError(f"axis must be an int in [0, {self.dims}), got {a!r}")
        sigma = None if self.sigma is None else self.sigma[:, a].contiguous()
        return Partitions(self.widths[:, :, a].contiguous(), self.offsets[:, :, a].contiguous(), sigma)

    def __repr__(self) -> str:
        kind = "fixed" if self.sigma is None else f"sampled, {self.distribution.name}"
        return (f"PartitionsND({kind}, heads={self.num_heads}, samples={self.num_samples}, dims={self.dims}, "
                f"device={self.device})")

    @classmethod
    def fixed_boxes(cls, num_heads: int, box: Sequence[int], *, device=None) -> "PartitionsND":
        """Deterministic boxes (the fixed-blocks baseline in ``D`` dimensions): one partition per
        head into boxes of ``box[a]`` positions along axis ``a``, starting at coordinate 0."""
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if not isinstance(box, (tuple, list)) or not box or any(
                isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in box):
            raise ValueError(f"box must be a tuple of ints >= 1 (one side per axis), got {box!r}")
        w = torch.tensor([float(b) for b in box], dtype=torch.float64, device=device)
        widths = w.expand(num_heads, 1, len(box)).contiguous()
        return cls(widths, torch.zeros_like(widths))

    # ---------------------------------------------------------------- geometry
    def labels(self, coords: Tensor) -> Tensor:
        """Per-axis bin labels of every token, int64 ``[H, s, n, D]`` (the 1-D
        :func:`~poslsh.partitions.block_labels` of each axis): equal on every axis <=> same box."""
        x = check_coords(coords, self.dims).to(self.device, torch.float64)
        return torch.stack([block_labels(self.widths[..., a], self.offsets[..., a], x[:, a])
                            for a in range(self.dims)], -1).to(torch.int64)

    def block_ids(self, coords: Tensor) -> Tensor:
        """Box id of every token, int64 ``[H, s, n]``: two tokens share a box in sample ``t`` iff
        their ids are equal (the per-axis labels in mixed radix)."""
        lab = self.labels(coords)
        lab = lab - lab.amin(2, keepdim=True)
        ids = torch.zeros(lab.shape[:3], dtype=torch.int64, device=lab.device)
        for a in range(self.dims):
            radix = lab[..., a].amax(2, keepdim=True) + 1
            ids = ids * radix + lab[..., a]
        return ids

    def box_bounds(self, coords: Tensor, extent: Optional[Sequence[int]] = None) -> Tuple[Tensor, Tensor]:
        """The box of every token: ``lo, hi`` (int64 ``[H, s, n, D]``), the box is
        ``prod_a [lo_a, hi_a)`` clipped to ``[0, extent_a)`` (default: the coordinates' maximum + 1),
        from the 1-D :func:`~poslsh.partitions.block_bounds` of each axis."""
        x = check_coords(coords, self.dims).to(self.device)
        ext = (x.amax(0) + 1).tolist() if extent is None else list(extent)
        if len(ext) != self.dims or any(int(e) <= int(m) for e, m in zip(ext, x.amax(0).tolist())):
            raise ValueError(f"extent must give {self.dims} sizes above every coordinate, got {extent!r}")
        lo, hi = zip(*(block_bounds(self.widths[..., a], self.offsets[..., a], int(ext[a]), x[:, a])
                       for a in range(self.dims)))
        return torch.stack(lo, -1), torch.stack(hi, -1)

    def max_box_size(self, coords: Tensor) -> int:
        """The largest number of tokens in one box, over heads and samples."""
        ids = self.block_ids(coords)
        return max(int(torch.unique(row, return_counts=True)[1].max()) for row in ids.reshape(-1, ids.shape[-1]))

    def dense_count(self, coords: Tensor) -> Tensor:
        """``count_xy`` = number of samples in which tokens ``x`` and ``y`` share a box (all axes at
        once, per sample), int32 ``[H, n, n]``. Dense: references, theory and plots only."""
        ids = self.block_ids(coords)
        H, s, n = ids.shape
        count = torch.zeros(H, n, n, dtype=torch.int32, device=ids.device)
        for t in range(s):
            count += (ids[:, t, :, None] == ids[:, t, None, :]).to(torch.int32)
        return count

    def dense_mean(self, coords: Tensor) -> Tensor:
        """The empirical mean mask ``M~ = (1/s) sum_t M_t``, float64 ``[H, n, n]`` (dense)."""
        return self.dense_count(coords).to(torch.float64) / self.num_samples

    def expected_mean(self, coords: Tensor) -> Tensor:
        """``E[M]``, float64 ``[H, n, n]``: the product over axes of the width distribution's kernel
        (``exp(-||x - y||_1 / sigma)`` for Gamma(2)). Needs sampled partitions."""
        if self.sigma is None or self.distribution is None:
            raise ValueError("fixed boxes are deterministic: E[M] = M, use dense_mean")
        return expected_mask(coords, self.sigma, self.distribution)


def expected_mask(coords: Tensor, sigma, distribution: Optional[WidthDistribution] = None) -> Tensor:
    """``L_xy = prod_a k(|x_a - y_a|; sigma_{h,a})`` for coordinates ``[n, D]`` and sigma ``[H]`` or
    ``[H, D]``: float64 ``[H, n, n]`` (dense). Gamma(2) widths (default) give 2-D ALiBi's ``L**``."""
    x = check_coords(coords)
    dist = GammaWidths() if distribution is None else distribution
    sig = _validate_sigma_nd(sigma, x.shape[1]).to(x.device)
    out = None
    for a in range(x.shape[1]):
        delta = (x[:, None, a] - x[None, :, a]).abs().to(torch.float64)            # [n, n]
        k = torch.stack([dist.kernel(delta.cpu(), float(sg)) for sg in sig[:, a].tolist()]).to(x.device)
        out = k if out is None else out * k
    return out


def sample_partitions_nd(sigma, num_samples: int, *, dims: Optional[int] = None,
                         distribution: Optional[WidthDistribution] = None,
                         generator: Optional[torch.Generator] = None, seed: Optional[int] = None) -> PartitionsND:
    """Draw ``num_samples`` random box partitions per head.

    Args:
        sigma: bandwidths ``[H]`` (one per head, all axes: 2-D ALiBi with slope ``1 / sigma``) or
            ``[H, D]`` (per head and axis); finite, ``> 0``. A number is one head.
        num_samples: ``s >= 1`` partitions per head.
        dims: number of axes ``D`` (default: ``sigma``'s second size, else 2: images).
        distribution: bin-width distribution (default :class:`~poslsh.kernels.GammaWidths` ``(2)``:
            ALiBi's Laplacian kernel); see :mod:`poslsh.kernels`.
        generator: a CPU ``torch.Generator`` (exclusive with ``seed``); seed: an int. Derive seeds
            with :func:`poslsh.seeding.stable_seed`. With neither, the global CPU RNG is used.

    Returns:
        :class:`PartitionsND` with widths/offsets ``[H, s, D]`` (float64) on ``sigma``'s device,
        drawn on the CPU: the same seed gives the same boxes on every device.
    """
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"dims must be an int >= 1 (number of coordinate axes), got {dims!r}")
    dev = sigma.device if isinstance(sigma, Tensor) else torch.device("cpu")
    sig = _validate_sigma_nd(sigma, dims).cpu()
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("generator must be a CPU torch.Generator (sampling runs on the CPU for reproducibility)")
    if seed is not None:
        generator = torch.Generator().manual_seed(_validate_seed(seed))
    dist = GammaWidths() if distribution is None else distribution
    if not hasattr(dist, "draw") or not hasattr(dist, "kernel"):
        raise TypeError(f"distribution must be a poslsh.kernels width distribution, got {type(dist).__name__}")
    H, D = sig.shape
    scale = sig[:, None, :].expand(H, num_samples, D)
    widths, offsets = dist.draw(scale, generator)
    return PartitionsND(widths.to(dev), offsets.to(dev), sig.to(dev), dist)
