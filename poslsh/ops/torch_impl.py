"""Portable near-linear positional-LSH attention in plain PyTorch (CPU and CUDA).

The estimator (paper section 4) is
``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
= ``sum_k count_ik e^{s_ik} v_k / sum_k count_ik e^{s_ik}``, where ``count_ik`` is
the number of samples in which ``i`` and ``k`` share a block: one softmax with
weights multiplied by ``count`` (bias ``log count``), so every score is computed
once, not once per sample.

Work is cut into *query tiles* of ``T`` rows of one head. The blocks containing
a row are contiguous and their starts/ends are non-decreasing along the
sequence, so the union of all samples' blocks touching a tile is one key range
``[lo, hi)``; tiles are grouped by padded range width and each group is a single
batched matmul over all heads and tiles (no Python loop over heads x samples).
``count`` for a tile is built with a difference array: +1 at each row's block
start and -1 at its end, then a cumulative sum, i.e. ``O(s)`` scatters per row
plus one pass, instead of ``s`` comparisons per score; rows whose blocks agree in
every sample share one count row, and the causal mask is applied separately.
Rows are owned by exactly one tile, so outputs are written once.

Queries and keys need not be the same positions (:class:`Span`): query row ``i``
sits at position ``q_start + i`` and key row ``j`` at ``k_start + j`` of a
sequence of ``seq_len`` tokens, which is what decoding against a KV cache and
context parallelism (a shard's queries against its halo and shard of keys) need.
The keys must cover every key the queries can see; the op checks it.

Backward is flash-attention 2's with the count-weighted probabilities,
recomputed tile by tile from the saved ``lse``: memory ``O(n (d + s))`` plus one
bounded chunk, never an ``n x n`` tensor. Both directions are ``torch.library``
custom ops (see the end of this file).
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validation import AttnShape, compute_dtype
from ..partitions import Partitions
from ..threads import intra_op_threads
from .torch_plan import RowBounds, Span, TileGroup, choose_tiles, iter_chunks, plan_tiles, row_bounds
from .registry import register_backend

def gather_rows(x: Tensor, idx: Tensor, units: int, size: int) -> Tensor:
    """Rows ``idx`` of ``x [B, R, d]`` as ``[B, units, size, d]``. ``F.embedding`` is
    the fastest row gather on CPU (about 3x ``index_select`` along dim 1)."""
    B, rows, d = x.shape
    if B > 1:
        idx = (idx[None] + rows * torch.arange(B, device=idx.device)[:, None]).reshape(-1)
    return F.embedding(idx, x.reshape(B * rows, d)).view(B, units, size, d)


def flat_rows(x: Tensor, ct: torch.dtype) -> Tensor:
    B, H, n, d = x.shape
    return x.to(ct).reshape(B, H * n, d)


def _biased_scores(Qg: Tensor, Kg: Tensor, log_count: Tensor, scale: float) -> Tensor:
    """``scale * Q K^T + log count`` as ``[B, U, T, R]`` (-inf where no sample shares a block).
    Consumes ``log_count`` (with one batch the matmul accumulates into it in place)."""
    if Qg.shape[0] == 1:
        return log_count.baddbmm_(Qg[0], Kg[0].transpose(-1, -2), alpha=scale)[None]
    return torch.matmul(Qg, Kg.transpose(-1, -2)).mul_(scale).add_(log_count)


def forward(q: Tensor, k: Tensor, v: Tensor, groups: List[TileGroup], bounds: RowBounds, shape: AttnShape,
            scale: float, need_lse: bool = True) -> Tuple[Tensor, Tensor]:
    """Returns ``out [B, Hq, n, dv]`` (in ``q.dtype``) and ``lse [B, Hq, n]`` (float32/64;
    left uninitialised when ``need_lse`` is False)."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    qf, kf, vf = flat_rows(q, ct), flat_rows(k, ct), flat_rows(v, ct)
    out = torch.empty(B, Hq * n + 1, shape.v_dim, dtype=ct, device=q.device)   # + sink row
    lse = torch.empty(B, Hq * n + 1, dtype=ct, device=q.device)
    for c in iter_chunks(groups, bounds, shape, ct):
        Qg = gather_rows(qf, c.rows, c.units, c.tile)
        Kg = gather_rows(kf, c.kv_rows, c.units, c.width)
        Vg = gather_rows(vf, c.kv_rows, c.units, c.width)
        s = _biased_scores(Qg, Kg, c.log_count, scale)
        # Each query shares a block with itself in every sample: no row is all -inf.
        if need_lse:
            lse.index_copy_(1, c.out_rows, torch.logsumexp(s, -1).reshape(B, -1))
        o = torch.matmul(torch.softmax(s, -1), Vg)
        out.index_copy_(1, c.out_rows, o.reshape(B, -1, shape.v_dim))
    return out[:, :-1].view(B, Hq, n, shape.v_dim).to(q.dtype), lse[:, :-1].view(B, Hq, n)


def tiled_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, chunks: Iterable,
                   shape: AttnShape, scale: float, probabilities: Callable) -> Tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward over ``chunks`` (anything with ``rows, out_rows, kv_rows,
    units, tile, width``), shared by the 1-D and 2-D torch ops; ``probabilities(Qg, Kg, chunk,
    lse_g) -> p [B, U, T, R]`` recomputes a chunk's weights from the saved ``lse``.

    ``delta_i = sum_k P_ik dP_ik`` (flash-attention's ``rowsum(dO * O)``) is computed from
    the recomputed probabilities in the compute dtype: a row's whole key range lies in
    one tile, and the output rounded to 16 bits would cost low-precision gradients
    most of their accuracy."""
    B, Hq, Hkv, n, nk = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, k.shape[2]
    ct = compute_dtype(q.dtype)
    qf, kf, vf = flat_rows(q, ct), flat_rows(k, ct), flat_rows(v, ct)
    zero_row = torch.zeros(B, 1, shape.v_dim, dtype=ct, device=q.device)
    # Rows past n read the sink row: dO = 0 and lse = +inf, so their probabilities
    # are exactly 0 and they add nothing to dk, dv (no inf * 0).
    dof = torch.cat([flat_rows(dout, ct), zero_row], 1)
    lse_f = torch.cat([lse.reshape(B, Hq * n).to(ct), torch.full_like(zero_row[..., 0], float("inf"))], 1)
    dq = torch.zeros(B, Hq * n + 1, shape.head_dim, dtype=ct, device=q.device)
    dk = torch.zeros(B, Hkv * nk, shape.head_dim, dtype=ct, device=q.device)
    dv = torch.zeros(B, Hkv * nk, shape.v_dim, dtype=ct, device=q.device)
    for c in chunks:
        U, T, R = c.units, c.tile, c.width
        Qg = gather_rows(qf, c.rows, U, T)
        Kg = gather_rows(kf, c.kv_rows, U, R)
        Vg = gather_rows(vf, c.kv_rows, U, R)
        dOg = gather_rows(dof, c.out_rows, U, T)
        p = probabilities(Qg, Kg, c, lse_f.index_select(1, c.out_rows).view(B, U, T, 1))
        dv.index_add_(1, c.kv_rows, torch.matmul(p.transpose(-1, -2), dOg).reshape(B, U * R, -1))
        dp = torch.matmul(dOg, Vg.transpose(-1, -2))
        ds = dp.sub_((p * dp).sum(-1, keepdim=True)).mul_(p)
        dq.index_add_(1, c.out_rows, torch.matmul(ds, Kg).mul_(scale).reshape(B, U * T, -1))
        dk.index_add_(1, c.kv_rows, torch.matmul(ds.transpose(-1, -2), Qg).mul_(scale).reshape(B, U * R, -1))
    return dq[:, :-1].reshape(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor,
             groups: List[TileGroup], bounds: RowBounds, shape: AttnShape, scale: float):
    """Gradients ``dq, dk, dv`` by tile-wise recomputation with the saved ``lse``."""
    def probabilities(Qg, Kg, c, lse_g):
        return torch.exp_(_biased_scores(Qg, Kg, c.log_count, scale).sub_(lse_g))

    chunks = iter_chunks(groups, bounds, shape, compute_dtype(q.dtype))
    return tiled_backward(dout, q, k, v, lse, chunks, shape, scale, probabilities)


# Query rows per head up to which one dense pass over each head's key range beats the tile
# plan (decoding steps: the plan's per-group launches cost ~0.5 ms per layer per token).
FEW_QUERIES = 16


def few_queries_forward(q: Tensor, k: Tensor, v: Tensor, bounds: RowBounds, shape: AttnShape,
                        scale: float) -> Tuple[Tensor, Tensor]:
    """The forward for a few query rows (``n <= FEW_QUERIES``): every head's rows against the
    union of their blocks, counts by comparing with the rows' block bounds. ``O(H n R (d + s))``
    for key ranges of ``R`` keys, no tile plan. Same ``out``/``lse`` as :func:`forward`."""
    Hq, n = shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    start, end = bounds.start, bounds.end                                     # [H, n, s] key rows
    dev = start.device
    rows = torch.arange(n, device=dev) + bounds.delta                         # the queries as key rows
    lo = start.amin(dim=(1, 2))                                               # [H]
    hi = end.amax(dim=(1, 2))
    if bounds.causal:
        hi = torch.clamp(hi, max=int(rows[-1]) + 1)
    R = max(1, int((hi - lo).max()))
    cols = lo[:, None] + torch.arange(R, device=dev)                          # [H, R]
    inside = (start[..., None] <= cols[:, None, None, :]) & (cols[:, None, None, :] < end[..., None])
    count = inside.sum(2)                                                     # [H, n, R]
    keep = (count > 0) & (cols < hi[:, None])[:, None, :]
    if bounds.causal:
        keep &= cols[:, None, :] <= rows[None, :, None]
    bias = torch.where(keep, count.to(ct).log(), torch.full((), float("-inf"), dtype=ct, device=dev))
    kv = (torch.arange(Hq, device=dev) // shape.group)[:, None]               # [H, 1] kv head of each head
    idx = cols.clamp(max=shape.kv_len - 1)
    K, V = k.to(ct)[:, kv, idx], v.to(ct)[:, kv, idx]                         # [B, H, R, d]
    scores = torch.matmul(q.to(ct), K.transpose(-1, -2)).mul_(scale).add_(bias)
    return torch.matmul(torch.softmax(scores, -1), V).to(q.dtype), torch.logsumexp(scores, -1)


# ------------------------------------------------------------------ custom ops
# The backend is a pair of torch.library custom ops, like the Triton kernels: the
# partitions travel as their two float64 tensors, everything derived from them is
# built inside, so torch.compile(fullgraph=True) sees one opaque op per direction
# (the plan has data-dependent shapes) and autograd saves only tensors.
FWD_NAME = "poslsh::torch_attention_fwd"
BWD_NAME = "poslsh::torch_attention_bwd"


def _shape(q: Tensor, k: Tensor, v: Tensor) -> AttnShape:
    B, Hq, n, d = q.shape
    return AttnShape(B, Hq, k.shape[1], n, d, v.shape[-1], k.shape[2])


def _span(q: Tensor, k: Tensor, positions: List[int]) -> Span:
    q_start, k_start, seq_len = positions
    return Span(q_start, k_start, q.shape[2], k.shape[2], seq_len)


def _groups(widths: Tensor, bounds: RowBounds, n: int) -> List[TileGroup]:
    return plan_tiles(bounds, n, choose_tiles(widths, n).to(bounds.start.device))


@torch.library.custom_op(FWD_NAME, mutates_args=())
def torch_attention_fwd(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, causal: bool,
                        scale: float, need_lse: bool, positions: List[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype), ``lse [B, Hq, n]`` (float32, float64 for float64 input;
    unset unless ``need_lse``) and the query rows' block bounds ``start, end`` (int64
    ``[H, n, s]``, key rows) that the backward reuses. ``positions`` is
    ``[q_start, k_start, seq_len]`` (:class:`Span`)."""
    shape = _shape(q, k, v)
    bounds = row_bounds(Partitions(widths, offsets), _span(q, k, positions), causal, q.device)
    # The kernel picks its own precision (float32/64 accumulation); autocast
    # would turn its matmuls into bf16 and break the float32 buffers.
    with torch.autocast(q.device.type, enabled=False):
        if shape.seqlen <= FEW_QUERIES:
            out, lse = few_queries_forward(q, k, v, bounds, shape, scale)
        else:
            out, lse = forward(q, k, v, _groups(widths, bounds, shape.seqlen), bounds, shape, scale, need_lse)
    return out.contiguous(), lse.contiguous(), bounds.start, bounds.end


@torch_attention_fwd.register_fake
def _(q, k, v, widths, offsets, causal, scale, need_lse, positions):
    B, Hq, n, _ = q.shape
    H, s = widths.shape
    return (q.new_empty(B, Hq, n, v.shape[-1]), q.new_empty(B, Hq, n, dtype=compute_dtype(q.dtype)),
            widths.new_empty(H, n, s, dtype=torch.int64), widths.new_empty(H, n, s, dtype=torch.int64))


@torch.library.custom_op(BWD_NAME, mutates_args=())
def torch_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, start: Tensor, end: Tensor,
                        widths: Tensor, causal: bool, scale: float,
                        positions: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` (contiguous, dtypes of q, k, v) by tile-wise recomputation."""
    shape = _shape(q, k, v)
    bounds = RowBounds(start, end, causal, _span(q, k, positions).delta)
    with torch.autocast(q.device.type, enabled=False):
        groups = _groups(widths, bounds, shape.seqlen)
        dq, dk, dv = backward(dout.contiguous(), q, k, v, lse, groups, bounds, shape, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@torch_attention_bwd.register_fake
def _(dout, q, k, v, lse, start, end, widths, causal, scale, positions):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, widths, offsets, causal, scale, _, positions = inputs
    out, lse, start, end = output
    ctx.save_for_backward(q, k, v, lse, start, end, widths)
    ctx.causal, ctx.scale, ctx.positions = causal, scale, tuple(positions)
    ctx.mark_non_differentiable(lse, start, end)


def _backward(ctx, dout, dlse, dstart, dend):
    q, k, v, lse, start, end, widths = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True (gradient penalties, Hessian-vector products): differentiate a
        # recomputation traced by autograd, so the gradients are differentiable in turn.
        # Same tiles, no n x n tensor, but autograd keeps every chunk's scores alive.
        shape = _shape(q, k, v)
        bounds = RowBounds(start, end, ctx.causal, _span(q, k, list(ctx.positions)).delta)
        with torch.autocast(q.device.type, enabled=False):
            out, _ = forward(q, k, v, _groups(widths, bounds, shape.seqlen), bounds, shape, ctx.scale, False)
        wanted = [x for x in (q, k, v) if x.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, dout, create_graph=True, allow_unused=True))
        grads = [next(got) if x.requires_grad else None for x in (q, k, v)]
        return (*grads, None, None, None, None, None, None)
    args = (dout, q, k, v, lse, start, end, widths, ctx.causal, ctx.scale, list(ctx.positions))
    if not torch.compiler.is_compiling() and _single_thread(q):
        with intra_op_threads(1):
            dq, dk, dv = torch_attention_bwd(*args)
    else:
        dq, dk, dv = torch_attention_bwd(*args)
    return dq, dk, dv, None, None, None, None, None, None


torch_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# On a CPU shared with other work, one intra-op thread for the call. A call is hundreds of
# parallel regions; when the cores are oversubscribed each region's barrier waits for a
# descheduled thread. Measured at n = 16384 (H = 4, s = 10) under 2 x 2 matmul threads on 2
# cores: 1 thread 0.67 s, 2 threads 1.2-1.7 s (quiet: 0.27 s and 0.14 s). Set to False to keep
# torch's thread count always.
SINGLE_THREAD_WHEN_BUSY = True


def cpu_oversubscribed() -> bool:
    """Other work wants the cores: more runnable threads right now than cores plus our own
    (``/proc/loadavg``'s runnable count; the caller and one spinning worker allowed). Off
    Linux, a one-minute load average above the core count."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return int(fields[3].split("/")[0]) > cores + 1
    except (OSError, ValueError, IndexError):     # not Linux: the load average alone
        try:
            return os.getloadavg()[0] > cores + 0.5
        except OSError:
            return False


def attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, shape: AttnShape, causal: bool,
              scale: float, span: Optional[Span] = None) -> Tensor:
    """Positional-LSH attention on the torch backend; ``span`` places the queries
    and keys in the sequence (default: self-attention)."""
    span = span or Span.self_attention(shape.seqlen)
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    args = (q, k, v, partitions.widths, partitions.offsets, bool(causal), float(scale), need_lse,
            [span.q_start, span.k_start, span.seq_len])
    if not torch.compiler.is_compiling() and _single_thread(q):
        with intra_op_threads(1):
            return torch_attention_fwd(*args)[0]
    return torch_attention_fwd(*args)[0]


def _single_thread(q: Tensor) -> bool:
    return (SINGLE_THREAD_WHEN_BUSY and q.device.type == "cpu" and torch.get_num_threads() > 1
            and cpu_oversubscribed())


def _sequence(call):
    """The registry's entry (``backend="torch"``, op ``"sequence"``)."""
    return attention(call.q, call.k, call.v, call.positional, call.shape, call.causal, call.scale, call.span), None


register_backend("torch", _sequence, op="sequence", features=("spans",), preferred=lambda q: True, priority=0)
