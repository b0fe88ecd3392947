"""Dense oracles: exact ALiBi attention (whole, or cut at per-head windows: the oracle of the fast op
:func:`poslsh.alibi_attention`), approximate attention
with the empirical mean mask ``M~``, and one oracle for any positional object
(:func:`reference_attention`: one softmax with the object's :meth:`~poslsh.positional.Positional.dense_bias`),
for self-attention, queries and keys at given positions, and packed documents. All materialise
``[B, H, nq, nk]`` scores; every fast path is tested against them in float64.

Positions: query row ``i`` is position ``q_start + i``, key row ``j`` is position ``k_start + j``.
Without positions the queries and keys must be equally many (self-attention); flash-attention's
bottom-right alignment (the queries are the last ``nq`` keys) is ``q_start = k_start + nk - nq``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ._validation import check_has_values, check_qkv, check_scale, compute_dtype, positions_needed
from .documents import Documents, make_documents
from .positional import Positional, check_positional
from .window.kind import make_window

__all__ = ["alibi_attention_reference", "poslsh_attention_reference", "reference_attention", "dense_attention",
           "dense_attention_with_bias"]

def dense_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, *,
                    allowed: Optional[Tensor] = None, causal: bool = False, scale: Optional[float] = None,
                    return_lse: bool = False, q_start: Optional[int] = None, k_start: int = 0):
    """``softmax(q k^T * scale + bias) v`` with GQA and masks, computed densely.

    The one dense attention of the library: the oracles below and the Hugging Face
    adapter's exact paths (ALiBi, KV-cache decoding, general masks) all use it.

    Args:
        q: ``[B, Hq, nq, d]``; k: ``[B, Hkv, nk, d]``; v: ``[B, Hkv, nk, dv]`` (``Hq`` a multiple of ``Hkv``).
        bias: additive logits bias broadcastable to ``[B, Hq, nq, nk]`` (``-inf`` masks).
        allowed: boolean mask broadcastable to ``[B, Hq, nq, nk]``, True = attend.
        causal: also mask keys after each query, by position: query row ``i`` at ``q_start + i``,
            key row ``j`` at ``k_start + j``. ``q_start`` is needed when ``nq != nk``
            (flash-attention's bottom-right alignment: ``q_start = k_start + nk - nq``).
        scale: logit scale, default ``1 / sqrt(d)``.
        return_lse: also return ``log sum_j exp(logit_ij)`` over the keys each query attends to
            (``[B, Hq, nq]``; ``-inf`` for a row with nothing to attend).
    Returns:
        ``[B, Hq, nq, dv]`` in ``q.dtype`` (computed in float32, or float64 for float64
        input), and the log-sum-exp with ``return_lse``. Masked logits become the dtype's lowest
        finite value, not ``-inf``: a row with nothing to attend (a padding query) gets uniform
        weights, not NaN.
    """
    # With the caller's own masks (no ``causal``) queries and keys may be any positions: the
    # oracles pass keys at given positions, fewer than the queries when a key set is split.
    shape = check_qkv(q, k, v, any_lengths=True)
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
        if q_start is None and nq != nk:
            raise ValueError(positions_needed(nq, nk, "dense_attention(causal=True)"))
        qa = torch.arange(nq, device=q.device) + (k_start if q_start is None else q_start)
        later = torch.arange(k_start, k_start + nk, device=q.device)[None, :] > qa[:, None]
        keep = ~later if keep is None else keep & ~later
    if return_lse:
        real = scores if keep is None else scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(real, dim=-1)
    lowest = torch.finfo(ct).min
    if keep is not None:
        scores = scores.masked_fill(~keep, lowest)
    scores = scores.clamp_min(lowest)
    out = torch.matmul(torch.softmax(scores, dim=-1), vx).to(q.dtype)
    return (out, lse) if return_lse else out


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


def _layout(q: Tensor, k: Tensor, q_start, k_start, cu_seqlens, document_ids, where: str):
    """Absolute query and key positions (int64 ``[nq]``, ``[nk]``) and the documents (or None)."""
    nq, nk = q.shape[2], k.shape[2]
    if q_start is None and k_start is None and nq != nk:
        raise ValueError(positions_needed(nq, nk, where))
    q_start, k_start = q_start or 0, k_start or 0
    docs = make_documents(q.shape[0], nq, cu_seqlens=cu_seqlens, document_ids=document_ids, device=q.device)
    if docs is not None and (q_start or k_start or nq != nk):
        raise ValueError("cu_seqlens / document_ids are for self-attention (q_start = k_start = 0, equal lengths)")
    qa = torch.arange(q_start, q_start + nq, device=q.device)
    ka = torch.arange(k_start, k_start + nk, device=q.device)
    return qa, ka, docs


def reference_attention(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal: bool = False,
                        scale: Optional[float] = None, q_start: Optional[int] = None, k_start: Optional[int] = None,
                        cu_seqlens: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                        return_lse: bool = False, documents: Optional[Documents] = None):
    """The dense oracle of a sequence kind (:class:`~poslsh.Partitions`, :class:`~poslsh.AlibiWindow`):
    ``softmax(q k^T * scale + B) v`` with ``B = positional.dense_bias`` between the positions, causal by
    position, no weight across packed documents (whose positions restart at 0). Shapes and positions
    as in :func:`alibi_attention_reference`; ``documents``: already validated ones, in place of
    ``cu_seqlens`` / ``document_ids``."""
    shape = check_qkv(q, k, v, any_lengths=True)
    positional = check_positional(positional, op=("sequence", "window")).to(q.device)
    positional.check_heads(shape.q_heads)
    qa, ka, docs = _layout(q, k, q_start, k_start, cu_seqlens, document_ids, "reference_attention")
    docs = documents if documents is not None else docs
    if docs is None:
        bias = positional.dense_bias(qa, ka)[None]                                   # [1, H, nq, nk]
        allowed = None
    else:
        local = docs.positions()
        bias = torch.stack([positional.dense_bias(row, row) for row in local])       # [B, H, n, n]
        allowed = (docs.start[:, :, None] == docs.start[:, None, :])[:, None]
    if causal:
        later = (ka[None, :] <= qa[:, None])[None, None]
        allowed = later if allowed is None else allowed & later
    return dense_attention(q, k, v, bias, allowed=allowed, scale=scale, return_lse=return_lse)


def alibi_attention_reference(q: Tensor, k: Tensor, v: Tensor, slopes, *, window: Union[int, Tensor, None] = None,
                              causal: bool = False, scale: Optional[float] = None, q_start: Optional[int] = None,
                              k_start: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                              document_ids: Optional[Tensor] = None, return_lse: bool = False):
    """Exact ALiBi attention, ``softmax(q k^T * scale - m_h |i - j|) v``, densely (float64-safe): the
    oracle of :func:`poslsh.alibi_attention` (the fast op, same arguments but ``backend`` and ``seq_len``).

    Args:
        q: ``[B, Hq, nq, d]``; k, v: ``[B, Hkv, nk, d]`` / ``[B, Hkv, nk, dv]`` (Hq a multiple of Hkv).
        slopes: ``[Hq]`` ALiBi slopes ``m_h`` (see :func:`poslsh.alibi_slopes`).
        window: keep only keys with ``|i - j| <= window_h`` (an int or int ``[Hq]``); None: no cut, every key.
        causal: mask keys after the query (by position).
        scale: logit scale, default ``1 / sqrt(d)``.
        q_start, k_start: positions of the first query and key (a missing one is 0; queries and
            keys at given positions need no equal lengths). Without them ``nq`` must equal ``nk``
            (self-attention); flash-attention's bottom-right alignment is ``q_start = k_start + nk - nq``.
        cu_seqlens, document_ids: packed documents (self-attention): no weight across documents,
            see :mod:`poslsh.documents`.
        return_lse: also return the log-sum-exp ``[B, Hq, nq]`` of the biased logits.
    Returns:
        ``[B, Hq, nq, dv]`` (and the log-sum-exp). Dense ``O(nq nk)`` memory: a reference, not a fast path.
    """
    shape = check_qkv(q, k, v, any_lengths=True)
    win = make_window(slopes, window, shape.q_heads)
    return reference_attention(q, k, v, win, causal=causal, scale=scale, q_start=q_start, k_start=k_start,
                               cu_seqlens=cu_seqlens, document_ids=document_ids, return_lse=return_lse)


def poslsh_attention_reference(q: Tensor, k: Tensor, v: Tensor, partitions, *,
                               causal: bool = False, scale: Optional[float] = None, q_start: Optional[int] = None,
                               k_start: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                               document_ids: Optional[Tensor] = None, return_lse: bool = False):
    """Approximate ALiBi attention with the mean mask ``M~`` (paper section 4), densely.

    ``T~_i = sum_k A_ik M~_ik v_k / sum_k A_ik M~_ik``, i.e. one softmax with the
    additive bias ``log(count_ik)`` where ``count_ik`` is the number of samples in
    which ``i`` and ``k`` share a block (``-inf`` where it is 0). Query row ``i`` is the
    token at position ``q_start + i`` and key row ``j`` the token at ``k_start + j``
    (self-attention by default; other positions need no equal lengths, and ``nq != nk``
    needs them: flash-attention's bottom-right alignment is ``q_start = k_start + nk - nq``).
    Packed documents (``cu_seqlens`` / ``document_ids``): positions restart in every document and
    ``count_ij`` is 0 across documents. ``return_lse`` adds ``log sum_k count_ik e^{s_ik}``.
    """
    check_positional(partitions, "partitions", op="sequence")
    return reference_attention(q, k, v, partitions, causal=causal, scale=scale, q_start=q_start, k_start=k_start,
                               cu_seqlens=cu_seqlens, document_ids=document_ids, return_lse=return_lse)


# ----------------------------------------------------------------------------- N dimensions
# Oracles over token coordinates (paper section 5). Naming rule: the 1-D name with the suffix ``_nd``
# (``ND`` in class names) is the N-D one; these take coordinates ``[n, D]`` of any ``D`` (or a ``grid``),
# the op (:func:`poslsh.poslsh_attention_nd`) takes a 2-D grid for now. *causal* over coordinates means
# raster (token) order: token ``i`` sees tokens ``j <= i``.
from .partitions_nd import check_coords, check_grid, check_sigma_nd, expected_mask, grid_coords  # noqa: E402
from .widths import WidthDistribution  # noqa: E402

__all__ += ["coords_nd", "alibi_bias_nd", "alibi_matrix_nd", "alibi_attention_reference_nd", "kernel_attention_nd",
            "poslsh_attention_reference_nd"]


def coords_nd(n: int, coords: Optional[Tensor] = None, grid=None) -> Tensor:
    """The token coordinates of a call with ``n`` tokens: ``coords [n, D]`` or a ``grid (height,
    width)`` with ``height * width = n`` (exactly one of them), int64 ``[n, D]``."""
    if (coords is None) == (grid is None):
        raise ValueError("pass exactly one of coords ([n, D] integer coordinates) and grid ((height, width))")
    if grid is not None:
        h, w = check_grid(grid)
        if h * w != n:
            raise ValueError(f"grid {h}x{w} has {h * w} tokens but q has seqlen {n}")
        return grid_coords(h, w)
    c = check_coords(coords)
    if c.shape[0] != n:
        raise ValueError(f"coords give {c.shape[0]} tokens but q has seqlen {n}")
    return c


def _slopes_nd(slopes, dims: int) -> Tensor:
    t = slopes if isinstance(slopes, Tensor) else torch.as_tensor(slopes, dtype=torch.float64)
    t = t.detach().to(torch.float64)
    t = t.reshape(1) if t.dim() == 0 else t
    t = t[:, None].expand(-1, dims) if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[1] != dims:
        raise ValueError(f"slopes must be [H] or [H, {dims}] (per head and axis), got shape {tuple(t.shape)}")
    if not bool((torch.isfinite(t) & (t >= 0)).all()):
        raise ValueError("ALiBi slopes must be finite and >= 0")
    return t


def alibi_bias_nd(coords: Tensor, slopes, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Additive N-D ALiBi bias ``-sum_a m_{h,a} |x_a - y_a|`` (``= -m_h ||x - y||_1`` for one
    slope per head), ``[H, n, n]`` in ``dtype``. ``slopes``: ``[H]`` or per-axis ``[H, D]``.
    Built head by head and axis by axis in ``dtype``, so memory is the output plus two ``[n, n]``
    buffers (a 128 x 128 grid in float32: 4 GiB + 2 GiB)."""
    x = check_coords(coords)
    m = _slopes_nd(check_has_values(slopes, "slopes"), x.shape[1])
    xf = x.to(torch.float64 if dtype == torch.float64 else torch.float32)   # small integers: exact
    out = torch.zeros(m.shape[0], x.shape[0], x.shape[0], dtype=dtype, device=x.device)
    for a in range(x.shape[1]):
        dist = (xf[:, None, a] - xf[None, :, a]).abs_()
        for h in range(m.shape[0]):
            out[h].sub_(dist * float(m[h, a]))
    return out


def alibi_matrix_nd(coords: Tensor, sigma) -> Tensor:
    """``L**_xy = exp(-sum_a |x_a - y_a| / sigma_{h,a})``, float64 ``[H, n, n]`` (2-D ALiBi's kernel)."""
    x = check_coords(coords)
    return torch.exp(alibi_bias_nd(x, 1.0 / check_sigma_nd(sigma, x.shape[1])))


def alibi_attention_reference_nd(q: Tensor, k: Tensor, v: Tensor, slopes, *, coords: Optional[Tensor] = None,
                                 grid=None, causal: bool = False, scale: Optional[float] = None,
                                 return_lse: bool = False):
    """Exact N-D ALiBi attention ``softmax(q k^T * scale - m_h ||x_i - x_j||_1) v`` (the weights
    multiplied by ``L**``), densely.

    Args:
        q: ``[B, Hq, n, d]``; k, v: ``[B, Hkv, n, d]`` / ``[B, Hkv, n, dv]`` (``Hq`` a multiple of ``Hkv``).
        slopes: ``[Hq]`` or ``[Hq, D]`` slopes ``m``.
        coords: ``[n, D]`` integer token coordinates, or grid: ``(height, width)`` in raster order.
        causal: token ``i`` attends to ``j <= i`` only (raster order).
        return_lse: also return the log-sum-exp ``[B, Hq, n]`` of the biased logits.
    Returns:
        ``[B, Hq, n, dv]`` (computed in float32, or float64 for float64 input), and the lse.
    """
    shape = check_qkv(q, k, v)
    bias = alibi_bias_nd(coords_nd(shape.seqlen, coords, grid), slopes).to(q.device)
    if bias.shape[0] != shape.q_heads:
        raise ValueError(f"got {bias.shape[0]} slopes for {shape.q_heads} query heads")
    return dense_attention(q, k, v, bias, causal=causal, scale=scale, return_lse=return_lse)


def kernel_attention_nd(q: Tensor, k: Tensor, v: Tensor, sigma, widths: Optional[WidthDistribution] = None, *,
                        coords: Optional[Tensor] = None, grid=None, causal: bool = False,
                        scale: Optional[float] = None, return_lse: bool = False):
    """Attention with the weights multiplied by the exact expected mask ``L = E[M]`` of a width
    distribution (:func:`~poslsh.partitions_nd.expected_mask`): the target that positional LSH
    with those widths estimates. ``sigma``: ``[Hq]`` or ``[Hq, D]``, the kernel's bandwidths (its math is in
    ``sigma``, as the samplers'). Shapes as in
    :func:`alibi_attention_reference_nd`; where ``L = 0`` (compact kernels) the key is masked."""
    shape = check_qkv(q, k, v)
    L = expected_mask(coords_nd(shape.seqlen, coords, grid), sigma, widths).to(q.device)
    if L.shape[0] != shape.q_heads:
        raise ValueError(f"got {L.shape[0]} bandwidths for {shape.q_heads} query heads")
    return dense_attention(q, k, v, torch.log(L), allowed=L > 0, causal=causal, scale=scale, return_lse=return_lse)


def poslsh_attention_reference_nd(q: Tensor, k: Tensor, v: Tensor, partitions, *,
                                  coords: Optional[Tensor] = None, grid=None, causal: bool = False,
                                  scale: Optional[float] = None, return_lse: bool = False):
    """The positional-LSH estimator with the mean box mask ``M~``, densely (the float64 oracle of
    :func:`poslsh.poslsh_attention_nd`).

    ``T~_i = sum_t sum_{j in box_t(i)} e^{s_ij} v_j / sum_t sum_{j in box_t(i)} e^{s_ij}``: one
    softmax with the bias ``log count_ij`` (``count_ij`` = samples in which ``i`` and ``j`` share a
    box on every axis; ``-inf`` where 0); ``return_lse`` adds ``log sum_j count_ij e^{s_ij}``.
    Shapes as in :func:`alibi_attention_reference_nd`; ``partitions`` has ``Hq`` heads and ``D`` = the
    coordinates' axes.
    """
    check_positional(partitions, "partitions", op="nd")
    shape = check_qkv(q, k, v)
    partitions.check_heads(shape.q_heads)
    x = coords_nd(shape.seqlen, coords, grid).to(q.device)
    bias = partitions.to(q.device).dense_bias(x, x)
    return dense_attention(q, k, v, bias, causal=causal, scale=scale, return_lse=return_lse)
