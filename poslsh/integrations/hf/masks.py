"""The masks transformers hands the registered attention functions, and what the near-linear
ops make of them.

* :func:`lazy_causal_mask`, the mask builder registered with ``AttentionMaskInterface`` for every
  poslsh implementation: ``sdpa``'s boolean 4-D mask, except for self-attention without a padding
  mask, where it returns None (no ``n x n`` tensor). A packed batch (``DataCollatorWithFlattening``)
  is then read from ``position_ids`` that restart, or from the ``cu_seq_lens_q/k`` keyword
  arguments, as transformers' flash-attention does (:func:`packed_documents`).
* Padding: a causal mask with one contiguous run of valid keys per row (right or left padding)
  runs the near-linear op (:func:`padded_self_attention`: left-padded rows are rolled so their
  valid tokens start at 0); a full KV cache with left padding attends per group of rows at the
  queries' and keys' positions (:func:`poslsh.integrations.hf.rows.span_rows_attention`).
* A 4-D mask that is exactly packed causal documents (block-diagonal causal) is read as documents.

Any other mask is left to the caller's exact dense path.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["allowed_mask", "causal_key_runs", "roll_rows", "padded_self_attention",
           "window_mask", "dense_cause", "documents_from_positions", "documents_from_mask", "packed_documents",
           "lazy_causal_mask"]


def allowed_mask(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """A 4-D mask as booleans ``[B, 1|H, nq, nk]`` (True = attend), or None."""
    if attention_mask is None:
        return None
    m = attention_mask
    if not isinstance(m, Tensor) or m.dim() != 4:
        raise ValueError("the poslsh/alibi attention implementations need a 4-D attention mask "
                         f"(or None), got {type(m).__name__} of shape {getattr(m, 'shape', None)}")
    if m.dtype == torch.bool:
        return m
    if m.dtype.is_floating_point:  # additive mask: 0 = attend, very negative = masked
        allowed = m > torch.finfo(m.dtype).min / 2
        if bool((m[allowed] != 0).any()):
            raise ValueError("additive float masks with non-zero biases are not supported by the "
                             "poslsh/alibi attention implementations (only 0 / -inf masks)")
        return allowed
    raise TypeError(f"unsupported attention mask dtype {m.dtype}")


def _one_head(allowed: Tensor) -> Optional[Tensor]:
    """``allowed[:, 0]`` when every head has the same mask, else None."""
    a = allowed[:, 0]
    if allowed.shape[1] > 1 and not bool((allowed == a[:, None]).all()):
        return None
    return a


def causal_key_runs(allowed: Tensor) -> Optional[Tensor]:
    """If ``allowed`` is a causal mask with one contiguous run of valid keys per row
    (right or left padding), the start of each row's run ``[B]``; else None."""
    B, _, nq, nk = allowed.shape
    if nq != nk or (a := _one_head(allowed)) is None:
        return None
    valid = a.any(dim=1)                                              # [B, nk]
    tri = torch.ones(nk, nk, dtype=torch.bool, device=a.device).tril()
    if not torch.equal(a, tri[None] & valid[:, None, :]):
        return None
    idx = torch.arange(nk, device=a.device)
    count = valid.sum(1)
    start = torch.where(valid, idx, nk).amin(1)
    end = torch.where(valid, idx + 1, 0).amax(1)
    start = torch.where(count > 0, start, 0)
    end = torch.where(count > 0, end, 0)
    if not torch.equal(count, end - start):
        return None
    return start


def roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """``y[b, :, j] = x[b, :, (j + shift[b]) % n]`` for ``x [B, H, n, d]``."""
    n = x.shape[2]
    idx = (torch.arange(n, device=x.device)[None] + shift[:, None]) % n            # [B, n]
    return torch.gather(x, 2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def padded_self_attention(attend: Callable[[Tensor, Tensor, Tensor], Tensor], query: Tensor, key: Tensor,
                          value: Tensor, allowed: Optional[Tensor], causal: bool) -> Optional[Tensor]:
    """``attend(q, k, v)`` (self-attention, ``[B, H, n, d]``) when the mask allows it: none, or
    causal with contiguous padding; None for any other mask."""
    if allowed is None:
        return attend(query, key, value)
    if not causal or (start := causal_key_runs(allowed)) is None:
        return None
    if bool((start == 0).all()):   # right padding: valid queries never see the padded keys
        return attend(query, key, value)
    # left padding: roll each row so it becomes right padding
    q, k, v = (roll_rows(t, start) for t in (query, key, value))
    return roll_rows(attend(q, k, v), -start)


def window_mask(allowed: Optional[Tensor], nq: int, nk: int, causal: bool, window: Optional[int],
                 device) -> Optional[Tensor]:
    """The boolean mask of the dense path: the given one, or causal, narrowed to a sliding window."""
    if window is None:
        return allowed
    qpos = torch.arange(nk - nq, nk, device=device)[:, None]
    kpos = torch.arange(nk, device=device)[None, :]
    near = (qpos - kpos < window) & ((kpos <= qpos) if causal else True)
    return near[None, None] if allowed is None else allowed & near


def dense_cause(nq: int, nk: int, causal: bool, window: Optional[int]) -> str:
    """Which mask the near-linear ops cannot express, in one line."""
    if window is not None:
        return "a sliding window"
    if nq != nk:
        return (f"a mask over a KV cache other than causal left padding ({nq} queries, {nk} keys)" if causal else
                f"non-causal attention against a KV cache ({nq} queries, {nk} keys)")
    if not causal:
        return f"a non-causal attention mask ({nq} tokens)"
    return (f"a 4-D mask that is neither causal padding nor packed causal documents ({nq} tokens: a custom mask, or "
            "padding inside packed documents)")


# ------------------------------------------------------------------ packed documents
def _starts_to_ids(starts: Tensor) -> Tensor:
    return starts.to(torch.int64).cumsum(1) - 1


def documents_from_positions(position_ids: Optional[Tensor], batch: int, n: int) -> Optional[Tensor]:
    """Document ids ``[B, n]`` of a packed batch whose ``position_ids`` restart (a new document
    wherever a position is not the previous one plus 1, transformers' rule), or None when every
    row is one sequence. Every packed document must count its positions from 0."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != n or n < 2:
        return None
    if position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids: shape {tuple(position_ids.shape)} does not fit a batch of {batch}")
    pos = position_ids.expand(batch, n)
    starts = torch.ones(batch, n, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    if bool((pos[starts] != 0).any()):
        b, i = (int(x) for x in torch.nonzero(starts & (pos != 0))[0])
        raise ValueError(f"position_ids: packed documents (positions that restart) must each count from 0, but row "
                         f"{b} has a document starting at index {i} with position {int(pos[b, i])}")
    return _starts_to_ids(starts)


def documents_from_mask(allowed: Tensor, causal: bool) -> Optional[Tensor]:
    """Document ids ``[B, n]`` if the 4-D boolean ``allowed`` is exactly packed causal documents
    (block-diagonal causal, at least two documents in some row); else None."""
    B, _, nq, nk = allowed.shape
    if not causal or nq != nk or nq < 2 or (a := _one_head(allowed)) is None:
        return None
    if not bool(a.any(2).all()):
        return None
    idx = torch.arange(nk, device=a.device)
    first = a.to(torch.int8).argmax(2)                                   # [B, n] first visible key
    starts = first == idx
    if not bool(starts[:, 1:].any()) or not bool(((first[:, 1:] == first[:, :-1]) | starts[:, 1:]).all()):
        return None
    expect = (idx[None, None, :] >= first[:, :, None]) & (idx[None, None, :] <= idx[None, :, None])
    return _starts_to_ids(starts) if torch.equal(a, expect) else None


def _starts_of_offsets(cu: Tensor, n: int) -> Tensor:
    starts = torch.zeros(1, n, dtype=torch.bool)
    c = cu.detach().cpu().to(torch.int64)[:-1]
    starts[0, c[(c >= 0) & (c < n)]] = True
    return starts


def packed_documents(allowed: Optional[Tensor], kwargs: dict, batch: int, nq: int, nk: int) -> Optional[dict]:
    """The packed documents of a self-attention call as ``poslsh_attention`` keyword arguments
    (``{"cu_seqlens": ...}`` or ``{"document_ids": ...}``), or None when it is not packed.

    Read from the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or from ``position_ids``
    that restart when there is no mask (a 4-D mask: :func:`documents_from_mask`).
    Contradictory descriptions raise one line."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or not torch.equal(cu_q.detach().cpu(), cu_k.detach().cpu()):
            raise ValueError("cu_seq_lens_q / cu_seq_lens_k: packed documents need the same offsets for queries and "
                             "keys (self-attention within each document)")
        if nq != nk:
            raise ValueError("cu_seq_lens_q: packed documents are for self-attention, not decoding against a cache")
        if allowed is not None:
            raise ValueError("cu_seq_lens_q with an attention mask: describe the packed batch by one of them "
                             "(DataCollatorWithFlattening passes no attention_mask)")
        from_positions = documents_from_positions(position_ids, batch, nq)
        if from_positions is not None:
            starts = torch.ones_like(from_positions, dtype=torch.bool)
            starts[:, 1:] = from_positions[:, 1:] != from_positions[:, :-1]
            if batch != 1 or not torch.equal(starts.cpu(), _starts_of_offsets(cu_q, nq)):
                raise ValueError("cu_seq_lens_q and position_ids describe different packed documents")
        return {"cu_seqlens": cu_q}
    if nq != nk or allowed is not None:
        return None
    ids = documents_from_positions(position_ids, batch, nq)
    return None if ids is None else {"document_ids": ids}


def lazy_causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                     attention_mask: Optional[Tensor] = None, **kwargs):
    """``AttentionMaskInterface`` builder of the poslsh implementations: None for self-attention
    without a padding mask (packed documents come from ``position_ids`` / ``cu_seq_lens``, in
    ``O(n)``), else ``sdpa``'s boolean 4-D mask. Masks made of extra mask functions (``use_vmap``)
    are always built."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (attention_mask is None and not kwargs.get("use_vmap", False) and isinstance(q_offset, int)
            and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0 and kv_length == q_length):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, **kwargs)
