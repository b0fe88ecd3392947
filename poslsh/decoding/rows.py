"""Batch rows at their own positions: each row's first real token (left padding), the check that
``position_ids`` continue a cache, and the groups of rows one op call each attends (:func:`row_groups`).
Positions are padded (index in the batch's token sequence); ``pads[b]`` is row ``b``'s first real one (None:
none yet). Used by the per-head window store and by every bounded or full cache of the Hugging Face
integration, so each rule is written once."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["observe_rows", "check_row_positions", "RowSpan", "row_groups"]


def observe_rows(pads: List[Optional[int]], total: int, valid: Optional[Tensor], nq: int) -> None:
    """Record in ``pads`` each row's first real (padded) position from ``valid [B, nq]``, which of the ``nq`` new
    tokens at ``[total, total + nq)`` are real (None: all); a row may only be padded before its first real token."""
    q_first = total
    firsts = [0] * len(pads) if valid is None else None
    if valid is not None:
        valid = valid.to("cpu", torch.bool)
        first = torch.where(valid.any(1), valid.to(torch.int8).argmax(1), nq)
        if not torch.equal(valid, torch.arange(nq)[None] >= first[:, None]):
            raise ValueError("attention_mask: a row has padding after a real token; a cache takes left padding "
                             "only (pad before the prompt, as generate() does)")
        firsts = first.tolist()
    for b, f in enumerate(firsts):
        if pads[b] is None:
            if f < nq:
                pads[b] = q_first + f
        elif f != 0:
            raise ValueError(f"attention_mask: row {b} has padding after its first real token; a cache takes "
                             "left padding only (pad before the prompt, as generate() does)")


def check_row_positions(pads: List[Optional[int]], total: int, position_ids: Optional[Tensor],
                        valid: Optional[Tensor], nq: int) -> None:
    """``position_ids [B, nq]`` of the real new tokens must continue the cache: counted from each row's
    first real token (what generate() passes) or from the padded start."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] != nq:
        return
    B = len(pads)
    pid = position_ids.expand(B, nq).cpu()
    padded = total + torch.arange(nq)
    first = torch.tensor([-1 if p is None else p for p in pads])
    own = padded[None] - first[:, None]
    real = (first >= 0)[:, None] & (padded[None] >= first[:, None])
    if valid is not None:
        real &= valid.cpu()
    bad = real & (pid != own) & (pid != padded[None])
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"position_ids: row {b} token {i} has position {int(pid[b, i])} but the cache, holding "
                         f"{total} tokens, expects {int(own[b, i])}: feed tokens in order, or start a "
                         "new cache for a new sequence")


class RowSpan(NamedTuple):
    """What one group of batch rows attends in one op call: the queries ``[i0, i1)`` and keys ``[j0, j1)`` of
    the call's tensors (along their token axis), at the rows' own positions ``q_start`` and ``k_start``."""

    i0: int
    i1: int
    j0: int
    j1: int
    q_start: int
    k_start: int


def row_groups(runs: Sequence[Optional[Tuple[int, int]]], q_first: int, nq: int, k_first: int,
               nk: int) -> Dict[RowSpan, List[int]]:
    """The rows of a batch grouped by what they attend, so that each group is one op call.

    Row ``b``'s real tokens are the padded positions ``runs[b] = (s, e)`` (None, or ``e <= s``: none), its own
    positions counting from ``s``; the call's queries sit at padded ``[q_first, q_first + nq)``, its keys at
    ``[k_first, k_first + nk)``. A row attends its queries inside ``[s, e)`` to its keys inside ``[s, e)``
    (causality and the positional object decide the rest); rows with no such query are left out (their output
    is the caller's). Groups in the order of their first row; an unpadded batch is one group of every row."""
    groups: Dict[RowSpan, List[int]] = {}
    for b, run in enumerate(runs):
        if run is None:
            continue
        s, e = run
        i0, i1 = max(s - q_first, 0), min(e - q_first, nq)
        if i1 <= i0:
            continue
        j0, j1 = max(s - k_first, 0), min(e - k_first, nk)
        groups.setdefault(RowSpan(i0, i1, j0, j1, q_first + i0 - s, k_first + j0 - s), []).append(b)
    return groups
