"""Exact attention dense per chunk of queries, for what the near-linear ops do not do: dropout on the
attention probabilities in training, and a few rows at irregular positions (a masked query, a row whose
padding has a gap). Shared by the ALiBi decoders (:mod:`.alibi`) and encoders (:mod:`.encoders`).

``O(chunk nk)`` memory per chunk of :data:`CHUNK` queries; each chunk is recomputed in the backward with
the same dropout mask (``torch.utils.checkpoint`` keeps the RNG state), so training memory stays that of
one chunk. Time is ``O(nq nk)``: a training path for the rows models read, not a fast path.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...positional import Positional

__all__ = ["CHUNK", "chunked_attention"]

CHUNK = 256                      # query rows per chunk


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, positional: Positional, scale: float, q_pos: Tensor,
                      k_pos: Tensor, q_idx: Optional[Tensor] = None, k_idx: Optional[Tensor] = None,
                      key_ok: Optional[Tensor] = None, p: float = 0.0) -> Tensor:
    """Exact attention of ``q [B, Hq, nq, d]`` to ``k, v [B, Hkv, nk, d]`` with the positional object's dense
    bias between ``q_pos [nq]`` and ``k_pos [nk]`` (``-inf`` where it sees no key), causal in the indices
    ``k_idx <= q_idx`` when both are given (else every key), keys ``key_ok [nk]`` only, and dropout ``p`` on
    the probabilities (training). ``[B, Hq, nq, dv]``; a query with no key gives 0."""
    from torch.utils.checkpoint import checkpoint

    B, Hq, nq, _ = q.shape
    k = k.repeat_interleave(Hq // k.shape[1], dim=1) if k.shape[1] != Hq else k
    v = v.repeat_interleave(Hq // v.shape[1], dim=1) if v.shape[1] != Hq else v
    dev = q.device
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    ok = None if key_ok is None else key_ok.to(dev)
    causal = q_idx is not None and k_idx is not None

    def chunk(qc: Tensor, c0: int) -> Tensor:
        c1 = c0 + qc.shape[2]
        bias = positional.dense_bias(q_pos[c0:c1].to(dev), k_pos.to(dev)).to(dt)        # [H, c, nk], -inf outside
        allowed = None
        if causal:
            allowed = k_idx.to(dev)[None, :] <= q_idx[c0:c1].to(dev)[:, None]
        if ok is not None:
            allowed = ok[None, :] if allowed is None else allowed & ok[None, :]
        s = torch.einsum("bhid,bhjd->bhij", qc.to(dt), k.to(dt)) * scale + bias
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        w = torch.softmax(s, -1).nan_to_num(0.0)
        if p > 0:
            w = torch.nn.functional.dropout(w, p=p, training=True)
        return torch.einsum("bhij,bhjd->bhid", w, v.to(dt)).to(q.dtype)

    outs = [checkpoint(chunk, q[:, :, c0:c0 + CHUNK], c0, use_reentrant=False) if torch.is_grad_enabled()
            else chunk(q[:, :, c0:c0 + CHUNK], c0) for c0 in range(0, nq, CHUNK)]
    return torch.cat(outs, 2) if outs else q.new_zeros(B, Hq, 0, v.shape[-1])
