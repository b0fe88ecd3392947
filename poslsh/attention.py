"""``poslsh_attention``: the public op and its backend dispatcher."""
from __future__ import annotations

from typing import List, Optional

from torch import Tensor

from ._validation import check_heads, check_qkv, check_scale
from .ops import load_backends, registry
from .partitions import Partitions

__all__ = ["poslsh_attention", "available_backends"]


def available_backends(q: Optional[Tensor] = None) -> List[str]:
    """Names of the backends usable for ``q`` (all registered ones when ``q`` is None)."""
    load_backends()
    return [b.name for b in registry.registered() if q is None or b.can_run(q)]


def poslsh_attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool = False,
                     scale: Optional[float] = None, backend: str = "auto") -> Tensor:
    """Positional-LSH approximation of ALiBi attention (paper section 4).

    Computes, for every query ``i``,
    ``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
    with ``s_ik = scale * q_i . k_k`` (keys ``k <= i`` only when ``causal``), where
    ``block_t(i)`` is the block of ``i`` in sample ``t`` of ``partitions``: the
    ALiBi weights ``exp(-|i-k|/sigma)`` replaced by the mean mask ``M~``.

    Args:
        q: ``[B, Hq, n, d]`` queries.
        k: ``[B, Hkv, n, d]`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA:
            query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, n, dv]`` values.
        partitions: :class:`Partitions` with ``Hq`` heads (any device).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` (fastest available), ``"torch"`` (portable, near
            linear: ``O(n d s b)`` time, ``O(n (d + s))`` memory), ``"triton"``
            (fused GPU kernel, CUDA tensors) or ``"reference"`` (dense ``n x n``).

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype``. Differentiable in ``q``, ``k``, ``v``.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a poslsh.Partitions, got {type(partitions).__name__}")
    shape = check_qkv(q, k, v)
    check_heads(partitions, shape.q_heads)
    scale = check_scale(scale, shape.head_dim)
    load_backends()
    chosen = registry.resolve(backend, q)
    return chosen.fn(q, k, v, partitions.to(q.device), shape, bool(causal), scale)
