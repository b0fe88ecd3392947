"""``poslsh_attention_2d``: positional-LSH attention over a 2-D token grid (2-D ALiBi, paper
section 5), the registry's ``"grid"`` op (backends ``"torch"`` and ``"reference"``)."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ._validation import check_heads, check_qkv, check_scale
from .attention import degenerate_call
from .ops import load_backends, registry
from .partitions_nd import PartitionsND, check_grid

__all__ = ["poslsh_attention_2d"]


def poslsh_attention_2d(q: Tensor, k: Tensor, v: Tensor, partitions: PartitionsND, grid: Tuple[int, int], *,
                        causal: bool = False, scale: Optional[float] = None, backend: str = "auto",
                        return_lse: bool = False):
    """Positional-LSH approximation of 2-D ALiBi attention over an image's patch grid.

    Computes, for every query ``i`` (grid cell ``x_i``),
    ``T~_i = sum_t sum_{j in box_t(i)} e^{s_ij} v_j / sum_t sum_{j in box_t(i)} e^{s_ij}``
    with ``s_ij = scale * q_i . k_j``, where ``box_t(i)`` is the box of ``x_i`` in sample ``t``:
    the 2-D ALiBi weights ``exp(-||x_i - x_j||_1 / sigma)`` replaced by the mean box mask ``M~``.
    Every batch row is one image on the same grid.

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
            (the dense float64-capable oracle, ``n x n``); ``available_backends(op="grid")``.
        return_lse: also return ``log sum_j count_ij e^{s_ij}``, ``[B, Hq, n]`` (float32, float64
            for float64 input): the ``"reference"`` backend only, so far.

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype`` (and the lse). Differentiable in ``q``, ``k``, ``v``.
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
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    load_backends()
    call = registry.Call(q, k, v, partitions, shape, bool(causal), scale, return_lse=return_lse, grid=(height, width))
    chosen = registry.resolve(backend, "grid", q, call.needs())
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or q.device.type == "meta":
        out, lse = _degenerate(call, chosen.name)
    else:
        out, lse = chosen.fns["grid"](call._replace(positional=partitions.to(q.device)))
    return (out, lse) if return_lse else out


def _degenerate(call: registry.Call, backend: str):
    """Empty tensors and the meta device of the grid op (see :func:`poslsh.attention.degenerate_call`)."""
    return degenerate_call(call, lambda q, k, v: poslsh_attention_2d(
        q, k, v, call.positional, call.grid, causal=call.causal, scale=call.scale, backend=backend,
        return_lse=call.return_lse))
