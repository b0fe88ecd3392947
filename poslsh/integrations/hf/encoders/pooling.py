"""Sentence embeddings from an encoder's ``last_hidden_state``: mean over the attention mask (what
sentence-transformers does for Jina-v2 and DNABERT-S, and ``JinaBertModel.encode``) or the first
position (``"cls"``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["pool_embeddings"]


def pool_embeddings(last_hidden_state: Tensor, attention_mask: Optional[Tensor] = None, *,
                    how: str = "mean") -> Tensor:
    """``[B, n, hidden]`` -> ``[B, hidden]``.

    ``how="mean"``: ``sum_t h_t mask_t / max(sum_t mask_t, 1e-9)`` (sentence-transformers' mean
    pooling; a row with no token gives 0); ``how="cls"``: ``h[:, 0]`` (the first position of the
    padded row, as BERT's pooler reads it: with left padding that is a padded position).
    ``attention_mask [B, n]`` (default all ones)."""
    if last_hidden_state.dim() != 3:
        raise ValueError(f"last_hidden_state: [batch, seq_len, hidden] expected, got {tuple(last_hidden_state.shape)}")
    if how == "cls":
        return last_hidden_state[:, 0]
    if how != "mean":
        raise ValueError(f"how: 'mean' or 'cls', got {how!r}")
    if attention_mask is None:
        return last_hidden_state.mean(1)
    m = attention_mask.to(last_hidden_state.dtype).unsqueeze(-1)
    return (last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1e-9)
