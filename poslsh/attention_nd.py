"""``poslsh_attention_2d``: positional-LSH attention over a 2-D token grid (2-D ALiBi, paper section 5)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._validation import check_heads, check_qkv, check_scale
from .ops.torch_nd import attention_2d
from .partitions_nd import PartitionsND, check_grid
from .reference_nd import poslsh_attention_nd_reference

__all__ = ["poslsh_attention_2d", "BACKENDS_2D"]

BACKENDS_2D = ("auto", "torch", "reference")


def poslsh_attention_2d(q: Tensor, k: Tensor, v: Tensor, partitions: PartitionsND, grid: Tuple[int, int], *,
                        causal: bool = False, scale: Optional[float] = None, backend: str = "auto") -> Tensor:
    """Positional-LSH approximation of 2-D ALiBi attention over an image's patch grid.

    Computes, for every query ``i`` (grid cell ``x_i``),
    ``T~_i = sum_t sum_{j in box_t(i)} e^{s_ij} v_j / sum_t sum_{j in box_t(i)} e^{s_ij}``
    with ``s_ij = scale * q_i . k_j``, where ``box_t(i)`` is the box of ``x_i`` in sample ``t``:
    the 2-D ALiBi weights ``exp(-||x_i - x_j||_1 / sigma)`` replaced by the mean box mask ``M~``.

    Args:
        q: ``[B, Hq, n, d]`` queries, ``n = height * width`` tokens in raster order (row-major).
        k: ``[B, Hkv, n, d]`` keys; ``Hq`` a multiple of ``Hkv`` (GQA: query head ``h`` uses
            key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, n, dv]`` values.
        partitions: :class:`~poslsh.PartitionsND` with ``Hq`` heads and 2 axes (rows, columns),
            e.g. ``sample_partitions_nd(sigma, s)`` or ``PartitionsND.fixed_boxes(Hq, (4, 4))``.
        grid: ``(height, width)`` of the token grid.
        causal: raster-causal: token ``i`` attends to tokens ``j <= i`` only.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` / ``"torch"`` (near linear: query tiles against the bounding box of
            their samples' boxes, ``O(n (d + s))`` memory, no ``n x n`` tensor) or ``"reference"``
            (the dense float64-capable oracle, ``n x n``).

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype``. Differentiable in ``q``, ``k``, ``v``.
    """
    if not isinstance(partitions, PartitionsND):
        raise TypeError(f"partitions must be a poslsh.PartitionsND (sample_partitions_nd), "
                        f"got {type(partitions).__name__}")
    if partitions.dims != 2:
        raise ValueError(f"partitions have {partitions.dims} axes; 2-D attention over a grid needs 2 "
                         "(sample them with dims=2 or sigma [H, 2])")
    shape = check_qkv(q, k, v)
    check_heads(partitions, shape.q_heads)
    height, width = check_grid(grid)
    if height * width != shape.seqlen:
        raise ValueError(f"grid {height}x{width} has {height * width} tokens but q has seqlen {shape.seqlen}")
    scale = check_scale(scale, shape.head_dim)
    if backend not in BACKENDS_2D:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS_2D)}, got {backend!r}")
    if backend == "reference":
        return poslsh_attention_nd_reference(q, k, v, partitions, grid=(height, width), causal=causal, scale=scale)
    if q.device.type == "meta":
        return torch.empty(*q.shape[:3], shape.v_dim, dtype=q.dtype, device=q.device)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        if shape.head_dim == 0 and shape.batch > 0 and shape.v_dim > 0:   # logits all 0: weights = counts
            pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731
            return poslsh_attention_2d(pad(q), pad(k), v, partitions, grid, causal=causal, scale=scale,
                                       backend=backend)
        return torch.zeros(*q.shape[:3], shape.v_dim, dtype=q.dtype, device=q.device) + 0 * (q.sum() + k.sum()
                                                                                              + v.sum())
    parts = partitions.to(q.device)
    return attention_2d(q, k, v, parts.widths, parts.offsets, (height, width), bool(causal), scale)
