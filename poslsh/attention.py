"""The public 1-D ops and their dispatcher: ``poslsh_attention`` (positional LSH) and
``windowed_alibi_attention`` (exact ALiBi cut at per-head windows, the strongest baseline)."""
from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import Tensor

from ._validation import AttnShape, check_heads, check_qkv, check_scale
from .alibi import AlibiWindow, make_window
from .documents import make_documents
from .ops import load_backends, registry
from .ops.torch_plan import Span
from .partitions import Partitions

__all__ = ["poslsh_attention", "windowed_alibi_attention", "available_backends"]


def available_backends(q: Optional[Tensor] = None, op: str = "sequence") -> List[str]:
    """Names of the backends implementing ``op`` (``"sequence"``, ``"window"`` or ``"grid"``),
    those that can run on ``q``'s device and dtype when ``q`` is given."""
    load_backends()
    if op not in registry.OPS:
        raise ValueError(f"op must be one of {registry.OPS}, got {op!r}")
    return [b.name for b in registry.registered(op) if q is None or b.can_run(q)]


_POSITIONS_DOC = """
        q_start, k_start: int positions of the first query and the first key in the sequence
            (default 0 and no ``seq_len``: self-attention). Otherwise the queries
            ``[q_start, q_start + n)`` attend to the keys ``[k_start, k_start + nk)``, e.g.
            new tokens against a KV cache, or a shard against its halo; the keys must
            hold every key those queries can see (checked: a ValueError names the gap).
        seq_len: int, the sequence length (blocks and windows end there); needed for non-causal
            attention at other positions, where keys to the right count too.
        cu_seqlens: packed documents, flash-attention's convention: int ``[D + 1]`` offsets
            ``0 = c_0 <= ... <= c_D = n`` of ``D`` documents in one row (``B = 1``). A token
            attends only to its own document, and positions restart at 0 in every document,
            so each document gets exactly what it would get alone (:mod:`poslsh.documents`).
        document_ids: packed documents for any batch: int ``[B, n]``, the document of each token
            (one run of equal ids per document; rows may pack differently). Exclusive with
            ``cu_seqlens``; neither can be combined with ``q_start`` / ``k_start`` / ``seq_len``
            (decode each document as its own row). Both need ``nk = n``.
        return_lse: also return the log-sum-exp of every query's weighted logits, ``[B, Hq, n]``,
            float32 (float64 for float64 input), natural log; differentiable. Two attentions over
            disjoint key sets merge exactly (:func:`poslsh.merge_attention`):
            ``lse = logaddexp(lse1, lse2)``, ``out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2``.

    Returns:
        ``out [B, Hq, n, dv]`` in ``q.dtype``, or ``(out, lse [B, Hq, n])`` with ``return_lse``.
        Differentiable in ``q``, ``k``, ``v`` (twice on the torch and reference backends).

    Raises:
        ValueError / TypeError naming the argument: bad shapes, dtypes or devices, a head count that
        does not match, keys missing for the given positions, a backend that cannot serve the call
        (the message lists the backends that can)."""


def poslsh_attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool = False,
                     scale: Optional[float] = None, backend: str = "auto", q_start: int = 0, k_start: int = 0,
                     seq_len: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                     document_ids: Optional[Tensor] = None, return_lse: bool = False):
    """Positional-LSH approximation of ALiBi attention (paper section 4).

    Computes, for every query ``i``,
    ``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
    with ``s_ik = scale * q_i . k_k`` (keys ``k <= i`` only when ``causal``), where
    ``block_t(i)`` is the block of ``i`` in sample ``t`` of ``partitions``: the
    ALiBi weights ``exp(-|i-k|/sigma)`` replaced by the mean mask ``M~``. The log-sum-exp is
    ``log sum_k count_ik e^{s_ik}`` (``count_ik``: the samples in which ``i`` and ``k`` share a block).

    Args:
        q: ``[B, Hq, n, d]`` queries (float16, bfloat16, float32 or float64).
        k: ``[B, Hkv, nk, d]`` keys (``nk = n`` for self-attention); ``Hq`` must be a
            multiple of ``Hkv`` (GQA: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, nk, dv]`` values.
        partitions: :class:`Partitions` with ``Hq`` heads (any device).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` (fastest available), ``"torch"`` (portable, near
            linear: ``O(n d s b)`` time, ``O(n (d + s))`` memory; every feature), ``"triton"``
            (fused GPU kernel, CUDA tensors, self-attention) or ``"reference"`` (dense ``n x n``);
            :func:`available_backends` lists them."""
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a poslsh.Partitions, got {type(partitions).__name__}")
    return _dispatch("sequence", q, k, v, partitions, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse)


def windowed_alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, window: Union[int, Tensor],
                             causal: bool = False, scale: Optional[float] = None, backend: str = "auto",
                             q_start: int = 0, k_start: int = 0, seq_len: Optional[int] = None,
                             cu_seqlens: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                             return_lse: bool = False):
    """Exact ALiBi attention cut at a window per head: the strongest baseline of positional LSH.

    Computes ``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j`` over the keys with
    ``|i - j| <= window_h`` (and ``j <= i`` when ``causal``): exact ALiBi inside the window, no
    weight outside. Cost per query ``O(window_h)`` keys; the dropped tail is bounded by
    :func:`poslsh.theory.window_error_bound` and :func:`poslsh.theory.alibi_window` gives the
    smallest window for a tolerance. The log-sum-exp is ``log sum_j e^{s_ij - m_h |i - j|}``.

    Args:
        q: ``[B, Hq, n, d]`` queries (float16, bfloat16, float32 or float64).
        k: ``[B, Hkv, nk, d]`` keys (``nk = n`` for self-attention); ``Hq`` a multiple of ``Hkv``
            (GQA: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, nk, dv]`` values.
        slopes: ``[Hq]`` ALiBi slopes ``m_h = 1 / sigma_h`` (:func:`poslsh.alibi_slopes`), finite, ``>= 0``.
        window: keys with ``|i - j| <= window`` attend: an int for every head, or int ``[Hq]``
            (0: each query sees itself only; ``>= n``: exact ALiBi). Positions are absolute with
            ``q_start`` / ``k_start`` and restart in every packed document.
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"``, ``"torch"`` (the window as one block per query on the tiles of
            positional LSH: ``O(n (w + 64) d)`` time, ``O(n)`` memory; every feature) or
            ``"reference"`` (dense ``n x n``); :func:`available_backends` with ``op="window"``
            lists them."""
    positional = make_window(slopes, window)
    return _dispatch("window", q, k, v, positional, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse)


poslsh_attention.__doc__ += _POSITIONS_DOC
windowed_alibi_attention.__doc__ += _POSITIONS_DOC


def _dispatch(op: str, q: Tensor, k: Tensor, v: Tensor, positional, *, causal, scale, backend, q_start, k_start,
              seq_len, cu_seqlens, document_ids, return_lse):
    """Validate a call, pick its backend from the registry and run it."""
    spans = bool(q_start or k_start or seq_len is not None)
    shape = check_qkv(q, k, v, any_lengths=spans)
    check_heads(positional, shape.q_heads)
    scale = check_scale(scale, shape.head_dim)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    documents = make_documents(shape.batch, shape.seqlen, cu_seqlens=cu_seqlens, document_ids=document_ids,
                               device=q.device)
    if documents is not None and spans:
        raise ValueError("cu_seqlens / document_ids with q_start / k_start / seq_len: packed documents are for "
                         "self-attention; decode each document as its own row (positions restart at 0 in every "
                         "document)")
    span = make_span(shape, causal, q_start, k_start, seq_len) if spans else None
    load_backends()
    call = registry.Call(q, k, v, positional, shape, bool(causal), scale, span, documents, return_lse)
    chosen = registry.resolve(backend, op, q, call.needs())
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or q.device.type == "meta":
        out, lse = _degenerate(op, call, backend=chosen.name, positions=dict(
            q_start=q_start, k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids))
    else:
        out, lse = chosen.fns[op](call._replace(positional=positional.to(q.device)))
    return (out, lse) if return_lse else out


def _degenerate(op: str, call: registry.Call, *, backend: str, positions: dict):
    """Empty tensors (batch 0, head_dim 0, value dim 0) and the meta device (shape
    inference): the exact answer without running a kernel on empty tensors."""
    q, k, v, shape = call.q, call.k, call.v, call.shape
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q.device.type == "meta" or B == 0:
        out = torch.empty(B, Hq, n, shape.v_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, n, dtype=lse_dtype, device=q.device)
        if q.device.type == "meta":
            return out, lse
        keep = 0 * (q.sum() + k.sum() + v.sum())        # keeps autograd
        return out + keep, lse + keep
    pad = lambda x: torch.nn.functional.pad(x, (0, 1))  # noqa: E731
    rerun = dict(causal=call.causal, scale=call.scale, backend=backend, return_lse=call.return_lse, **positions)
    if shape.head_dim == 0:
        # every logit is 0: the weights are the positional ones alone; run on one zero feature
        q, k = pad(q), pad(k)
    result = _dispatch(op, q, k, pad(v) if shape.v_dim == 0 else v, call.positional, **rerun)
    out, lse = result if call.return_lse else (result, None)
    return (out[..., :0] if shape.v_dim == 0 else out), lse


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
