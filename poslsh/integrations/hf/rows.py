"""Batch rows at their own positions, for both families of models: the one op call per group of rows, left
padding and packed documents in a KV cache.

A cache keeps keys in *padded* coordinates (index in the batch's token sequence); row ``b``'s own positions
start at its first real token (left padding), as in the prefill without a cache. :func:`attend_row_groups`
attends the groups of :func:`poslsh.decoding.rows.row_groups` (one :func:`attend_at` call each) and assembles
the batch: the bounded cache and a full cache (:func:`span_rows_attention`) and the patched ALiBi models
(:func:`poslsh.integrations.hf.alibi.attend.attend_rows`) all attend through it. The other functions read the
padding from masks and lay out the documents of a packed prefill as left-padded rows, for positional LSH
(:class:`~poslsh.partitions.Partitions`) and ALiBi windows (:class:`~poslsh.AlibiWindow`) alike.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...attention import attend
from ...decoding import span_backend
from ...decoding.rows import RowSpan, row_groups
from ...positional import Positional

__all__ = ["attend_at", "attend_row_groups", "span_rows_attention", "new_token_validity", "left_pads",
           "left_padded_rows"]


def attend_at(q: Tensor, k: Tensor, v: Tensor, positional: Positional, q_start: int, k_start: int, *,
              scale: float, backend: str, **documents) -> Tensor:
    """Causal attention of ``q [B, Hq, nq, d]`` at own positions ``[q_start, q_start + nq)`` to ``k / v
    [B, Hkv, nk, d]`` at ``[k_start, k_start + nk)``: ``[B, Hq, nq, dv]``. Self-attention from position 0 runs
    without positions (any backend, packed ``documents``); any other span on a backend that serves positions
    (:func:`poslsh.decoding.span_backend`)."""
    if q_start == 0 and k_start == 0 and q.shape[2] == k.shape[2]:
        return attend(q, k, v, positional, causal=True, scale=scale, backend=backend, **documents)
    return attend(q, k, v, positional, causal=True, scale=scale, backend=span_backend(backend, q, positional.op),
                  q_start=q_start, k_start=k_start)


def attend_row_groups(query: Tensor, dv: int, groups: Dict[RowSpan, List[int]],
                      attend_span: Callable[[Union[slice, Tensor], RowSpan], Tensor]) -> Tensor:
    """The batch's output ``[B, Hq, nq, dv]`` from one call per group (:func:`~poslsh.decoding.rows.row_groups`),
    split into runs of consecutive rows: ``attend_span(rows, span) -> [len(rows), Hq, span.i1 - span.i0, dv]``
    (``rows`` a ``slice``: the callers' keys and values stay views, never a gathered copy of a cache), zero where
    no group attends. A batch that is one group of every row and every query is that call's output itself."""
    B, Hq, nq = query.shape[:3]
    if len(groups) == 1:
        span, rows = next(iter(groups.items()))
        if len(rows) == B and span.i0 == 0 and span.i1 == nq:     # no padding in this call: one call on the batch
            return attend_span(slice(None), span)
    out = query.new_zeros(B, Hq, nq, dv)
    for span, rows in groups.items():
        for a, b in _runs(rows):
            out[a:b, :, span.i0:span.i1] = attend_span(slice(a, b), span)
    return out


def _runs(rows: List[int]) -> List[Tuple[int, int]]:
    """Sorted rows as runs of consecutive ones ``[a, b)``."""
    out: List[Tuple[int, int]] = []
    for r in sorted(rows):
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def new_token_validity(allowed: Optional[Tensor], B: int, nq: int) -> Optional[Tensor]:
    """Which new tokens are real, bool ``[B, nq]`` (None: all), from the diagonal of a causal
    mask ``[B, 1, nq, kv]`` whose last ``nq`` key columns are the new tokens."""
    if allowed is None:
        return None
    if allowed.shape[-2] != nq or allowed.shape[-1] < nq:
        raise ValueError(f"attention_mask: a mask of shape {tuple(allowed.shape)} does not fit a cached step of {nq} "
                         "tokens; pass the 2-D padding mask (as generate() does), not a 4-D one")
    idx = torch.arange(nq, device=allowed.device)
    return allowed[:, 0, idx, allowed.shape[-1] - nq + idx].expand(B, nq).cpu()


def left_pads(allowed: Optional[Tensor], B: int, nq: int, nk: int) -> Optional[List[Optional[int]]]:
    """For a full cache (queries are the last ``nq`` of ``nk`` keys): each row's first real
    key if ``allowed [B, 1|H, nq, nk]`` is causal with left padding (None for a row with no
    real key), else None (another mask: the caller takes the dense path)."""
    if allowed is None:
        return [0] * B
    if allowed.shape[-2:] != (nq, nk) or (allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all())):
        return None
    a = allowed[:, 0].expand(B, nq, nk)
    last = a[:, -1]
    pad = torch.where(last.any(1), last.to(torch.int8).argmax(1), nk)
    j = torch.arange(nk, device=a.device)
    i = torch.arange(nk - nq, nk, device=a.device)
    expect = (j[None, None] >= pad[:, None, None]) & (j[None, None] <= i[None, :, None])
    if not torch.equal(a, expect):
        return None
    return [p if p < nk else None for p in pad.tolist()]


def span_rows_attention(query: Tensor, key: Tensor, value: Tensor, positional: Positional, q_first: int,
                        k_first: int, pads: List[Optional[int]], scale: float, backend: str) -> Tensor:
    """Causal attention of ``query [B, Hq, nq, d]`` at padded positions ``[q_first, q_first + nq)`` (the last
    ones) to ``key/value [B, Hkv, nk, d]`` at padded ``[k_first, k_first + nk)``, where row ``b``'s own
    positions start at its first real token ``pads[b]`` (None: no real token yet). One :func:`poslsh.attend`
    call (positional LSH or the ALiBi window) per group of rows with equal offsets; returns
    ``[B, Hq, nq, dv]``, zero at padding positions."""
    nq, nk = query.shape[2], key.shape[2]
    runs = [None if pad is None else (pad, q_first + nq) for pad in pads]

    def attend_span(rows, s: RowSpan) -> Tensor:
        return attend_at(query[rows, :, s.i0:s.i1], key[rows, :, s.j0:s.j1], value[rows, :, s.j0:s.j1], positional,
                         s.q_start, s.k_start, scale=scale, backend=backend)

    return attend_row_groups(query, value.shape[-1], row_groups(runs, q_first, nq, k_first, nk), attend_span)


def left_padded_rows(documents: Sequence[Tuple[Tensor, Tensor]], positional: Positional
                     ) -> Tuple[Tensor, Tensor, int, int, List[Optional[int]]]:
    """One left-padded cache row per document, keeping only the keys its continuation can need.

    Args:
        documents: ``D`` pairs ``(k_d [1, Hkv, L_d, d], v_d [1, Hkv, L_d, dv])``, each document's
            keys and values at its own positions ``[0, L_d)``
            (:func:`poslsh.decoding.document_rows` of a packed prefill).
        positional: the layer's partitions or window.
    Returns:
        ``keys [D, Hkv, N - start, d]``, ``values [D, Hkv, N - start, dv]`` (zero where a row is
        padding), ``N = max_d L_d`` (every row's next token sits at padded position ``N``),
        ``start`` (the padded position of the first kept key) and ``pads`` (row ``d``'s first real
        token ``N - L_d``; None for an empty document).
    """
    lengths = [kd.shape[2] for kd, _ in documents]
    N = max(lengths, default=0)
    pads = [N - m if m else None for m in lengths]
    need = positional.first_needed(lengths).tolist() if lengths else []
    start = min((p + f for p, f in zip(pads, need) if p is not None), default=N)
    k0, v0 = documents[0]
    keys = k0.new_zeros(len(documents), k0.shape[1], N - start, k0.shape[3])
    values = v0.new_zeros(len(documents), v0.shape[1], N - start, v0.shape[3])
    for d, ((kd, vd), pad) in enumerate(zip(documents, pads)):
        if pad is None:
            continue
        first = max(0, start - pad)             # own position of the first kept key of this row
        keys[d, :, pad + first - start:] = kd[0, :, first:]
        values[d, :, pad + first - start:] = vd[0, :, first:]
    return keys, values, N, start, pads
