"""``poslsh_attention``: the public op and its backend dispatcher."""
from __future__ import annotations

from typing import List, Optional

import torch

from torch import Tensor

from ._validation import AttnShape, check_heads, check_qkv, check_scale
from .ops import load_backends, registry
from .ops.torch_plan import Span
from .partitions import Partitions

__all__ = ["poslsh_attention", "available_backends"]


def available_backends(q: Optional[Tensor] = None) -> List[str]:
    """Names of the backends usable for ``q`` (all registered ones when ``q`` is None)."""
    load_backends()
    return [b.name for b in registry.registered() if q is None or b.can_run(q)]


def poslsh_attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool = False,
                     scale: Optional[float] = None, backend: str = "auto", q_start: int = 0, k_start: int = 0,
                     seq_len: Optional[int] = None) -> Tensor:
    """Positional-LSH approximation of ALiBi attention (paper section 4).

    Computes, for every query ``i``,
    ``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
    with ``s_ik = scale * q_i . k_k`` (keys ``k <= i`` only when ``causal``), where
    ``block_t(i)`` is the block of ``i`` in sample ``t`` of ``partitions``: the
    ALiBi weights ``exp(-|i-k|/sigma)`` replaced by the mean mask ``M~``.

    Args:
        q: ``[B, Hq, n, d]`` queries.
        k: ``[B, Hkv, nk, d]`` keys (``nk = n`` for self-attention); ``Hq`` must be a
            multiple of ``Hkv`` (GQA: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, nk, dv]`` values.
        partitions: :class:`Partitions` with ``Hq`` heads (any device).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` (fastest available), ``"torch"`` (portable, near
            linear: ``O(n d s b)`` time, ``O(n (d + s))`` memory), ``"triton"``
            (fused GPU kernel, CUDA tensors) or ``"reference"`` (dense ``n x n``).
        q_start, k_start: the positions of the first query and the first key in the
            sequence (default 0 and no ``seq_len``: self-attention). Otherwise the queries
            ``[q_start, q_start + n)`` attend to the keys ``[k_start, k_start + nk)``, e.g.
            new tokens against a KV cache, or a shard against its halo; the keys must
            hold every key those queries can see (checked: a ValueError names the gap).
        seq_len: the sequence length (blocks end there); needed for non-causal
            attention at other positions, where keys to the right count too.

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype``. Differentiable in ``q``, ``k``, ``v``.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a poslsh.Partitions, got {type(partitions).__name__}")
    spans = bool(q_start or k_start or seq_len is not None)
    shape = check_qkv(q, k, v, any_lengths=spans)
    check_heads(partitions, shape.q_heads)
    scale = check_scale(scale, shape.head_dim)
    load_backends()
    chosen = registry.resolve(backend, q, spans=spans)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or q.device.type == "meta":
        return _degenerate(q, k, v, partitions, shape, bool(causal), scale, chosen.name,
                           dict(q_start=q_start, k_start=k_start, seq_len=seq_len))
    parts = partitions.to(q.device)
    if not spans:
        return chosen.fn(q, k, v, parts, shape, bool(causal), scale)
    return chosen.fn(q, k, v, parts, shape, bool(causal), scale,
                     span=make_span(shape, causal, q_start, k_start, seq_len))


def _degenerate(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, shape: AttnShape, causal: bool,
                scale: float, backend: str, positions: dict) -> Tensor:
    """Empty tensors (batch 0, head_dim 0, value dim 0) and the meta device (shape
    inference): the exact answer without running a kernel."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    if q.device.type == "meta" or B == 0 or shape.v_dim == 0:
        out = torch.empty(B, Hq, n, shape.v_dim, dtype=q.dtype, device=q.device)
        return out if q.device.type == "meta" else out + 0 * (q.sum() + k.sum() + v.sum())   # keeps autograd
    # head_dim 0: every logit is 0, so the weights are the counts alone: run the op on
    # one zero feature (same result, no empty matmuls).
    pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731
    return poslsh_attention(pad(q), pad(k), v, partitions, causal=causal, scale=scale, backend=backend, **positions)


def make_span(shape: AttnShape, causal: bool, q_start: int, k_start: int, seq_len: Optional[int]) -> Span:
    """Validate the positions of a call with queries and keys at given positions."""
    for name, value in (("q_start", q_start), ("k_start", k_start)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    q_end, k_end = q_start + shape.seqlen, k_start + shape.kv_len
    if seq_len is None:
        if not causal:
            raise ValueError("seq_len: non-causal attention at given positions needs the sequence length "
                             "(keys to the right of the queries count too)")
        seq_len = max(q_end, k_end)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < max(q_end, k_end):
        raise ValueError(f"seq_len must be an int >= the last query and key position + 1 "
                         f"({max(q_end, k_end)}), got {seq_len!r}")
    return Span(q_start, k_start, shape.seqlen, shape.kv_len, seq_len)
