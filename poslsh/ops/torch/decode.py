"""The window op's forward for a few query rows (decoding steps) on the torch backend: views of the keys,
no gather, no per-key bookkeeping beyond the bias.

Query row ``i`` is key row ``r_i = i + delta``; head ``h`` (slope ``m_h``, window ``w_h``) sees the key rows
``|r_i - c| <= w_h`` (and ``c <= r_i`` when causal) with the bias ``-m_h |r_i - c|``. For ``n`` rows these
lie in one contiguous key range per head, so per KV head ``j`` the union over its query heads,
``[lo_j, hi_j)``, is a *slice* of ``k`` and ``v``:

* when every KV head has the same range (exact ALiBi: every key; or one window for all) the step is one
  batched matmul ``[B, Hkv, g n, d] @ [B, Hkv, d, R]`` over a view of the keys (the query heads of a KV head
  as ``g n`` rows of one product; ``g = Hq / Hkv``); otherwise one per KV head, each over its own slice;
* the bias is ``-m_h`` times one ``[n, R]`` distance table (an ``arange`` per range), ``-inf`` only where a
  key lies outside a head's window or after its query, and masked only when some key does;
* one softmax and ``P V`` per call; the lse (when asked) ``max_j s_ij - log max_j p_ij``, no second exp pass.

Nothing of the size of the keys is copied when the keys are a view of a larger buffer whose batch and head
axes merge (a cache that appends in place: ``[B, Hkv, capacity, d][:, :, :nk]``, or any contiguous tensor);
``k.to`` the compute dtype copies the range for 16-bit keys (float32 arithmetic). Cost: the arithmetic,
``O(B Hq n R (d + dv))``, and ``O(Hq n R)`` for the bias and softmax. The general few-queries path of
:mod:`.kernels` (any positional kind, packed documents) gathers every head's keys and counts samples.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
from torch import Tensor

from ..._validation import AttnShape, compute_dtype

__all__ = ["forward", "key_ranges"]


def key_ranges(windows: List[int], group: int, nk: int, n: int, delta: int, causal: bool) -> List[Tuple[int, int]]:
    """Per KV head the key rows ``[lo, hi)`` its query heads' ``n`` rows can see (the union of their windows,
    clipped to the ``nk`` keys; at least one row, so a call is never empty)."""
    first, last = delta, delta + n - 1
    out = []
    for j in range(len(windows) // group):
        w = max(windows[j * group:(j + 1) * group])
        lo = max(0, first - w)
        hi = min(nk, last + 1 if causal else last + w + 1)
        lo = min(lo, max(nk - 1, 0))
        out.append((lo, max(hi, lo + 1)))
    return out


def _bias(slopes: Tensor, windows: List[int], lo: int, hi: int, n: int, delta: int, causal: bool, ct,
          device) -> Tensor:
    """``[h, n, R]``: ``-m_h |r_i - c|`` for key rows ``c`` in ``[lo, hi)``, ``-inf`` outside the window or after
    the query (causal)."""
    dist = (torch.arange(delta, delta + n, device=device)[:, None] - torch.arange(lo, hi, device=device)[None])
    far = max(delta + n - 1 - lo, hi - 1 - delta)                     # the largest |r_i - c| (a corner)
    bias = dist.abs().to(ct)[None] * (-slopes.to(device=device, dtype=ct))[:, None, None]
    cut = [w < far for w in windows]
    if any(cut):
        w = torch.tensor(windows, device=device)[:, None, None]
        bias = bias.masked_fill_(dist.abs()[None] > w, -math.inf)
    if causal and hi - 1 > delta:
        bias = bias.masked_fill_((dist < 0)[None], -math.inf)
    return bias


def _heads(x: Tensor, j0: int, j1: int, lo: int, hi: int) -> Tensor:
    """``x [B, Hkv, nk, e]`` rows ``[lo, hi)`` of heads ``[j0, j1)`` as ``[B * J, R, e]``: a view when the batch and
    head axes merge (all heads of a buffer laid out ``[B, Hkv, ...]``, or one head)."""
    part = x[:, j0:j1, lo:hi]
    B, J, R, e = part.shape
    if J == 1:
        return part.squeeze(1) if B > 1 else part[0]
    return part.reshape(B * J, R, e)          # a view: the caller passes all heads of a [B, Hkv, ...] layout


def forward(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, windows: Tensor, shape: AttnShape, scale: float,
            causal: bool, delta: int, need_lse: bool = True) -> Tuple[Tensor, Tensor]:
    """The window op for ``q [B, Hq, n, d]`` (few rows) against ``k [B, Hkv, nk, d]``, ``v [B, Hkv, nk, dv]``
    (any strides along the keys; query row ``i`` is key row ``i + delta``), ``slopes [Hq]`` (compute-dtype
    values), ``windows [Hq]``: ``out [B, Hq, n, dv]`` (``q.dtype``) and ``lse [B, Hq, n]`` (compute dtype; left
    uninitialised when ``need_lse`` is False). The same bias as the tiled forward."""
    B, Hq, n, d = q.shape
    Hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = Hq // Hkv
    ct = compute_dtype(q.dtype)
    dev = q.device
    wins = [int(x) for x in windows.clamp(max=nk + abs(delta) + n).tolist()]
    ranges = key_ranges(wins, g, nk, n, delta, causal)
    qg = q.to(ct).reshape(B, Hkv, g * n, d)
    kc, vc = k.to(ct), v.to(ct)
    if all(r == ranges[0] for r in ranges):
        runs = [(0, Hkv, *ranges[0])]
    else:
        runs = [(j, j + 1, lo, hi) for j, (lo, hi) in enumerate(ranges)]
    outs, lses = [], []
    for j0, j1, lo, hi in runs:
        J, R = j1 - j0, hi - lo
        heads = slice(j0 * g, j1 * g)
        bias = _bias(slopes[heads], wins[heads], lo, hi, n, delta, causal, ct, dev).view(J, g * n, R)
        qs = qg[:, j0:j1].reshape(B * J, g * n, d)
        keys = _heads(kc, j0, j1, lo, hi)
        # one row per KV head (a decoding step without GQA): the scores as a column, keys @ q, which streams the
        # key rows (measured 25% faster than q @ keys^T at 16k keys); the bias [J, 1, R] is that column's memory
        col = g * n == 1
        a, b = (keys, qs.transpose(1, 2)) if col else (qs, keys.transpose(1, 2))
        bias = bias.view(J, R, 1) if col else bias
        if B == 1:
            s = bias.baddbmm_(a, b, alpha=scale)                         # accumulates into the fresh bias
        else:
            s = torch.bmm(a, b).mul_(scale).view(B, J, *bias.shape[1:]).add_(bias).view(B * J, *bias.shape[1:])
        s = s.view(B * J, 1, R) if col else s   # the column as a row: the softmax over contiguous scores
        p = torch.softmax(s, -1)                 # every row sees its own key (the dispatcher checked the keys)
        outs.append(torch.bmm(p, _heads(vc, j0, j1, lo, hi)).view(B, J * g, n, dv))
        if need_lse:                             # m + log sum e^{s - m} = m - log max p
            lses.append((s.amax(-1) - p.amax(-1).log()).view(B, J * g, n))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses, 1)) if need_lse else out.new_empty(B, Hq, n, dtype=ct)
    return out.to(q.dtype), lse
