"""Packed sequences: several documents in one row, attention kept inside each document.

A row of ``n`` tokens holds consecutive documents; a token attends only to tokens of its own
document, and **positions restart at 0 in every document** (as Hugging Face's packed batches
do with their ``position_ids``): the token at packed index ``p`` of a document that starts at
``a`` sits at position ``p - a``. A packed document is therefore computed exactly as if it were
run alone, whatever its place in the row: positional LSH cuts every sampled block at the
document's edges (the partition is laid over each document from its own start), exact ALiBi
masks the other documents.

Two ways to describe them, converted here into one :class:`Documents`:

* ``cu_seqlens``: flash-attention's varlen convention, int ``[D + 1]`` offsets
  ``0 = c_0 <= c_1 <= ... <= c_D = n`` of the documents in a batch of one row (``B = 1``);
* ``document_ids``: int ``[B, n]``, the document of every token; every row may pack differently.
  A document is one run of equal ids: an id may not come back after another one.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._validation import check_has_values, require_values as _require

__all__ = ["Documents", "make_documents"]


class Documents(NamedTuple):
    """Per batch row and token: the packed index of the first token of its document (``start``)
    and one past its last (``end``), int64 ``[B, n]``. Both are non-decreasing along a row."""

    start: Tensor
    end: Tensor

    @property
    def same_in_every_row(self) -> bool:
        return bool((self.start == self.start[:1]).all())

    def positions(self) -> Tensor:
        """Every token's position inside its document, int64 ``[B, n]``."""
        return torch.arange(self.start.shape[1], device=self.start.device) - self.start

    def lengths(self, row: int = 0) -> Tensor:
        """The document lengths of one row, in order (int64 ``[D]``)."""
        first = torch.ones(self.start.shape[1], dtype=torch.bool, device=self.start.device)
        first[1:] = self.start[row, 1:] != self.start[row, :-1]
        return (self.end[row] - self.start[row])[first]

    def to(self, device) -> "Documents":
        return Documents(self.start.to(device), self.end.to(device))


def _integer(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    check_has_values(t, name)
    return t.to(torch.int64)


def _from_boundaries(first: Tensor) -> Documents:
    """``first [B, n]`` bool, True where a document starts (column 0 always)."""
    B, n = first.shape
    idx = torch.arange(n, device=first.device).expand(B, n)
    start = torch.where(first, idx, torch.zeros_like(idx)).cummax(1).values
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    end = torch.where(last, idx + 1, torch.full_like(idx, n)).flip(1).cummin(1).values.flip(1)
    return Documents(start.contiguous(), end.contiguous())


def make_documents(batch: int, n: int, *, cu_seqlens: Optional[Tensor] = None,
                   document_ids: Optional[Tensor] = None, device=None) -> Optional[Documents]:
    """Validate ``cu_seqlens`` or ``document_ids`` for a ``[batch, n]`` packed call and return
    :class:`Documents` on ``device`` (None when both are None). Errors name the argument."""
    if cu_seqlens is None and document_ids is None:
        return None
    if cu_seqlens is not None and document_ids is not None:
        raise ValueError("pass cu_seqlens (one packed row) or document_ids ([B, n]), not both")
    if cu_seqlens is not None:
        cu = _integer(cu_seqlens, "cu_seqlens")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [num_documents + 1], got shape {tuple(cu.shape)}")
        if batch != 1:
            raise ValueError(f"cu_seqlens describes one packed row (batch 1, flash-attention's convention), but "
                             f"the batch is {batch}: pass document_ids [B, n] for a batch of packed rows")
        cu = cu.cpu()
        _require((cu[0] == 0) & (cu[-1] == n) & (cu[1:] >= cu[:-1]).all(),
                 f"cu_seqlens must start at 0, never decrease and end at the sequence length {n}, got "
                 + ("other offsets" if torch.compiler.is_compiling() else _shown(cu)))
        # a document starts at every offset but the last (empty documents repeat one; an offset n starts none)
        marks = torch.zeros(n + 1, dtype=torch.int64).index_add_(0, cu[:-1].clamp(0, n), torch.ones_like(cu[:-1]))
        return _from_boundaries((marks[:n] > 0)[None]).to(device)
    ids = _integer(document_ids, "document_ids")
    if ids.shape != (batch, n):
        raise ValueError(f"document_ids must have shape [batch, seqlen] = [{batch}, {n}], got {tuple(ids.shape)}")
    ids = ids.to(device)
    first = torch.ones(batch, n, dtype=torch.bool, device=ids.device)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    # contiguous documents: as many runs of equal ids as distinct ids (counted on the sorted row)
    ordered = ids.sort(1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1) + 1
    scattered = first.sum(1) != distinct
    row = "a row" if torch.compiler.is_compiling() else f"row {int(scattered.to(torch.int8).argmax())}"
    _require(~scattered.any(), f"document_ids: {row} has a document whose tokens are not contiguous (an id comes "
             "back after another one); give every packed document its own id")
    return _from_boundaries(first)


def _shown(cu: Tensor) -> str:
    return str(cu.tolist() if cu.numel() <= 12 else cu[:6].tolist() + ['...'] + cu[-3:].tolist())
