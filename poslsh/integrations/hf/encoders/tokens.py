"""Padded batch to unpadded tokens and back, and how the tokens go to the attention op.

The original models gather the real tokens of a padded batch ``[B, n]`` (attention mask 1) into
``[nnz, hidden]`` before the first layer and scatter them back after the last, with zeros at the
padded positions (MosaicBERT's ``unpad_input`` / ``pad_input``). A padded key only ever gets weight
``exp(-10000 + O(logits))``, which is 0 in float32 and float64, so attending over the real tokens
alone is the same softmax: that is what runs here, one document per row.

Attention calls: a row of at least :data:`SOLO_TOKENS` tokens attends in its own call of the
window op (its band kernels); consecutive shorter rows attend together in one packed call
(``cu_seqlens``), which saves the per-call overhead that dominates short rows. A row is always
computed the same way, alone or in any batch (the choice depends on its own length only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ...._validation import require_values

__all__ = ["Tokens", "unpad", "repad", "SOLO_TOKENS"]

SOLO_TOKENS = 256       # rows this long attend alone (measured: alone is faster from ~128-256 tokens on)


@dataclass
class Tokens:
    """The real tokens of a padded batch.

    Attributes:
        indices: int64 ``[nnz]``, each real token's index in the flattened ``[B * n]`` batch.
        batch, seqlen: ``B`` and ``n``.
        lengths: each row's number of real tokens (Python ints).
        calls: the attention calls, ``(first, end, cu_seqlens or None)`` over the packed tokens:
            one row alone (``None``) or a run of short rows with its ``cu_seqlens`` (int64 ``[D + 1]``,
            relative to ``first``).
    """

    indices: Tensor
    batch: int
    seqlen: int
    lengths: List[int]
    calls: List[Tuple[int, int, Optional[Tensor]]]

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


def unpad(attention_mask: Tensor) -> Tokens:
    """The :class:`Tokens` of ``attention_mask [B, n]`` (0/1 or bool; each row's ones one
    contiguous run: right or left padding). A row with gaps is refused: the original keeps the
    padded positions' distances, the packed tokens would not."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: [batch, seq_len] expected, got shape {tuple(attention_mask.shape)}")
    m = attention_mask
    if m.dtype != torch.bool:
        require_values(((m == 0) | (m == 1)).all(), "attention_mask: 0/1 values expected (1 = a real token)")
        m = m != 0
    B, n = m.shape
    mi = m.to(torch.int8)
    starts = (mi[:, 1:] > mi[:, :-1]).sum(1) + mi[:, 0]             # runs of ones per row
    require_values((starts <= 1).all(), "attention_mask: each row's real tokens must be one contiguous run (right "
                   "or left padding); a row with gaps would change the ALiBi distances: split it into rows")
    lengths = m.sum(1).tolist()
    indices = m.reshape(-1).nonzero().squeeze(1)
    calls: List[Tuple[int, int, Optional[Tensor]]] = []
    run: List[int] = []
    first = 0

    def flush():
        if run:
            cu = torch.tensor([0] + run, dtype=torch.int64, device=m.device).cumsum(0)
            calls.append((first - int(cu[-1]), first, cu))
            run.clear()

    for length in lengths:
        if length == 0:
            continue
        if length >= SOLO_TOKENS:
            flush()
            calls.append((first, first + length, None))
        else:
            run.append(length)
        first += length
    flush()
    return Tokens(indices, B, n, lengths, calls)


def repad(x: Tensor, tokens: Tokens) -> Tensor:
    """``x [nnz, ...]`` scattered back to ``[B, n, ...]`` with zeros at the padded positions."""
    out = x.new_zeros((tokens.batch * tokens.seqlen,) + tuple(x.shape[1:]))
    return out.index_copy(0, tokens.indices, x).view(tokens.batch, tokens.seqlen, *x.shape[1:])
