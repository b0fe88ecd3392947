"""Merging attentions over disjoint key sets through their log-sum-exp.

An attention with weights ``w_ij >= 0`` (``count_ij`` for positional LSH, ALiBi's
``e^{-m |i - j|}`` inside a window, 1 for plain softmax) over a key set ``K`` is

    ``out_i = sum_{j in K} w_ij e^{s_ij} v_j / Z_i``,  ``lse_i = log Z_i = log sum_{j in K} w_ij e^{s_ij}``.

For disjoint key sets ``K_1, ..., K_P`` the attention over their union has
``Z_i = sum_p Z_i^(p)``, hence exactly

    ``lse_i = logsumexp_p lse_i^(p)``,  ``out_i = sum_p exp(lse_i^(p) - lse_i) out_i^(p)``,

which is how split-KV decoding, ring attention and a local window plus a far-field
approximation combine (flash-attention's ``flash_attn_with_kvcache`` splits, xformers'
``merge_attentions``). Every op of the library returns this ``lse`` with ``return_lse=True``.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["merge_attention"]


def merge_attention(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """The attention over the union of disjoint key sets from the attentions over each.

    Args:
        outs: ``P >= 1`` partial outputs, each ``[..., n, dv]`` (e.g. ``[B, Hq, n, dv]``), one dtype.
        lses: their log-sum-exps, each ``[..., n]`` (``out.shape[:-1]``), float; ``-inf`` where a
            query has no key in that set (its partial output is then ignored, whatever it holds).
    Returns:
        ``(out [..., n, dv] in the dtype of outs, lse [..., n] in float32, float64 if any input is
        float64)``: ``lse = logsumexp_p lse_p``, ``out = sum_p exp(lse_p - lse) out_p``. A query with
        no key in any set gets ``out = 0`` and ``lse = -inf``; a NaN in any partial's lse gives NaN
        ``out`` and ``lse`` on that query, so it survives further merges. Differentiable in every ``out_p`` and
        ``lse_p``, with finite gradients on such rows too.
    """
    if isinstance(outs, Tensor) or isinstance(lses, Tensor):
        raise TypeError("outs and lses must be sequences of tensors (one per key set), not a tensor")
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs and lses: need one lse per partial output and at least one, got {len(outs)} "
                         f"outputs and {len(lses)} lses")
    for p, (o, l) in enumerate(zip(outs, lses)):
        if not isinstance(o, Tensor) or not isinstance(l, Tensor):
            raise TypeError(f"outs[{p}] and lses[{p}] must be tensors")
        if o.dim() < 1 or tuple(l.shape) != tuple(o.shape[:-1]) or o.shape != outs[0].shape:
            raise ValueError(f"lses[{p}] must have shape outs[{p}].shape[:-1] and every out the same shape: got "
                             f"out {tuple(o.shape)}, lse {tuple(l.shape)} (outs[0] {tuple(outs[0].shape)})")
        if not l.dtype.is_floating_point or o.dtype != outs[0].dtype:
            raise TypeError(f"lses[{p}] must be floating point and every out of one dtype, got lse {l.dtype}, "
                            f"out {o.dtype} (outs[0] {outs[0].dtype})")
    wide = any(x.dtype == torch.float64 for x in [*outs, *lses])
    ct = torch.float64 if wide else torch.float32
    lse = torch.stack([l.to(ct) for l in lses])                               # [P, ..., n]
    # The max is only a shift (the result does not depend on it): detached, and 0 where every
    # set is empty, so no -inf - -inf.
    top = lse.detach().amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)                                                   # -inf -> 0
    total = w.sum(0)
    # Clamped before the division and the log so that empty rows have finite gradients (the
    # untaken branch of a where still gets differentiated).
    safe = total.clamp_min(torch.finfo(ct).tiny)
    # No key in any set: -inf. A NaN in any partial stays NaN (a later merge must not read it as
    # "no key" and drop that partial).
    empty = torch.where(torch.isnan(total), total, torch.full_like(total, float("-inf")))
    merged_lse = torch.where(total > 0, top + torch.log(safe), empty)
    weights = (w / safe)[..., None]                                            # [P, ..., n, 1]
    # a set a query has no key in contributes nothing, even if its partial output is NaN there
    out = sum(weights[p] * outs[p].to(ct).masked_fill(weights[p] == 0, 0.0) for p in range(len(outs)))
    return out.to(outs[0].dtype), merged_lse
