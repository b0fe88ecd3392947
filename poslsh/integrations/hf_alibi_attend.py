"""The attention of a patched ALiBi model (BLOOM, MPT, Falcon): masks as row spans, one op call per
group of rows, the key/value step, and exact dropout.

* :class:`RowMask` is what the registered mask builder (:func:`row_mask_builder`) returns in place of
  transformers' ``n x n`` mask: the 2-D padding mask (``[B, nk]``, or None), the packed documents of the
  call (``[B, n]`` ids, or None) and the sizes. BLOOM and Falcon count positions by the mask's
  cumulative sum, MPT by index; for a row whose real tokens are one contiguous run (left and/or right
  padding) both are the distance from the run's first token. A row with a gap inside takes the exact
  dense path per query chunk at its family's positions (``O(nq nk)``: cheap for a decoding step).
* :func:`attend_rows`: the queries ``[nk - nq, nk)`` of each row attend causally to the keys of its run
  at their own positions (``q_start``, ``k_start``), one :func:`poslsh.attend` call per group of rows
  with equal offsets (one call for an unpadded batch), zeros at padded queries. In training with
  attention dropout ``p > 0`` the same rows go through :func:`chunked_attention` (exact, dense per
  query chunk, recomputed in the backward).
* :func:`update_kv`: the one place a layer's new keys and values meet its cache (a bounded cache
  plugs in here: it returns the keys it holds and the padded position of the first).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..attention import attend
from ..decoding import span_backend
from ..positional import Positional

__all__ = ["RowMask", "row_mask_builder", "row_runs", "row_positions", "update_kv", "attend_rows",
           "chunked_attention", "PACKED"]

CHUNK = 256                      # query rows per chunk of the exact dense path (gaps, dropout)


@dataclass(frozen=True)
class RowMask:
    """A causal mask as spans: ``valid [B, nk]`` bool (None: every token real), ``documents [B, n]`` int
    (packed documents of a prefill, or None), ``q_length``, ``kv_length``, ``runs`` (:func:`row_runs`). Stands where transformers'
    models expect their 4-D mask: ``ndim`` is 0 (Falcon folds no bias into it) and ``.to()`` returns it."""

    valid: Optional[Tensor]
    documents: Optional[Tensor]
    q_length: int
    kv_length: int
    runs: Optional[tuple] = None           # row_runs(valid), once per forward (one host sync, not one per layer)
    ndim: int = 0

    def to(self, *args, **kwargs) -> "RowMask":
        device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
        if device is None or self.valid is None:
            return self
        return replace(self, valid=self.valid.to(device))


# Packed documents of the current top-level call, set by the patched model's forward hook (a list: a stack).
PACKED: List[Optional[Tensor]] = []


def row_mask_builder(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask: Optional[Tensor] = None, **kwargs) -> RowMask:
    """``AttentionMaskInterface`` builder of patched ALiBi models: a :class:`RowMask`, ``O(B nk)``."""
    if kwargs.get("use_vmap", False):
        raise ValueError("attention_mask: a patched ALiBi model takes causal padding masks only (a custom mask "
                         "function was given)")
    if isinstance(kv_offset, int) and kv_offset > 0 and kv_length == q_length:
        # a per-head window cache (hf_alibi_cache): the layers attend through it and read only which of
        # this step's tokens are real
        valid = None
        if attention_mask is not None:
            valid = attention_mask.to(torch.bool)[:, kv_offset:kv_offset + q_length]
            if valid.shape[-1] != q_length:
                raise ValueError(f"attention_mask: {attention_mask.shape[-1]} columns for {kv_offset + q_length} "
                                 "tokens")
        return RowMask(valid, None, int(q_length), int(kv_length), None)
    if not isinstance(kv_offset, int) or kv_offset != 0 or not isinstance(q_offset, int) \
            or kv_length != q_offset + q_length:
        raise ValueError(f"cache: a patched ALiBi model needs a cache holding exactly the past keys, then the "
                         f"queries ({q_offset} + {q_length} tokens in {kv_length} slots, offset {kv_offset}); use "
                         "transformers' DynamicCache")
    valid = None
    if attention_mask is not None:
        valid = attention_mask.to(torch.bool)
        if valid.shape[-1] < kv_length:
            raise ValueError(f"attention_mask: {valid.shape[-1]} columns for {kv_length} keys")
        valid = valid[:, :kv_length]
        if bool(valid.all()):
            valid = None
    documents = PACKED[-1] if PACKED else None
    if documents is not None and (valid is not None or q_length != kv_length):
        raise ValueError("position_ids: packed documents (positions that restart) need a prefill without padding or "
                         "cache; decode each document as its own row")
    runs = None if valid is None else tuple(row_runs(valid, valid.shape[0], int(kv_length)))
    return RowMask(valid, documents, int(q_length), int(kv_length), runs)


def row_runs(valid: Optional[Tensor], B: int, nk: int) -> List[Optional[Tuple[int, int]]]:
    """Each row's run of real tokens ``[start, end)`` (``(0, 0)``: none) from ``valid [B, nk]``; None for a
    row whose real tokens are not one contiguous run (a gap)."""
    if valid is None:
        return [(0, nk)] * B
    if valid.shape != (B, nk):
        raise ValueError(f"attention_mask: shape {tuple(valid.shape)} does not fit {B} rows of {nk} keys")
    idx = torch.arange(nk, device=valid.device)
    count = valid.sum(1)
    start = torch.where(valid, idx, nk).amin(1)
    end = torch.where(valid, idx + 1, 0).amax(1)
    gaps = ((count > 0) & (end - start != count)).tolist()
    return [None if g else ((s, e) if c else (0, 0))
            for s, e, c, g in zip(start.tolist(), end.tolist(), count.tolist(), gaps)]


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
    key, value = cache.update(key, value, layer_idx)
    return key, value, 0


def attend_rows(query: Tensor, key: Tensor, value: Tensor, mask, positional: Positional, *, scale: float,
                backend: str, k_first: int = 0, dropout: float = 0.0,
                key_bias: Optional[Callable[[Tensor], Tensor]] = None, rule: str = "cumsum") -> Tensor:
    """Causal ALiBi-family attention of ``query [B, Hq, nq, d]`` (padded positions ``[nk' - nq, nk')``,
    ``nk' = k_first + nk``) to ``key/value [B, Hkv, nk, d]`` (padded ``[k_first, nk')``) with the layer's
    ``positional`` object, each row at the positions of its run of real tokens (``mask``: a
    :class:`RowMask` or None). ``key_bias(positions) -> [Hq, m]``: a per-key logit term added on top of
    the positional bias (Falcon's bfloat16-rounded bias). A row with a gap in its mask takes the exact
    dense path per query chunk at the family's positions (``rule``, :func:`row_positions`).
    Returns ``[B, Hq, nq, dv]``, 0 at padding."""
    B, Hq, nq, _ = query.shape
    nk = key.shape[2]
    total = k_first + nk
    if isinstance(mask, RowMask):
        valid, documents = mask.valid, mask.documents
    elif mask is None:
        valid, documents = None, None
    else:
        raise ValueError("attention_mask: a patched ALiBi model takes a 2-D padding mask, not a prepared 4-D one")
    if valid is not None and valid.shape[-1] != total:
        valid = valid[:, :total]
    known = isinstance(mask, RowMask) and mask.runs is not None and mask.kv_length == total
    runs = list(mask.runs) if known else row_runs(valid, B, total)
    groups: Dict[Tuple[int, int, int, int], List[int]] = {}
    gapped = [b for b, r in enumerate(runs) if r is None]
    if gapped and documents is not None:
        raise ValueError("attention_mask with a gap and packed documents: describe the batch by one of them")
    for b, run_b in enumerate(runs):
        if run_b is None:
            continue
        s, e = run_b
        i0, i1 = max(s, total - nq) - (total - nq), e - (total - nq)
        if i1 > i0:
            groups.setdefault((i0, i1, s, e), []).append(b)

    def run(rows, i0, i1, s, e):
        q = query[rows, :, i0:i1]
        k, v = key[rows, :, max(s, k_first) - k_first:e - k_first], value[rows, :, max(s, k_first) - k_first:e - k_first]
        qs, ks = total - nq + i0 - s, max(s, k_first) - s
        if key_bias is not None:
            q, k = _with_key_bias(q, k, key_bias(torch.arange(ks, ks + k.shape[2], device=q.device)), scale)
        if dropout > 0:
            if documents is not None:
                raise ValueError("attention dropout with packed documents: train packed batches with dropout 0, "
                                 "or unpacked rows")
            qp, kp = torch.arange(qs, qs + q.shape[2]), torch.arange(ks, ks + k.shape[2])
            return chunked_attention(q, k, v, positional, scale, qp, kp, qp, kp, None, dropout)
        if qs == 0 and ks == 0 and q.shape[2] == k.shape[2]:
            docs = {} if documents is None else {"document_ids": documents[rows] if documents.shape[0] > 1
                                                 else documents.expand(q.shape[0], -1)}
            return attend(q, k, v, positional, causal=True, scale=scale, backend=backend, **docs)
        return attend(q, k, v, positional, causal=True, scale=scale, backend=span_backend(backend, q, positional.op),
                      q_start=qs, k_start=ks)

    if not gapped and len(groups) == 1 and len(next(iter(groups.values()))) == B:
        (i0, i1, s, e), _ = next(iter(groups.items()))
        if i0 == 0 and i1 == nq:
            return run(slice(None), i0, i1, s, e)
    out = query.new_zeros(B, Hq, nq, value.shape[-1])
    for (i0, i1, s, e), rows in groups.items():
        idx = torch.tensor(rows, device=query.device)
        out = _put(out, idx, i0, i1, run(idx, i0, i1, s, e))
    for b in gapped:
        out = _put(out, torch.tensor([b], device=query.device), 0, nq,
                   _gap_row(query[b:b + 1], key[b:b + 1], value[b:b + 1], valid[b], positional, scale, k_first,
                            dropout, key_bias, rule))
    return out


def _gap_row(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, positional: Positional, scale: float, k_first: int,
             p: float, key_bias, rule: str) -> Tensor:
    """One row whose mask has a gap: exact, dense per query chunk, at the family's positions."""
    total, nq = valid.numel(), q.shape[2]
    pos = row_positions(valid, rule).cpu()
    q_idx, k_idx = torch.arange(total - nq, total), torch.arange(k_first, total)
    if key_bias is not None:
        q, k = _with_key_bias(q, k, key_bias(pos[k_first:].to(q.device)), scale)
    out = chunked_attention(q, k, v, positional, scale, pos[total - nq:], pos[k_first:], q_idx, k_idx,
                            valid[k_first:], p)
    return out * valid[total - nq:].to(out.dtype)[None, None, :, None]


def _put(out: Tensor, rows: Tensor, i0: int, i1: int, part: Tensor) -> Tensor:
    """``out`` with ``out[rows, :, i0:i1] = part`` (out of place: differentiable)."""
    full = torch.zeros(rows.numel(), out.shape[1], out.shape[2], out.shape[3], dtype=out.dtype, device=out.device)
    full = torch.cat([full[:, :, :i0], part, full[:, :, i1:]], dim=2)
    return out.index_copy(0, rows, full)


def _with_key_bias(q: Tensor, k: Tensor, bias: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """``q, k`` with one more feature so that ``scale q' . k'_j = scale q . k_j + bias[h, j]`` (``bias [Hq, m]``):
    an exact per-key logit term through the unchanged op (keys expanded to the query heads)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else k
    ones = torch.ones(*q.shape[:3], 1, dtype=q.dtype, device=q.device)
    extra = (bias.to(k.dtype) / scale)[None, :, :, None].expand(k.shape[0], -1, -1, -1)
    return torch.cat([q, ones], -1), torch.cat([k, extra], -1)


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, positional: Positional, scale: float, q_pos: Tensor,
                      k_pos: Tensor, q_idx: Tensor, k_idx: Tensor, key_ok: Optional[Tensor], p: float) -> Tensor:
    """Exact causal attention (``k_idx <= q_idx``, keys ``key_ok``) with the positional object's dense bias
    between ``q_pos [nq]`` and ``k_pos [nk]``, and dropout ``p`` on the probabilities (training): dense per
    chunk of :data:`CHUNK` queries (``O(chunk nk)`` memory), each chunk recomputed in the backward with the
    same dropout mask (``torch.utils.checkpoint`` keeps the RNG state). A query with no key gives 0."""
    from torch.utils.checkpoint import checkpoint

    B, Hq, nq, _ = q.shape
    k = k.repeat_interleave(Hq // k.shape[1], dim=1) if k.shape[1] != Hq else k
    v = v.repeat_interleave(Hq // v.shape[1], dim=1) if v.shape[1] != Hq else v
    dev = q.device
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    ok = None if key_ok is None else key_ok.to(dev)

    def chunk(qc: Tensor, c0: int) -> Tensor:
        c1 = c0 + qc.shape[2]
        bias = positional.dense_bias(q_pos[c0:c1].to(dev), k_pos.to(dev)).to(dt)        # [H, c, nk], -inf outside
        allowed = k_idx.to(dev)[None, :] <= q_idx[c0:c1].to(dev)[:, None]
        if ok is not None:
            allowed = allowed & ok[None, :]
        s = torch.einsum("bhid,bhjd->bhij", qc.to(dt), k.to(dt)) * scale + bias
        w = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        if p > 0:
            w = torch.nn.functional.dropout(w, p=p, training=True)
        return torch.einsum("bhij,bhjd->bhid", w, v.to(dt)).to(q.dtype)

    outs = [checkpoint(chunk, q[:, :, c0:c0 + CHUNK], c0, use_reentrant=False) if torch.is_grad_enabled()
            else chunk(q[:, :, c0:c0 + CHUNK], c0) for c0 in range(0, nq, CHUNK)]
    return torch.cat(outs, 2) if outs else q.new_zeros(B, Hq, 0, v.shape[-1])
