"""Batch rows at their own positions: left padding and packed documents in a KV cache.

A cache keeps keys in *padded* coordinates (index in the batch's token sequence); row ``b``'s
own positions start at its first real token ``pads[b]`` (None: no real token yet), as in the
prefill without a cache (left padding). These helpers read ``pads`` from masks, attend every
row at its own positions, and lay out the documents of a packed prefill as left-padded rows,
for positional LSH (:class:`~poslsh.partitions.Partitions`) and ALiBi windows
(:class:`~poslsh.AlibiWindow`) alike.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...attention import attend
from ...decoding import span_backend
from ...positional import Positional

__all__ = ["new_token_validity", "left_pads", "span_rows_attention", "left_padded_rows"]


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
    """Causal attention of ``query [B, Hq, nq, d]`` at padded positions ``[q_first, q_first + nq)``
    to ``key/value [B, Hkv, nk, d]`` at padded ``[k_first, k_first + nk)``, where row ``b``'s own
    positions start at its first real token ``pads[b]`` (None: no real token yet). One
    :func:`poslsh.attend` call (positional LSH or the ALiBi window) per group of rows
    with equal offsets; returns ``[B, Hq, nq, dv]``, zero at padding positions."""
    B, Hq, nq, _ = query.shape
    backend = span_backend(backend, query, positional.op)
    groups: Dict[Tuple[int, int, int, int], List[int]] = {}
    for b, pad in enumerate(pads):
        if pad is None or pad >= q_first + nq:
            continue
        i0, j0 = max(0, pad - q_first), max(0, pad - k_first)
        groups.setdefault((i0, j0, q_first + i0 - pad, k_first + j0 - pad), []).append(b)

    def run(rows, i0, j0, qs, ks):
        return attend(query[rows, :, i0:], key[rows, :, j0:], value[rows, :, j0:], positional, causal=True,
                      scale=scale, backend=backend, q_start=qs, k_start=ks)

    if len(groups) == 1:
        (i0, j0, qs, ks), rows = next(iter(groups.items()))
        if i0 == 0 and len(rows) == B:     # no padding in this step: one call on the whole batch
            return run(slice(None), i0, j0, qs, ks)
    out = query.new_zeros(B, Hq, nq, value.shape[-1])
    for (i0, j0, qs, ks), rows in groups.items():
        idx = torch.tensor(rows, device=query.device)
        out[idx, :, i0:] = run(idx, i0, j0, qs, ks)
    return out


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
