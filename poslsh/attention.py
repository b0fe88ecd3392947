"""The public ops and their one dispatcher: :func:`attend` (any positional object),
:func:`poslsh_attention` (positional LSH on a sequence) and :func:`poslsh_attention_nd` (positional
LSH over token coordinates: a 2-D grid); exact ALiBi, whole or cut at a window
(:func:`poslsh.alibi_attention`, also named :func:`poslsh.windowed_alibi_attention`), lives in the
window's room (:mod:`poslsh.window.op`) and dispatches here too.

Every call goes the same way: validate (shapes, the object's heads and layout, positions, packed
documents), ask the registry for the backend of the object's op (:mod:`poslsh.ops.registry`), check
that the keys hold every key the queries can see (:func:`poslsh.ops.call.check_covered`, on every
backend), run it.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ._validation import check_has_values, check_qkv, check_scale, compute_dtype
from .documents import make_documents
from .ops import load_backends, registry
from .ops.call import Call, Span, check_covered, make_span  # noqa: F401  (Span, make_span: the call contract)
from .positional import Positional, check_positional

__all__ = ["attend", "poslsh_attention", "poslsh_attention_nd", "available_backends"]


def available_backends(q: Optional[Tensor] = None, op: str = "sequence") -> List[str]:
    """Names of the backends implementing ``op`` (``"sequence"``, ``"window"`` or ``"nd"``),
    those that can run on ``q``'s device and dtype when ``q`` is given."""
    load_backends()
    op = registry.check_op(op)
    return [b.name for b in registry.registered(op) if q is None or b.can_run(q)]


POSITIONS_DOC = """
        q_start, k_start: int positions of the first query and the first key in the sequence
            (default: self-attention, ``nk = n``). Otherwise the queries
            ``[q_start, q_start + n)`` attend to the keys ``[k_start, k_start + nk)`` (a missing one is 0),
            e.g. new tokens against a KV cache, or a shard against its halo; the keys must
            hold every key those queries can see (checked on every backend: a ValueError names the gap).
            With ``nk != n`` the positions are required: flash-attention's bottom-right alignment
            (the queries are the last ``n`` keys) is ``q_start = k_start + nk - n``.
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


def attend(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal: bool = False,
           scale: Optional[float] = None, backend: str = "auto", q_start: Optional[int] = None,
           k_start: Optional[int] = None, seq_len: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
           document_ids: Optional[Tensor] = None, return_lse: bool = False,
           grid: Optional[Tuple[int, int]] = None):
    """Attention with any positional object (:mod:`poslsh.positional`): positional LSH for
    :class:`~poslsh.Partitions`, exact ALiBi in windows for an :class:`~poslsh.AlibiWindow`, boxes
    for a :class:`~poslsh.PartitionsND` (with ``grid=(height, width)``): the object's op
    (``positional.op``) on the backend the registry picks. Arguments as in the ops."""
    _with_values(check_positional(positional), "positional", q)
    return _dispatch(q, k, v, positional, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse, grid=grid)


def poslsh_attention(q: Tensor, k: Tensor, v: Tensor, partitions, *, causal: bool = False,
                     scale: Optional[float] = None, backend: str = "auto", q_start: Optional[int] = None,
                     k_start: Optional[int] = None, seq_len: Optional[int] = None,
                     cu_seqlens: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                     return_lse: bool = False):
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
    _with_values(check_positional(partitions, "partitions", op="sequence"), "partitions", q)
    return _dispatch(q, k, v, partitions, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse)


poslsh_attention.__doc__ += POSITIONS_DOC


def poslsh_attention_nd(q: Tensor, k: Tensor, v: Tensor, partitions, *, grid: Optional[Tuple[int, int]] = None,
                        causal: bool = False, scale: Optional[float] = None, backend: str = "auto",
                        return_lse: bool = False):
    """Positional-LSH approximation of N-D ALiBi attention (paper section 5), over an image's 2-D patch grid.

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
            e.g. ``sample_partitions_nd(sigma, num_samples)`` or ``PartitionsND.fixed_blocks(Hq, (4, 4))``.
        grid: ``(height, width)`` of the token grid (keyword-only).
        causal: raster-causal: token ``i`` attends to tokens ``j <= i`` only.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` / ``"torch"`` (near linear: query tiles against the bounding box of
            their samples' boxes, ``O(n (d + s))`` memory, no ``n x n`` tensor) or ``"reference"``
            (the dense float64-capable oracle, ``n x n``); ``available_backends(op="nd")``.
        return_lse: also return ``log sum_j count_ij e^{s_ij}``, ``[B, Hq, n]`` (float32, float64
            for float64 input): the ``"reference"`` backend only, so far.

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype`` (and the lse). Differentiable in ``q``, ``k``, ``v``. No positions
        (``q_start``), packed documents or lse on the torch backend: the op attends whole grids.
    """
    _with_values(check_positional(partitions, "partitions", op="nd"), "partitions", q)
    return _dispatch(q, k, v, partitions, causal=causal, scale=scale, backend=backend, return_lse=return_lse, grid=grid)


def _with_values(positional: Positional, name: str, q) -> None:
    """A positional object on the meta device has no values to attend with (unless q is meta too: shapes)."""
    if not (isinstance(q, Tensor) and q.device.type == "meta") and positional.device.type == "meta":
        check_has_values(positional.tensors()[0], name)


def _dispatch(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal, scale, backend, q_start=None,
              k_start=None, seq_len=None, cu_seqlens=None, document_ids=None, return_lse=False, grid=None):
    """Validate a call, pick its backend from the registry, check the keys cover the queries, run it."""
    explicit = q_start is not None or k_start is not None
    unequal = isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == k.dim() == 4 and q.shape[2] != k.shape[2]
    spans = bool(q_start) or bool(k_start) or seq_len is not None or (explicit and unequal)
    shape = check_qkv(q, k, v, any_lengths=spans)
    positional.check_heads(shape.q_heads)
    grid = positional.check_layout(shape.seqlen, grid)
    scale = check_scale(scale, shape.head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
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
    call = Call(q, k, v, positional, shape, causal, scale, span, documents, return_lse, grid)
    chosen = registry.resolve(backend, positional.op, q, call.needs())
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or q.device.type == "meta":
        positions = dict(q_start=q_start, k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens,
                         document_ids=document_ids, grid=grid)
        rerun = dict(causal=causal, scale=scale, backend=chosen.name, return_lse=return_lse, **positions)
        out, lse = degenerate_call(call, lambda q, k, v: _dispatch(q, k, v, positional, **rerun))
    else:
        # on q's device, in values the backend's compute dtype holds (e.g. slopes past float32's range)
        call = call._replace(positional=positional.to(q.device).for_compute(compute_dtype(q.dtype)))
        if span is not None:
            check_covered(call.positional, span, causal)
        out, lse = chosen.fns[positional.op](call)
    return (out, lse) if return_lse else out


def degenerate_call(call: Call, rerun: Callable[[Tensor, Tensor, Tensor], object]):
    """Empty tensors (batch 0, head_dim 0, value dim 0) and the meta device (shape inference):
    the exact ``(out, lse)`` without running a kernel on empty tensors. ``rerun(q, k, v)`` calls
    the public op again (with ``return_lse`` as the call asked) on padded inputs: with head_dim 0
    every logit is 0 and the weights are the positional ones alone, so one zero feature gives the
    same answer; with value dim 0 one zero value column is cut off again."""
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
    if shape.head_dim == 0:
        q, k = pad(q), pad(k)
    result = rerun(q, k, pad(v) if shape.v_dim == 0 else v)
    out, lse = result if call.return_lse else (result, None)
    return (out[..., :0] if shape.v_dim == 0 else out), lse
