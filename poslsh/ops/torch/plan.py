"""The torch backend's geometry: where the queries and keys sit (:class:`Span`) and, for every
query row, the key rows it may see (:class:`RowBounds`), for both ops and packed documents.

Every op of the backend is described the same way: per (head, query row, sample) one
contiguous block of key rows ``[start, end)``, non-decreasing along the rows of a document.

* positional LSH (``"sequence"``): the ``s`` blocks of the query's position, from the one block
  geometry of :mod:`poslsh.partitions`;
* the window op (``"window"``): one "sample" whose block is ``[i - w_h, i + w_h + 1)``, clipped
  to the sequence;
* packed documents (:mod:`poslsh.documents`): positions restart in every document, so a query's
  blocks are those of its *local* position, shifted by its document's start and cut at its end.

The tile plan (:mod:`.tiles`) needs nothing else. Plain torch. (:class:`Span`, the call
contract, lives in :mod:`.call`.)
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...partitions import Partitions
from ..call import Span

__all__ = ["Span", "RowBounds", "Layout", "row_bounds", "document_row_bounds", "window_row_bounds",
           "window_block_widths"]


class RowBounds(NamedTuple):
    """Per (head, query row, sample): the block of the query, as key rows ``[start, end)``
    (int64 ``[H, n_q, s]``; a row's bounds in all samples are contiguous); ``causal``
    says keys after the query are masked as well; query row ``i`` is key row ``i + delta``."""

    start: Tensor
    end: Tensor
    causal: bool
    delta: int = 0


class Layout(NamedTuple):
    """One packing of a row of ``n`` tokens into documents: per token the packed index of its
    document's first token (``start``) and one past its last (``end``), int64 ``[n]``."""

    start: Tensor
    end: Tensor

    def segments(self) -> Tuple[Tensor, Tensor]:
        """First token and one past the last of every document, in order (int64 ``[D]`` twice)."""
        first = torch.nonzero(self.start == torch.arange(self.start.numel(), device=self.start.device)).flatten()
        return first, self.end[first]


def row_bounds(partitions: Partitions, span, causal: bool, device) -> RowBounds:
    """Positional LSH: the query rows' blocks as key rows; ``span`` is a :class:`Span` or, for
    self-attention, the sequence length (the dispatcher has checked that the keys hold every key the
    queries can see: :func:`poslsh.ops.call.check_covered`)."""
    if not isinstance(span, Span):
        span = Span.self_attention(int(span))
    H, s = partitions.num_heads, partitions.num_samples
    if span.is_self:   # all positions: from the blocks, O(H s n) integer work
        n = span.seq_len
        blk = partitions.blocks(n)
        start = torch.repeat_interleave(blk.start, blk.length).view(H, s, n).transpose(1, 2)
        end = torch.repeat_interleave(blk.start + blk.length, blk.length).view(H, s, n).transpose(1, 2)
        return RowBounds(start.to(device).contiguous(), end.to(device).contiguous(), causal, 0)
    pos = torch.arange(span.q_start, span.q_start + span.n_q, device=partitions.device)
    start, end = partitions.block_bounds(span.seq_len, pos)                 # [H, s, n_q], absolute
    start, end = (x.transpose(1, 2).to(device).contiguous() - span.k_start for x in (start, end))
    return RowBounds(start, end, causal, span.delta)


def document_row_bounds(partitions: Partitions, layout: Layout, causal: bool, device) -> RowBounds:
    """Positional LSH over packed documents (self-attention): the blocks of each token's position
    inside its document (the partition laid over the document from its own start), shifted to
    packed rows and cut at the document's end, so no block reaches into another document.

    The blocks of ``[0, L)`` are those of ``[0, L_max)`` cut at ``L`` (the partition starts at 0
    either way), so one :func:`row_bounds` of the longest document serves every document: its
    rows are gathered at the local positions (``O(H s (L_max + n))``, the geometry of
    :meth:`~poslsh.partitions.Partitions.blocks`, bit-identical to ``block_bounds``)."""
    n = layout.start.numel()
    doc_start, doc_end = layout.start.to(device), layout.end.to(device)
    local = torch.arange(n, device=device) - doc_start
    longest = row_bounds(partitions, int((doc_end - doc_start).max()), causal, device)   # [H, L_max, s]
    start = longest.start.index_select(1, local) + doc_start[None, :, None]
    end = torch.minimum(longest.end.index_select(1, local) + doc_start[None, :, None], doc_end[None, :, None])
    return RowBounds(start.contiguous(), end.contiguous(), causal, 0)


def window_row_bounds(window: Tensor, span: Span, causal: bool, device, layout: Optional[Layout] = None) -> RowBounds:
    """The window op: query ``i`` (position ``p``) of head ``h`` sees the keys at
    ``[p - w_h, p + w_h]``, clipped to the sequence (or to its document with ``layout``): one
    block per row (``s = 1``), non-decreasing along the rows."""
    # (a window past the sequence is the whole sequence; clamping first keeps p + w in range)
    w = window.to(device=device, dtype=torch.int64).clamp(max=span.seq_len)[:, None]   # [H, 1]
    pos = torch.arange(span.q_start, span.q_start + span.n_q, device=device)   # absolute positions
    if layout is None:
        lo, hi = torch.zeros_like(pos), torch.full_like(pos, span.seq_len)
    else:                                                                      # self-attention: rows = positions
        lo, hi = layout.start.to(device), layout.end.to(device)
    start = torch.maximum(pos - w, lo)                                        # [H, n_q]
    end = torch.minimum(pos + w + 1, hi)
    return RowBounds((start - span.k_start)[..., None].contiguous(), (end - span.k_start)[..., None].contiguous(),
                     causal, span.delta)


def window_block_widths(window: Tensor) -> Tensor:
    """The block width of each head of a window, ``2 w_h + 1`` (``[H, 1]``, not clipped to the
    sequence, like a partition's bin widths): what the tile height is chosen from
    (:func:`~poslsh.ops.torch.tiles.choose_tiles`), so a packed document gets the tiles it gets alone."""
    return 2 * window.to(torch.int64).clamp(max=1 << 40)[:, None] + 1
