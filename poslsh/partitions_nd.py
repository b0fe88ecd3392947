"""Positional LSH in ``D`` dimensions (paper section 5): random *boxes* over integer coordinates.

A token has integer coordinates ``x in Z^D`` (an image patch: ``(row, col)``). One sample
of one head draws a random-binning hash per axis, independently: width
``b_a ~ Gamma(2, sigma_a)`` (or another :mod:`poslsh.widths` distribution) and offset
``c_a ~ U[0, b_a]``. Two tokens share a block iff they share a bin on *every* axis, so a
block is an axis-aligned box and

    ``E[M_xy] = prod_a k(|x_a - y_a|; sigma_a) = exp(-||x - y||_1 / sigma)``  (Gamma(2), isotropic)

exactly: the 2-D ALiBi ``L**`` of the paper. A :class:`PartitionsND` *is* ``D`` 1-D
:class:`~poslsh.partitions.Partitions` of the same heads and samples, one per axis: their checks,
``to``, ``select_heads``, equality, width distribution and geometry (``block_labels``,
``block_bounds``) are the 1-D ones, axis by axis.

Drawing runs on the CPU in float64 (a seed gives the same boxes on every device). With
``D = 1`` and the default widths, :func:`sample_partitions_nd` draws exactly the partitions of
:func:`poslsh.sample_partitions` for the same seed; i.i.d. boxes draw every axis in one call
(``[H, s, D]``), the correlated samplers stratify each axis on its own.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .partitions import Partitions
from .positional import Positional
from .sampling import check_num_samples, check_sampler, check_sigma, check_widths, draw, make_generator
from .widths import WidthDistribution, kernel_matrix

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


def check_sigma_nd(sigma, dims: Optional[int]) -> Tensor:
    """Per-head sigma ``[H]`` (same on every axis) or per-axis ``[H, D]`` -> float64 ``[H, D]``
    (values checked as :func:`~poslsh.sampling.check_sigma` checks them; ``D`` defaults to 2)."""
    if isinstance(sigma, (list, tuple)):
        try:
            sigma = torch.as_tensor(sigma, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"sigma must be numbers, [H] or [H][D] nested lists, or a tensor: {e}") from None
    elif isinstance(sigma, numbers.Real) and not isinstance(sigma, bool):
        sigma = torch.tensor([float(sigma)], dtype=torch.float64)
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
    check_sigma(sigma.reshape(-1))
    return sigma


# ----------------------------------------------------------------- partitions
@dataclass(frozen=True, eq=False, init=False)
class PartitionsND(Positional):
    """``s`` random box partitions per head over ``D``-dimensional integer coordinates: one
    :class:`~poslsh.partitions.Partitions` per axis (``PartitionsND(axes)``), all with the same
    ``H`` heads, ``s`` samples and device, all sampled (``sigma`` set) or all fixed. Sample ``t``
    of head ``h`` is the box ``prod_a bin_a`` of the axes' sample ``t``.

    Derived views: ``widths``, ``offsets`` ``[H, s, D]`` float64; ``sigma`` ``[H, D]`` (or
    ``None``: fixed boxes); ``distribution`` the axes' width distribution. From ``[H, s, D]``
    tensors: :meth:`from_tensors` (the former ``PartitionsND(widths, offsets, sigma, distribution)``).
    """

    axes: Tuple[Partitions, ...]

    op = "nd"
    heads_are = "partitions were built for"
    public_name = "poslsh.PartitionsND"

    def __init__(self, axes: Sequence[Partitions], *tensor_form):
        if tensor_form or isinstance(axes, Tensor) or not isinstance(axes, (tuple, list)) or not axes or \
                not all(isinstance(a, Partitions) for a in axes):
            raise TypeError("PartitionsND(axes) takes a non-empty sequence of poslsh.Partitions (one per axis); "
                            "from [H, s, D] tensors use PartitionsND.from_tensors(widths, offsets, sigma)")
        first = axes[0]
        for a, p in enumerate(axes):
            if (p.num_heads, p.num_samples) != (first.num_heads, first.num_samples) or p.device != first.device:
                raise ValueError(f"axis {a} has {p.num_heads} heads x {p.num_samples} samples on {p.device} but axis 0 "
                                 f"has {first.num_heads} x {first.num_samples} on {first.device}: every axis needs "
                                 "the same heads, samples and device")
            if (p.sigma is None) != (first.sigma is None):
                raise ValueError("mixing sampled and fixed axes: give every axis a sigma, or none")
        object.__setattr__(self, "axes", tuple(axes))

    @classmethod
    def from_tensors(cls, widths: Tensor, offsets: Tensor, sigma=None,
                     distribution: Optional[WidthDistribution] = None) -> "PartitionsND":
        """From widths and offsets ``[H, s, D]`` and ``sigma`` ``[H]`` or ``[H, D]`` (or None: fixed boxes)."""
        if not (isinstance(widths, Tensor) and isinstance(offsets, Tensor)):
            raise TypeError("widths and offsets must be tensors")
        if widths.dim() != 3 or widths.shape != offsets.shape or min(widths.shape) < 1:
            raise ValueError(f"widths and offsets must both be [H, s, D] with every size >= 1; got "
                             f"{tuple(widths.shape)} and {tuple(offsets.shape)}")
        sig = None if sigma is None else check_sigma_nd(sigma, widths.shape[2]).to(widths.device)
        return cls(tuple(Partitions(widths[..., a], offsets[..., a], None if sig is None else sig[:, a].contiguous(),
                                    None, distribution) for a in range(widths.shape[2])))

    # ------------------------------------------------------------------ basics
    @functools.cached_property
    def widths(self) -> Tensor:
        return torch.stack([a.widths for a in self.axes], -1)

    @functools.cached_property
    def offsets(self) -> Tensor:
        return torch.stack([a.offsets for a in self.axes], -1)

    @functools.cached_property
    def sigma(self) -> Optional[Tensor]:
        return None if self.axes[0].sigma is None else torch.stack([a.sigma for a in self.axes], -1)

    @property
    def distribution(self) -> Optional[WidthDistribution]:
        """The width distribution of every axis (None: fixed boxes)."""
        dists = {a.distribution for a in self.axes}
        if len(dists) > 1:
            raise ValueError(f"the axes have different width distributions ({', '.join(sorted(d.name for d in dists))}): "
                             "read axes[a].distribution")
        return self.axes[0].distribution

    @property
    def num_heads(self) -> int:
        return self.axes[0].num_heads

    @property
    def num_samples(self) -> int:
        return self.axes[0].num_samples

    @property
    def dims(self) -> int:
        return len(self.axes)

    @property
    def device(self) -> torch.device:
        return self.axes[0].device

    def to(self, device) -> "PartitionsND":
        """The same partitions with their tensors on ``device`` (any device, ``"meta"`` too)."""
        if self.device == torch.device(device):
            return self
        return PartitionsND(tuple(a.to(device) for a in self.axes))

    def select_heads(self, heads) -> "PartitionsND":
        """The partitions of some heads (an index, slice or list) on every axis."""
        return PartitionsND(tuple(a.select_heads(heads) for a in self.axes))

    def axis(self, a: int) -> Partitions:
        """The 1-D partitions of axis ``a`` (``[H, s]`` widths/offsets): its bins are the boxes' sides."""
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < self.dims:
            raise ValueError(f"axis must be an int in [0, {self.dims}), got {a!r}")
        return self.axes[a]

    def tensors(self) -> Tuple[Tensor, Tensor]:
        """``(widths, offsets)``, float64 ``[H, s, D]`` each."""
        return self.widths, self.offsets

    def check_layout(self, seq_len: int, grid=None) -> Tuple[int, int]:
        """The op attends a 2-D token grid: ``grid = (height, width)`` with ``height * width = seq_len``
        and partitions of 2 axes; returns ``(height, width)``."""
        if self.dims != 2:
            raise ValueError(f"partitions have {self.dims} axes; 2-D attention over a grid needs 2 "
                             "(sample them with dims=2 or sigma [H, 2])")
        height, width = check_grid(grid)
        if height * width != seq_len:
            raise ValueError(f"grid {height}x{width} has {height * width} tokens but q has seqlen {seq_len}")
        return height, width

    def dense_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``log count_xy`` between token coordinates ``q_pos [P, D]`` and ``k_pos [Q, D]`` (samples in which
        they share a box on every axis; ``-inf`` for none), float64 ``[H, P, Q]``, one sample at a time."""
        lab_q, lab_k = self.labels(q_pos), self.labels(k_pos)                     # [H, s, P|Q, D]
        count = torch.zeros(self.num_heads, lab_q.shape[2], lab_k.shape[2], dtype=torch.float64, device=self.device)
        for t in range(self.num_samples):
            count += (lab_q[:, t, :, None] == lab_k[:, t, None, :]).all(-1)
        return torch.log(count)

    def __eq__(self, other) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self.axes == other.axes

    def __hash__(self) -> int:
        return hash(self.axes)

    def __repr__(self) -> str:
        dists = {a.distribution for a in self.axes}
        kind = "fixed" if self.sigma is None else "sampled, " + ", ".join(sorted(d.name for d in dists))
        if any(a.groups is not None for a in self.axes):
            kind += ", in groups per axis"
        return (f"PartitionsND({kind}, heads={self.num_heads}, samples={self.num_samples}, dims={self.dims}, "
                f"device={self.device})")

    @classmethod
    def fixed_blocks(cls, num_heads: int, block_size: Sequence[int], *, device=None) -> "PartitionsND":
        """Deterministic blocks (the fixed-blocks baseline in ``D`` dimensions, a block being a box): one
        partition per head into blocks of ``block_size[a]`` positions along axis ``a``, from coordinate 0
        (:meth:`Partitions.fixed_blocks <poslsh.partitions.Partitions.fixed_blocks>` on every axis)."""
        if not isinstance(block_size, (tuple, list)) or not block_size or any(
                isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in block_size):
            raise ValueError(f"block_size must be a tuple of ints >= 1 (one side per axis), got {block_size!r}")
        return cls(tuple(Partitions.fixed_blocks(num_heads, int(b), device=device) for b in block_size))

    # ---------------------------------------------------------------- geometry
    def labels(self, coords: Tensor) -> Tensor:
        """Per-axis bin labels of every token, int64 ``[H, s, n, D]`` (each axis's
        :meth:`Partitions.labels <poslsh.partitions.Partitions.labels>`): equal on every axis <=> same box."""
        x = check_coords(coords, self.dims)
        return torch.stack([p.labels(x[:, a]) for a, p in enumerate(self.axes)], -1)

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

    def block_bounds(self, extent: Optional[Sequence[int]], coords: Tensor) -> Tuple[Tensor, Tensor]:
        """The block (box) of every token, as :meth:`Partitions.block_bounds(n, positions)
        <poslsh.partitions.Partitions.block_bounds>` on every axis: ``lo, hi`` (int64 ``[H, s, n, D]``), the box
        ``prod_a [lo_a, hi_a)`` clipped to ``[0, extent_a)`` (``extent`` None: the coordinates' maximum + 1)."""
        if isinstance(extent, Tensor) or not isinstance(coords, Tensor):
            raise TypeError("block_bounds(extent, coords): the extent (sizes per axis, or None) comes first, then "
                            "the coordinates [n, D]")
        x = check_coords(coords, self.dims).to(self.device)
        ext = (x.amax(0) + 1).tolist() if extent is None else list(extent)
        if len(ext) != self.dims or any(int(e) <= int(m) for e, m in zip(ext, x.amax(0).tolist())):
            raise ValueError(f"extent must give {self.dims} sizes above every coordinate, got {extent!r}")
        lo, hi = zip(*(p.block_bounds(int(ext[a]), x[:, a]) for a, p in enumerate(self.axes)))
        return torch.stack(lo, -1), torch.stack(hi, -1)

    def max_block_size(self, coords: Tensor) -> int:
        """The largest number of tokens in one block (box), over heads and samples."""
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
        """``E[M]``, float64 ``[H, n, n]``: the product over axes of each axis's kernel
        (``exp(-||x - y||_1 / sigma)`` for Gamma(2)). Needs sampled partitions."""
        if self.sigma is None:
            raise ValueError("fixed boxes are deterministic: E[M] = M, use dense_mean")
        x = check_coords(coords, self.dims).to(self.device)
        out = None
        for a, p in enumerate(self.axes):
            k = kernel_matrix(p.distribution, (x[:, None, a] - x[None, :, a]).abs().to(torch.float64), p.sigma)
            out = k if out is None else out * k
        return out


def expected_mask(coords: Tensor, sigma, widths: Optional[WidthDistribution] = None) -> Tensor:
    """``L_xy = prod_a k(|x_a - y_a|; sigma_{h,a})`` for coordinates ``[n, D]`` and sigma ``[H]`` or
    ``[H, D]``: float64 ``[H, n, n]`` (dense). Gamma(2) widths (default) give 2-D ALiBi's ``L**``."""
    x = check_coords(coords)
    dist = check_widths(widths)
    sig = check_sigma_nd(sigma, x.shape[1]).to(x.device)
    out = None
    for a in range(x.shape[1]):
        k = kernel_matrix(dist, (x[:, None, a] - x[None, :, a]).abs().to(torch.float64), sig[:, a])
        out = k if out is None else out * k
    return out


def sample_partitions_nd(sigma, num_samples: int, *, dims: Optional[int] = None,
                         widths: Optional[WidthDistribution] = None, sampler: str = "iid",
                         group_size: Union[int, str, None] = None, generator: Optional[torch.Generator] = None,
                         seed: Optional[int] = None) -> PartitionsND:
    """Draw ``num_samples`` random box partitions per head: :func:`~poslsh.partitions.sample_partitions`
    on every axis.

    Args:
        sigma: bandwidths ``[H]`` (one per head, all axes: 2-D ALiBi with slope ``1 / sigma``) or
            ``[H, D]`` (per head and axis); finite, ``> 0``. A number is one head.
        num_samples: ``s >= 1`` partitions per head.
        dims: number of axes ``D`` (default: ``sigma``'s second size, else 2: images).
        widths: bin-width distribution of every axis (default :class:`~poslsh.widths.GammaWidths`
            ``(2)``: ALiBi's Laplacian kernel); see :mod:`poslsh.widths`.
        sampler, group_size: as in ``sample_partitions``; ``"iid"`` draws all axes in one
            call, ``"stratified"`` / ``"grouped"`` stratify each axis on its own (axis after axis from
            the one generator; every box still has ``E[M] = prod_a k_a`` exactly).
        generator: a CPU ``torch.Generator`` (exclusive with ``seed``); seed: an int. Derive seeds
            with :func:`poslsh.seeding.stable_seed`. With neither, the global CPU RNG is used.

    Returns:
        :class:`PartitionsND` with widths/offsets ``[H, s, D]`` (float64) on ``sigma``'s device,
        drawn on the CPU: the same seed gives the same boxes on every device.
    """
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValueError(f"dims must be an int >= 1 (number of coordinate axes), got {dims!r}")
    dev = sigma.device if isinstance(sigma, Tensor) else torch.device("cpu")
    sig = check_sigma_nd(sigma, dims).cpu()
    check_num_samples(num_samples)
    check_sampler(sampler, group_size)
    dist = check_widths(widths, sampler)
    generator = make_generator(generator, seed)
    if sampler == "iid":     # every (head, sample, axis) at once: the stream D = 1 shares with sample_partitions
        w, c, _ = draw(sig, num_samples, generator, sampler, None, dist)
        per_axis = [(w[..., a], c[..., a], None) for a in range(sig.shape[1])]
    else:
        per_axis = [draw(sig[:, a].contiguous(), num_samples, generator, sampler, group_size, dist)
                    for a in range(sig.shape[1])]
    return PartitionsND(tuple(Partitions(w.contiguous().to(dev), c.contiguous().to(dev), sig[:, a].contiguous().to(dev),
                                         None if g is None else g.to(dev), dist)
                              for a, (w, c, g) in enumerate(per_axis)))
