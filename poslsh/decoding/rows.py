"""Batch rows at their own positions in a per-head window store: each row's first real token (left padding)
and the check that ``position_ids`` continue the cache. Positions are padded (index in the batch's token
sequence); ``pads[b]`` is row ``b``'s first real one (None: none yet)."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

__all__ = ["observe_rows", "check_row_positions"]


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
