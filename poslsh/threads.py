"""Intra-op thread counts set for a block of work and restored afterwards, so a
job that pins threads (small tensors run faster on one) leaks no global state."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

__all__ = ["intra_op_threads"]


@contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``; ``None`` or ``0`` leaves it alone."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)
