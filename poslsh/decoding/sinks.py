"""Sink keys of a per-head window store: the first ``k`` positions of every row, kept beside the rings and
attended with their ALiBi bias wherever they fall outside a head's window (inside it, the ring holds them);
merged with the window's attention through the log-sum-exp (:func:`poslsh.merge_attention`)."""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ..merge import merge_attention

__all__ = ["sink_attention"]


def sink_attention(store, q: Tensor, out: Tensor, lse: Tensor, p0: int, scale: float) -> Tuple[Tensor, Tensor]:
    """Merge in the sink keys a query sees outside its window (own positions ``j < sinks``, ``j <= own - w - 1``)."""
    nq = q.shape[2]
    own = store._own(p0, nq)[..., None]                                             # [B, 1, nq, 1]
    j = torch.arange(store.sinks, device=store.device)
    have = (j[None] < torch.tensor(store.sink_n, device=store.device)[:, None])[:, None, None]   # [B,1,1,k]
    win = store.effective_windows(p0, nq)[None, :, :, None]                         # [1, Hq, nq, 1]
    dist = own - j
    seen = have & (dist > win)
    sk = store.sink_k.repeat_interleave(store.r, 1)
    sv = store.sink_v.repeat_interleave(store.r, 1)
    bias = (-store.slopes.to(store.device, q.dtype))[None, :, None, None] * dist.to(q.dtype)
    s = (torch.matmul(q, sk.transpose(-1, -2)) * scale + bias).masked_fill(~seen, -math.inf)
    ls = torch.logsumexp(s, -1)
    os_ = torch.matmul(torch.softmax(s.masked_fill(~seen.any(-1, keepdim=True), 0), -1), sv)
    merged, lse_all = merge_attention([out, os_], [lse.to(ls.dtype), ls])
    return merged.to(out.dtype), lse_all

