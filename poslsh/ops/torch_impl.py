"""Portable near-linear positional-LSH attention in plain PyTorch (CPU and CUDA).

The estimator (paper section 4) is
``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``:
a sum of numerators over a sum of denominators across the ``s`` samples. We
compute it as an online log-sum-exp merge of short block attentions:

* The work is a list of padded *units* (see :mod:`poslsh.ops.schedule`); one
  chunk of same-size units is a single batched matmul, however many heads and
  samples it spans.
* Every unit returns a row max ``m``, a row sum ``l`` and an unnormalised output;
  they are merged into per-position accumulators with ``scatter_reduce``/
  ``index_add_`` (flash-attention's rescaling, done per position, not per tile).
* Backward recomputes the scores chunk by chunk from the saved ``out`` and the
  merged ``lse`` (flash-attention 2's backward with the global normaliser), so
  memory stays ``O(n (d + s))`` plus one bounded chunk: no ``n x n`` tensor.
"""
from __future__ import annotations

from typing import Iterator, List, NamedTuple, Tuple

import torch
from torch import Tensor

from .._validation import AttnShape, compute_dtype
from .schedule import UnitGroup

# Score elements (batch x units x size x size) per chunk: bounds transient memory
# (a few such buffers live at once) while keeping batched matmuls large.
CHUNK_ELEMENTS = 1 << 22


class Chunk(NamedTuple):
    """Index tensors for one chunk of units of equal padded size."""

    q_idx: Tensor     # [U*P] flat index into [Hq*n] rows (padding rows clamped to a valid row)
    out_idx: Tensor   # [U*P] same, but padding rows point to the sink row Hq*n
    kv_idx: Tensor    # [U*P] flat index into [Hkv*n] rows (padding clamped)
    q_valid: Tensor   # [U, P] bool
    mask: Tensor      # [U, P, P] bool, True where the key is attended
    units: int
    size: int


def iter_chunks(groups: List[UnitGroup], shape: AttnShape, causal: bool, device) -> Iterator[Chunk]:
    n, Hq, group = shape.seqlen, shape.q_heads, shape.group
    for g in groups:
        P = g.size
        per_chunk = max(1, CHUNK_ELEMENTS // (shape.batch * P * P))
        ar = torch.arange(P, device=device)
        for lo in range(0, len(g), per_chunk):
            sl = slice(lo, lo + per_chunk)
            head, qs, ql, ks, kl = (t[sl].to(device) for t in (g.head, g.q_start, g.q_len, g.k_start, g.k_len))
            qpos = qs[:, None] + ar
            kpos = ks[:, None] + ar
            q_valid = ar < ql[:, None]
            k_valid = ar < kl[:, None]
            mask = k_valid[:, None, :].expand(-1, P, -1)
            if causal:
                mask = mask & (kpos[:, None, :] <= qpos[:, :, None])
            qrow = head[:, None] * n + torch.minimum(qpos, (qs + ql - 1)[:, None])
            out_idx = torch.where(q_valid, qrow, torch.full_like(qrow, Hq * n))
            kvrow = (head // group)[:, None] * n + torch.minimum(kpos, (ks + kl - 1)[:, None])
            yield Chunk(qrow.reshape(-1), out_idx.reshape(-1), kvrow.reshape(-1), q_valid,
                        mask.contiguous(), head.numel(), P)


def _gather(x: Tensor, idx: Tensor, units: int, size: int) -> Tensor:
    """Rows ``idx`` of ``x [B, R, d]`` as ``[B, units, size, d]``."""
    return x.index_select(1, idx).view(x.shape[0], units, size, x.shape[-1])


def _flat(x: Tensor, ct: torch.dtype) -> Tensor:
    B, H, n, d = x.shape
    return x.to(ct).reshape(B, H * n, d)


def forward(q: Tensor, k: Tensor, v: Tensor, groups: List[UnitGroup], shape: AttnShape,
            causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """Returns ``out [B, Hq, n, dv]`` (in ``q.dtype``) and ``lse [B, Hq, n]`` (float32/64)."""
    B, Hq, n = shape.batch, shape.q_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    qf, kf, vf = _flat(q, ct), _flat(k, ct), _flat(v, ct)
    rows = Hq * n + 1                      # + a sink row that absorbs padding rows
    acc = torch.zeros(B, rows, shape.v_dim, dtype=ct, device=q.device)
    l_run = torch.zeros(B, rows, dtype=ct, device=q.device)
    m_run = torch.full((B, rows), float("-inf"), dtype=ct, device=q.device)
    for c in iter_chunks(groups, shape, causal, q.device):
        Qg = _gather(qf, c.q_idx, c.units, c.size)
        Kg = _gather(kf, c.kv_idx, c.units, c.size)
        Vg = _gather(vf, c.kv_idx, c.units, c.size)
        s = torch.matmul(Qg, Kg.transpose(-1, -2)).mul_(scale)
        s.masked_fill_(~c.mask, float("-inf"))
        m = s.amax(-1)                                         # finite: every row sees a key
        p = torch.exp_(s.sub_(m[..., None]))
        l = p.sum(-1)
        o = torch.matmul(p, Vg)
        # Online merge per position: rescale the accumulators to the new running max.
        m_flat = m.reshape(B, -1)
        idx = c.out_idx.expand(B, -1)
        m_new = m_run.scatter_reduce(1, idx, m_flat, reduce="amax", include_self=True)
        alpha = torch.exp(m_run - m_new).nan_to_num_(0.0)       # -inf - -inf rows: nothing yet
        acc.mul_(alpha[..., None])
        l_run.mul_(alpha)
        w = torch.exp(m_flat - m_new.gather(1, idx))
        acc.index_add_(1, c.out_idx, o.reshape(B, -1, shape.v_dim) * w[..., None])
        l_run.index_add_(1, c.out_idx, l.reshape(B, -1) * w)
        m_run = m_new
    out = (acc[:, :-1] / l_run[:, :-1, None]).view(B, Hq, n, shape.v_dim)
    lse = (m_run[:, :-1] + torch.log(l_run[:, :-1])).view(B, Hq, n)
    return out.to(q.dtype), lse


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             groups: List[UnitGroup], shape: AttnShape, causal: bool, scale: float):
    """Gradients ``dq, dk, dv`` by chunked recomputation with the global ``lse``."""
    B, Hq, Hkv, n = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen
    ct = compute_dtype(q.dtype)
    qf, kf, vf = _flat(q, ct), _flat(k, ct), _flat(v, ct)
    dof = _flat(dout, ct)
    delta = (dof * _flat(out, ct)).sum(-1)                     # [B, Hq*n]
    lse_f = lse.reshape(B, Hq * n).to(ct)
    dq = torch.zeros(B, Hq * n, shape.head_dim, dtype=ct, device=q.device)
    dk = torch.zeros(B, Hkv * n, shape.head_dim, dtype=ct, device=q.device)
    dv = torch.zeros(B, Hkv * n, shape.v_dim, dtype=ct, device=q.device)
    for c in iter_chunks(groups, shape, causal, q.device):
        U, P = c.units, c.size
        Qg = _gather(qf, c.q_idx, U, P)
        Kg = _gather(kf, c.kv_idx, U, P)
        Vg = _gather(vf, c.kv_idx, U, P)
        dOg = _gather(dof, c.q_idx, U, P)
        lse_g = lse_f.index_select(1, c.q_idx).view(B, U, P, 1)
        delta_g = delta.index_select(1, c.q_idx).view(B, U, P, 1)
        s = torch.matmul(Qg, Kg.transpose(-1, -2)).mul_(scale)
        keep = c.mask & c.q_valid[:, :, None]                   # padding rows must not leak into dk/dv
        s.masked_fill_(~keep, float("-inf"))
        p = torch.exp_(s.sub_(lse_g))
        dv.index_add_(1, c.kv_idx, torch.matmul(p.transpose(-1, -2), dOg).reshape(B, U * P, -1))
        ds = torch.matmul(dOg, Vg.transpose(-1, -2)).sub_(delta_g).mul_(p).mul_(scale)
        dq.index_add_(1, c.q_idx, torch.matmul(ds, Kg).reshape(B, U * P, -1))
        dk.index_add_(1, c.kv_idx, torch.matmul(ds.transpose(-1, -2), Qg).reshape(B, U * P, -1))
    return (dq.view_as(q).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype))


class PoslshTorchFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``q, k, v, out, lse``; backward recomputes."""

    @staticmethod
    def forward(ctx, q, k, v, groups, shape, causal, scale):
        out, lse = forward(q, k, v, groups, shape, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (groups, shape, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, *ctx.meta)
        return dq, dk, dv, None, None, None, None
