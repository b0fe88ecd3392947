"""Dense oracles: exact ALiBi attention and approximate attention with the
empirical mean mask ``M~``. Both materialise ``[B, H, n, n]`` scores; every fast
path is tested against them in float64.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validation import check_heads, check_qkv, check_scale, compute_dtype
from .alibi import _as_1d, alibi_bias
from .partitions import Partitions, block_labels

__all__ = ["alibi_attention", "poslsh_attention_reference", "dense_attention", "dense_attention_with_bias"]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, *,
                    allowed: Optional[Tensor] = None, causal: bool = False,
                    scale: Optional[float] = None) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` with GQA and masks, computed densely.

    The one dense attention of the library: the oracles below and the Hugging Face
    adapter's exact paths (ALiBi, KV-cache decoding, general masks) all use it.

    Args:
        q: ``[B, Hq, nq, d]``: the queries are the *last* ``nq`` of the ``nk`` key
            positions (``nq = nk`` for self-attention, ``nq < nk`` for a KV cache).
        k: ``[B, Hkv, nk, d]``; v: ``[B, Hkv, nk, dv]`` (``Hq`` a multiple of ``Hkv``).
        bias: additive logits bias broadcastable to ``[B, Hq, nq, nk]`` (``-inf`` masks).
        allowed: boolean mask broadcastable to ``[B, Hq, nq, nk]``, True = attend.
        causal: also mask keys after each query.
        scale: logit scale, default ``1 / sqrt(d)``.
    Returns:
        ``[B, Hq, nq, dv]`` in ``q.dtype`` (computed in float32, or float64 for float64
        input). Masked logits become the dtype's lowest finite value, not ``-inf``: a
        row with nothing to attend (a padding query) gets uniform weights, not NaN.
    """
    shape = check_qkv(q, k, v, kv_cache=True)
    scale = check_scale(scale, shape.head_dim)
    ct = compute_dtype(q.dtype)
    nq, nk = q.shape[2], k.shape[2]
    kx = k.to(ct).repeat_interleave(shape.group, dim=1)
    vx = v.to(ct).repeat_interleave(shape.group, dim=1)
    scores = torch.matmul(q.to(ct), kx.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.to(ct)
    keep = allowed
    if causal:
        qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        later = torch.arange(nk, device=q.device)[None, :] > qpos
        keep = ~later if keep is None else keep & ~later
    lowest = torch.finfo(ct).min
    if keep is not None:
        scores = scores.masked_fill(~keep, lowest)
    scores = scores.clamp_min(lowest)
    return torch.matmul(torch.softmax(scores, dim=-1), vx).to(q.dtype)


def dense_attention_with_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, *, causal: bool = False,
                              scale: Optional[float] = None) -> Tensor:
    """Self-attention ``softmax(q k^T * scale + bias) v`` (:func:`dense_attention` with ``nq = nk``).

    Args:
        q: ``[B, Hq, n, d]``; k: ``[B, Hkv, n, d]``; v: ``[B, Hkv, n, dv]``.
        bias: additive logits bias broadcastable to ``[B, Hq, n, n]`` (``-inf`` masks).
    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype`` (computed in float32, or float64 for float64 input).
    """
    check_qkv(q, k, v)
    return dense_attention(q, k, v, bias, causal=causal, scale=scale)


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, causal: bool = False,
                    scale: Optional[float] = None) -> Tensor:
    """Exact ALiBi attention: ``softmax(q k^T * scale - m_h |i - j|) v``.

    Args:
        q: ``[B, Hq, n, d]``; k, v: ``[B, Hkv, n, d]`` / ``[B, Hkv, n, dv]`` (Hq a multiple of Hkv).
        slopes: ``[Hq]`` ALiBi slopes ``m_h = 1 / sigma_h`` (see :func:`poslsh.alibi_slopes`).
        causal: mask keys after the query.
        scale: logit scale, default ``1 / sqrt(d)``.
    Returns:
        ``[B, Hq, n, dv]``. Dense ``O(n^2)`` memory: a reference, not a fast path.
    """
    shape = check_qkv(q, k, v)
    slopes = _as_1d(slopes, "slopes")
    if slopes.numel() != shape.q_heads:
        raise ValueError(f"got {slopes.numel()} slopes for {shape.q_heads} query heads")
    if not bool(torch.isfinite(slopes).all()) or bool((slopes < 0).any()):
        raise ValueError("ALiBi slopes must be finite and >= 0")
    bias = alibi_bias(shape.seqlen, slopes.to(q.device), dtype=torch.float64, device=q.device)
    return dense_attention_with_bias(q, k, v, bias, causal=causal, scale=scale)


def poslsh_attention_reference(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *,
                               causal: bool = False, scale: Optional[float] = None, q_start: int = 0,
                               k_start: int = 0) -> Tensor:
    """Approximate ALiBi attention with the mean mask ``M~`` (paper section 4), densely.

    ``T~_i = sum_k A_ik M~_ik v_k / sum_k A_ik M~_ik``, i.e. one softmax with the
    additive bias ``log(count_ik)`` where ``count_ik`` is the number of samples in
    which ``i`` and ``k`` share a block (``-inf`` where it is 0). Query row ``i`` is the
    token at position ``q_start + i`` and key row ``j`` the token at ``k_start + j``
    (self-attention by default; other positions need no equal lengths).
    """
    if q_start == 0 and k_start == 0 and q.shape[-2] == k.shape[-2]:
        shape = check_qkv(q, k, v)
        check_heads(partitions, shape.q_heads)
        count = partitions.to(q.device).dense_count(shape.seqlen).to(torch.float64)
        return dense_attention_with_bias(q, k, v, torch.log(count), causal=causal, scale=scale)
    shape = check_qkv(q, k, v, any_lengths=True)
    check_heads(partitions, shape.q_heads)
    parts = partitions.to(q.device)
    qpos = torch.arange(q_start, q_start + shape.seqlen, dtype=torch.float64, device=q.device)
    kpos = torch.arange(k_start, k_start + shape.kv_len, dtype=torch.float64, device=q.device)
    lab_q, lab_k = (block_labels(parts.widths, parts.offsets, p) for p in (qpos, kpos))   # [H, s, P]
    count = (lab_q[..., :, None] == lab_k[..., None, :]).sum(1).to(torch.float64)          # [H, nq, nk]
    allowed = (kpos[None, :] <= qpos[:, None]) if causal else None
    return dense_attention(q, k, v, torch.log(count), allowed=allowed, scale=scale)
