"""Dense oracles: exact ALiBi attention (whole, or cut at per-head windows) and approximate
attention with the empirical mean mask ``M~``, for self-attention, queries and keys at given
positions, and packed documents. All materialise ``[B, H, nq, nk]`` scores; every fast path is
tested against them in float64.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from ._validation import check_heads, check_qkv, check_scale, compute_dtype
from .alibi import make_window
from .documents import Documents, make_documents
from .partitions import Partitions, block_labels

__all__ = ["alibi_attention", "poslsh_attention_reference", "dense_attention", "dense_attention_with_bias"]


def dense_attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, *,
                    allowed: Optional[Tensor] = None, causal: bool = False,
                    scale: Optional[float] = None, return_lse: bool = False):
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
    shape = check_qkv(q, k, v, kv_cache=True, any_lengths=not causal)
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


def _positions(q: Tensor, k: Tensor, q_start: int, k_start: int, documents: Optional[Documents]):
    """Float64 query and key positions (``[B or 1, nq]``, ``[B or 1, nk]``; restarting in every packed
    document) and the boolean ``[B or 1, 1, nq, nk]`` mask of pairs in the same document (or None)."""
    nq, nk = q.shape[2], k.shape[2]
    if documents is None:
        qpos = torch.arange(q_start, q_start + nq, dtype=torch.float64, device=q.device)[None]
        kpos = torch.arange(k_start, k_start + nk, dtype=torch.float64, device=q.device)[None]
        return qpos, kpos, None
    local = documents.positions().to(torch.float64)
    same = documents.start[:, :, None] == documents.start[:, None, :]
    return local, local, same[:, None]


def _documents(q: Tensor, k: Tensor, cu_seqlens, document_ids, q_start: int, k_start: int) -> Optional[Documents]:
    docs = make_documents(q.shape[0], q.shape[2], cu_seqlens=cu_seqlens, document_ids=document_ids, device=q.device)
    if docs is not None and (q_start or k_start or q.shape[2] != k.shape[2]):
        raise ValueError("cu_seqlens / document_ids are for self-attention (q_start = k_start = 0, equal lengths)")
    return docs


def _causal(qpos_abs: Tensor, kpos_abs: Tensor) -> Tensor:
    return kpos_abs[None, :] <= qpos_abs[:, None]


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, causal: bool = False,
                    scale: Optional[float] = None, window: Union[int, Tensor, None] = None, q_start: int = 0,
                    k_start: int = 0, cu_seqlens: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                    return_lse: bool = False):
    """Exact ALiBi attention: ``softmax(q k^T * scale - m_h |i - j|) v``, densely (float64-safe).

    Args:
        q: ``[B, Hq, nq, d]``; k, v: ``[B, Hkv, nk, d]`` / ``[B, Hkv, nk, dv]`` (Hq a multiple of Hkv).
        slopes: ``[Hq]`` ALiBi slopes ``m_h = 1 / sigma_h`` (see :func:`poslsh.alibi_slopes`).
        causal: mask keys after the query.
        scale: logit scale, default ``1 / sqrt(d)``.
        window: keep only keys with ``|i - j| <= window_h`` (an int or int ``[Hq]``): the oracle of
            :func:`poslsh.windowed_alibi_attention`; None: every key.
        q_start, k_start: positions of the first query and key (queries and keys at given
            positions need no equal lengths); default self-attention.
        cu_seqlens, document_ids: packed documents (self-attention): no weight across documents,
            see :mod:`poslsh.documents`.
        return_lse: also return the log-sum-exp ``[B, Hq, nq]`` of the biased logits.
    Returns:
        ``[B, Hq, nq, dv]`` (and the log-sum-exp). Dense ``O(nq nk)`` memory: a reference, not a fast path.
    """
    shape = check_qkv(q, k, v, any_lengths=True)
    docs = _documents(q, k, cu_seqlens, document_ids, q_start, k_start)
    win = make_window(slopes, 0 if window is None else window, shape.q_heads)
    qpos, kpos, same = _positions(q, k, q_start, k_start, docs)
    dist = (qpos[:, :, None] - kpos[:, None, :]).abs()[:, None]                     # [B|1, 1, nq, nk]
    bias = -win.slopes.to(q.device)[None, :, None, None] * dist                      # [B|1, H, nq, nk]
    allowed = same
    if window is not None:
        inside = dist <= win.window.to(q.device)[None, :, None, None]
        allowed = inside if allowed is None else allowed & inside
    if causal:
        qa = torch.arange(q_start, q_start + shape.seqlen, device=q.device)
        ka = torch.arange(k_start, k_start + shape.kv_len, device=q.device)
        later = _causal(qa, ka)[None, None]
        allowed = later if allowed is None else allowed & later
    return dense_attention(q, k, v, bias, allowed=allowed, scale=scale, return_lse=return_lse)


def poslsh_attention_reference(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *,
                               causal: bool = False, scale: Optional[float] = None, q_start: int = 0,
                               k_start: int = 0, cu_seqlens: Optional[Tensor] = None,
                               document_ids: Optional[Tensor] = None, return_lse: bool = False):
    """Approximate ALiBi attention with the mean mask ``M~`` (paper section 4), densely.

    ``T~_i = sum_k A_ik M~_ik v_k / sum_k A_ik M~_ik``, i.e. one softmax with the
    additive bias ``log(count_ik)`` where ``count_ik`` is the number of samples in
    which ``i`` and ``k`` share a block (``-inf`` where it is 0). Query row ``i`` is the
    token at position ``q_start + i`` and key row ``j`` the token at ``k_start + j``
    (self-attention by default; other positions need no equal lengths). Packed documents
    (``cu_seqlens`` / ``document_ids``): positions restart in every document and
    ``count_ij`` is 0 across documents. ``return_lse`` adds ``log sum_k count_ik e^{s_ik}``.
    """
    if q_start == 0 and k_start == 0 and q.shape[-2] == k.shape[-2] and cu_seqlens is None \
            and document_ids is None:
        shape = check_qkv(q, k, v)
        check_heads(partitions, shape.q_heads)
        count = partitions.to(q.device).dense_count(shape.seqlen).to(torch.float64)
        return dense_attention(q, k, v, torch.log(count), causal=causal, scale=scale, return_lse=return_lse)
    shape = check_qkv(q, k, v, any_lengths=True)
    check_heads(partitions, shape.q_heads)
    docs = _documents(q, k, cu_seqlens, document_ids, q_start, k_start)
    parts = partitions.to(q.device)
    qpos, kpos, same = _positions(q, k, q_start, k_start, docs)
    counts = []
    for qp, kp in zip(qpos, kpos):                                                   # batch rows (or one)
        lab_q, lab_k = (block_labels(parts.widths, parts.offsets, p) for p in (qp, kp))   # [H, s, P]
        counts.append((lab_q[..., :, None] == lab_k[..., None, :]).sum(1).to(torch.float64))   # [H, nq, nk]
    count = torch.stack(counts)                                                      # [B|1, H, nq, nk]
    if same is not None:
        count = count * same
    allowed = None
    if causal:
        qa = torch.arange(q_start, q_start + shape.seqlen, device=q.device)
        ka = torch.arange(k_start, k_start + shape.kv_len, device=q.device)
        allowed = _causal(qa, ka)[None, None]
    return dense_attention(q, k, v, torch.log(count), allowed=allowed, scale=scale, return_lse=return_lse)


# ----------------------------------------------------------------------------- N dimensions
# Oracles over token coordinates (paper section 5). Naming rule: the 1-D oracle's name with the
# suffix ``_nd`` takes coordinates ``[n, D]`` of any ``D`` (or a ``grid``); ``_2d`` (the op,
# :func:`poslsh.poslsh_attention_2d`) takes a 2-D grid only. *causal* over coordinates means raster
# (token) order: token ``i`` sees tokens ``j <= i``.
from .partitions_nd import PartitionsND, check_coords, check_grid, check_sigma_nd, expected_mask, grid_coords  # noqa: E402
from .widths import WidthDistribution  # noqa: E402

__all__ += ["coords_nd", "alibi_bias_nd", "alibi_matrix_nd", "alibi_attention_nd", "kernel_attention_nd",
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
    slope per head), ``[H, n, n]`` in ``dtype``. ``slopes``: ``[H]`` or per-axis ``[H, D]`` (``1 / sigma``).
    Built head by head and axis by axis in ``dtype``, so memory is the output plus two ``[n, n]``
    buffers (a 128 x 128 grid in float32: 4 GiB + 2 GiB)."""
    x = check_coords(coords)
    m = _slopes_nd(slopes, x.shape[1])
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


def alibi_attention_nd(q: Tensor, k: Tensor, v: Tensor, slopes, *, coords: Optional[Tensor] = None, grid=None,
                       causal: bool = False, scale: Optional[float] = None, return_lse: bool = False):
    """Exact N-D ALiBi attention ``softmax(q k^T * scale - m_h ||x_i - x_j||_1) v`` (the weights
    multiplied by ``L**``), densely.

    Args:
        q: ``[B, Hq, n, d]``; k, v: ``[B, Hkv, n, d]`` / ``[B, Hkv, n, dv]`` (``Hq`` a multiple of ``Hkv``).
        slopes: ``[Hq]`` or ``[Hq, D]`` slopes ``m = 1 / sigma``.
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
    with those widths estimates. ``sigma``: ``[Hq]`` or ``[Hq, D]``. Shapes as in
    :func:`alibi_attention_nd`; where ``L = 0`` (compact kernels) the key is masked."""
    shape = check_qkv(q, k, v)
    L = expected_mask(coords_nd(shape.seqlen, coords, grid), sigma, widths).to(q.device)
    if L.shape[0] != shape.q_heads:
        raise ValueError(f"got {L.shape[0]} bandwidths for {shape.q_heads} query heads")
    return dense_attention(q, k, v, torch.log(L), allowed=L > 0, causal=causal, scale=scale, return_lse=return_lse)


def poslsh_attention_reference_nd(q: Tensor, k: Tensor, v: Tensor, partitions: PartitionsND, *,
                                  coords: Optional[Tensor] = None, grid=None, causal: bool = False,
                                  scale: Optional[float] = None, return_lse: bool = False):
    """The positional-LSH estimator with the mean box mask ``M~``, densely (the float64 oracle of
    :func:`poslsh.poslsh_attention_2d`).

    ``T~_i = sum_t sum_{j in box_t(i)} e^{s_ij} v_j / sum_t sum_{j in box_t(i)} e^{s_ij}``: one
    softmax with the bias ``log count_ij`` (``count_ij`` = samples in which ``i`` and ``j`` share a
    box on every axis; ``-inf`` where 0); ``return_lse`` adds ``log sum_j count_ij e^{s_ij}``.
    Shapes as in :func:`alibi_attention_nd`; ``partitions`` has ``Hq`` heads and ``D`` = the
    coordinates' axes.
    """
    if not isinstance(partitions, PartitionsND):
        raise TypeError(f"partitions must be a poslsh.PartitionsND, got {type(partitions).__name__}")
    shape = check_qkv(q, k, v)
    check_heads(partitions, shape.q_heads)
    x = coords_nd(shape.seqlen, coords, grid)
    count = partitions.to(q.device).dense_count(x.to(q.device)).to(torch.float64)
    return dense_attention(q, k, v, torch.log(count), causal=causal, scale=scale, return_lse=return_lse)
