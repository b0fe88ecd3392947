"""Where every rank's shard sits and which keys its queries can see (no communication)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..decoding import Positional, reach

__all__ = ["shard_range", "key_ranges", "ShardLayout"]


def shard_range(seq_len: int, rank: int, world: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s shard when ``seq_len`` tokens are split into
    ``world`` contiguous shards ordered by rank (the first ``seq_len % world`` ranks
    get one token more)."""
    if not (0 <= rank < world <= seq_len):
        raise ValueError(f"cannot give rank {rank} of {world} a non-empty shard of {seq_len} tokens")
    base, extra = divmod(seq_len, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def key_ranges(positional: Positional, seq_len: int, starts: Sequence[int], lengths: Sequence[int],
               causal: bool) -> Tuple[List[int], List[int]]:
    """The keys ``[lo_r, hi_r)`` that the queries of each shard ``[starts[r], starts[r] +
    lengths[r])`` can see, over all heads (and samples); each range holds its shard.

    What a query sees only moves forward along the sequence (block starts and ends grow;
    a window is ``[p - w_h, p + w_h]``), so a shard's first query has the earliest first key
    and its last query the latest last one: ``O(H s P)`` work for ``P`` shards with
    partitions, ``O(P)`` with a window (a halo of ``max_h w_h``), whatever ``seq_len`` is."""
    first = torch.as_tensor(list(starts), dtype=torch.int64)
    last = first + torch.as_tensor(list(lengths), dtype=torch.int64) - 1
    lo = torch.minimum(reach(positional, seq_len, first)[0], first)
    hi = last + 1 if causal else torch.maximum(reach(positional, seq_len, last)[1], last + 1)
    return lo.tolist(), hi.tolist()


def _intersect(a0: int, a1: int, b0: int, b1: int) -> Optional[Tuple[int, int]]:
    lo, hi = max(a0, b0), min(a1, b1)
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class ShardLayout:
    """Every rank's shard ``[starts[r], starts[r] + lengths[r])`` and key range
    ``[lo[r], hi[r))`` in a sequence of ``seq_len`` tokens; ``rank`` is this process."""

    rank: int
    seq_len: int
    starts: Tuple[int, ...]
    lengths: Tuple[int, ...]
    lo: Tuple[int, ...]
    hi: Tuple[int, ...]
    causal: bool = True

    @property
    def world(self) -> int:
        return len(self.starts)

    def shard(self, r: Optional[int] = None) -> Tuple[int, int]:
        r = self.rank if r is None else r
        return self.starts[r], self.starts[r] + self.lengths[r]

    def sends(self) -> List[Tuple[int, int, int]]:
        """``(peer, a, b)``: positions ``[a, b)`` of this rank's shard that ``peer`` needs."""
        mine = self.shard()
        return [(j, *x) for j in range(self.world) if j != self.rank
                and (x := _intersect(*mine, self.lo[j], self.hi[j])) is not None]

    def recvs(self) -> List[Tuple[int, int, int]]:
        """``(peer, a, b)``: positions ``[a, b)`` of ``peer``'s shard this rank needs, by rank:
        with the own shard they tile ``[lo, hi)`` in order."""
        return [(j, *x) for j in range(self.world) if j != self.rank
                and (x := _intersect(*self.shard(j), self.lo[self.rank], self.hi[self.rank])) is not None]

    def halo(self, r: Optional[int] = None) -> Tuple[int, int]:
        """Halo lengths (left, right) of rank ``r`` (default: this rank)."""
        r = self.rank if r is None else r
        a, b = self.shard(r)
        return a - self.lo[r], self.hi[r] - b
