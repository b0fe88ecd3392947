"""The attention of a patched ALiBi model (BLOOM, MPT, Falcon): every query row the model's own, one op
call per group of rows, the key/value step, and exact dropout.

transformers masks keys, not queries: a query whose own token is padding still attends, and models read
those rows (a classifier's pooled token, the causal-LM shift from the last left pad). So for each batch row
with real tokens ``[s, e)`` (the :class:`~.call.AlibiCall`'s mask) :func:`attend_rows` gives

* queries in ``[s, e)``: causal ALiBi-family attention to the run's keys at their own positions, one
  :func:`poslsh.attend` per group of rows with equal offsets (one call for an unpadded batch);
* queries after the run (right padding, or a masked last token): the run's keys, at the family's positions
  (BLOOM and Falcon count real tokens, so such a query sits on the run's last position; MPT counts the
  index), exact and dense per chunk of :data:`CHUNK` queries: ``O(m n)`` for ``m`` such queries;
* queries with no real key at or before them (left padding): every key of the row with equal weight: what
  the model's float32 softmax gives a row whose scores all sit at the dtype's minimum (in float64
  transformers' BLOOM and MPT give NaN there; Falcon the same equal weights);
* a row whose real tokens have a gap: exact and dense per query chunk at the family's positions.

In training with attention dropout ``p > 0`` the rows go through :func:`..dense.chunked_attention` (exact, dense
per query chunk, recomputed in the backward). :func:`update_kv` is the one place a layer's new keys and
values meet its cache.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ....decoding.rows import RowSpan, row_groups
from ....positional import Positional
from ..dense import CHUNK, chunked_attention
from ..rows import attend_at, attend_row_groups
from .call import NO_CALL, AlibiCall, row_runs

__all__ = ["row_positions", "update_kv", "attend_rows"]


def row_positions(valid: Tensor, rule: str) -> Tensor:
    """Positions of one row's tokens ``[nk]`` (int64) from its mask ``valid [nk]``: ``"cumsum"`` (BLOOM, Falcon:
    real tokens counted, a gap skipped) or ``"index"`` (MPT: the index, from the first real token)."""
    if rule == "cumsum":
        return valid.to(torch.int64).cumsum(0) - 1
    first = int(valid.to(torch.int8).argmax()) if bool(valid.any()) else 0
    return torch.arange(valid.numel(), device=valid.device) - first


def update_kv(cache, key: Tensor, value: Tensor, layer_idx: int) -> Tuple[Tensor, Tensor, int]:
    """The layer's keys and values after this step, and the padded position of the first one held
    (0: transformers' caches keep every key)."""
    if cache is None:
        return key, value, 0
    past, n = int(cache.get_seq_length(layer_idx)), key.shape[2]
    key, value = cache.update(key, value, layer_idx)
    if key.shape[2] != past + n:
        raise ValueError(f"cache: a patched ALiBi model needs a cache holding exactly the past keys, then the new "
                         f"ones ({past} + {n} tokens, got {key.shape[2]} keys from a {type(cache).__name__}); use "
                         "transformers' DynamicCache")
    return key, value, 0


def attend_rows(query: Tensor, key: Tensor, value: Tensor, call: AlibiCall, positional: Positional, *,
                scale: float, backend: str, k_first: int = 0, dropout: float = 0.0,
                key_bias: Optional[Callable[[Tensor], Tensor]] = None, rule: str = "cumsum") -> Tensor:
    """Causal ALiBi-family attention of ``query [B, Hq, nq, d]`` (padded positions ``[nk' - nq, nk')``,
    ``nk' = k_first + nk``) to ``key/value [B, Hkv, nk, d]`` (padded ``[k_first, nk')``) with the layer's
    ``positional`` object, every query row the model's own (the module docstring): ``call`` holds the
    padding mask and packed documents. ``key_bias(positions) -> [Hq, m]``: a per-key logit term added on
    top of the positional bias (Falcon's bfloat16-rounded bias); ``rule``: the family's positions
    (:func:`row_positions`). Returns ``[B, Hq, nq, dv]``."""
    B, Hq, nq, _ = query.shape
    nk = key.shape[2]
    total = k_first + nk
    call = NO_CALL if call is None else call
    valid, documents = call.valid_for(total), call.documents
    runs = row_runs(None, B, total) if valid is None else call.runs(B, total)
    if documents is not None and (valid is not None or nq != total):
        raise ValueError("position_ids: packed documents (positions that restart) need a prefill without padding or "
                         "cache; decode each document as its own row")
    first_q = total - nq                     # padded position of query row 0
    opts = dict(positional=positional, scale=scale, k_first=k_first, dropout=dropout, key_bias=key_bias)

    def run(rows, span: RowSpan) -> Tensor:
        q = query[rows, :, span.i0:span.i1]
        k, v = key[rows, :, span.j0:span.j1], value[rows, :, span.j0:span.j1]
        qs, ks = span.q_start, span.k_start
        if key_bias is not None:
            q, k, v = _with_key_bias(q, k, v, key_bias(torch.arange(ks, ks + k.shape[2], device=q.device)), scale)
        if dropout > 0:
            if documents is not None:
                raise ValueError("attention dropout with packed documents: train packed batches with dropout 0, "
                                 "or unpacked rows")
            qp, kp = torch.arange(qs, qs + q.shape[2]), torch.arange(ks, ks + k.shape[2])
            return chunked_attention(q, k, v, positional, scale, qp, kp, qp, kp, None, dropout)
        docs = {} if documents is None else {"document_ids": documents[rows] if documents.shape[0] > 1
                                             else documents.expand(q.shape[0], -1)}
        return attend_at(q, k, v, positional, qs, ks, scale=scale, backend=backend, **docs)

    out = attend_row_groups(query, value.shape[-1], row_groups(runs, first_q, nq, k_first, nk), run)
    if valid is None:                        # no padding: one call for the batch
        return out
    for b, r in enumerate(runs):
        if r is None or r[1] < total or r[0] > first_q:      # masked queries: a gap, after or before the run
            out = _put(out, torch.tensor([b], device=query.device), 0, nq,
                       _masked_queries(out[b:b + 1], query[b:b + 1], key[b:b + 1], value[b:b + 1], valid[b], r,
                                       rule=rule, **opts))
    return out


def _masked_queries(done: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, run, *, positional, scale,
                    k_first, dropout, key_bias, rule) -> Tensor:
    """One row's output ``[1, Hq, nq, dv]``: ``done`` where its queries are real tokens of a run, the model's
    rows at its masked queries (the module docstring), exact and dense per chunk."""
    total, nq = valid.numel(), q.shape[2]
    q_idx, k_idx = torch.arange(total - nq, total, device=q.device), torch.arange(k_first, total, device=q.device)
    seen = valid.to(torch.int64).cumsum(0)[total - nq:] > 0                # a real key at or before the query
    if run is None:
        redo = torch.ones(nq, dtype=torch.bool, device=q.device)
    else:
        redo = ~valid[total - nq:]
    dense = torch.nonzero(redo & seen).flatten()
    out = done
    if dense.numel():
        pos = row_positions(valid, rule)
        qq, kk, vv = q[:, :, dense], k, v
        if key_bias is not None:
            qq, kk, vv = _with_key_bias(qq, kk, vv, key_bias(pos[k_first:]), scale)
        part = chunked_attention(qq, kk, vv, positional, scale, pos[q_idx[dense]], pos[k_first:], q_idx[dense], k_idx,
                                 valid[k_first:], dropout)
        out = out.index_copy(2, dense, part.to(out.dtype))
    empty = torch.nonzero(~seen).flatten()
    if empty.numel():
        out = out.index_copy(2, empty, _equal_weights(v, q.shape[1], empty.numel(), dropout).to(out.dtype))
    return out


def _equal_weights(v: Tensor, Hq: int, m: int, p: float) -> Tensor:
    """``m`` query rows that weigh every key of ``v [1, Hkv, nk, dv]`` equally: ``[1, Hq, m, dv]`` (with dropout
    ``p`` on the weights in training, per chunk of :data:`CHUNK` rows)."""
    v = v.repeat_interleave(Hq // v.shape[1], dim=1) if v.shape[1] != Hq else v
    nk = v.shape[2]
    if p == 0:
        return v.mean(dim=2, keepdim=True).expand(-1, -1, m, -1)
    parts = []
    for c0 in range(0, m, CHUNK):
        w = torch.full((1, Hq, min(CHUNK, m - c0), nk), 1.0 / nk, dtype=v.dtype, device=v.device)
        parts.append(torch.nn.functional.dropout(w, p=p, training=True) @ v)
    return torch.cat(parts, 2)


def _put(out: Tensor, rows: Tensor, i0: int, i1: int, part: Tensor) -> Tensor:
    """``out`` with ``out[rows, :, i0:i1] = part`` (out of place: differentiable)."""
    full = torch.zeros(rows.numel(), out.shape[1], out.shape[2], out.shape[3], dtype=out.dtype, device=out.device)
    full = torch.cat([full[:, :, :i0], part, full[:, :, i1:]], dim=2)
    return out.index_copy(0, rows, full)


def _with_key_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` with one more feature of ``q`` and ``k`` so that ``scale q' . k'_j = scale q . k_j + bias[h, j]``
    (``bias [Hq, m]``): an exact per-key logit term through the unchanged op (keys and values expanded to
    the query heads: the term differs per query head)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    ones = torch.ones(*q.shape[:3], 1, dtype=q.dtype, device=q.device)
    extra = (bias.to(k.dtype) / scale)[None, :, :, None].expand(k.shape[0], -1, -1, -1)
    return torch.cat([q, ones], -1), torch.cat([k, extra], -1), v
