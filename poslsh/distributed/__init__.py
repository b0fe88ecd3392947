"""Context parallelism: attention over a sequence sharded across ranks, exchanging only halos.

Rank ``r`` of a process group holds the contiguous shard ``[S_r, S_r + L_r)`` of a
sequence of ``n`` tokens (shards ordered by rank, covering ``[0, n)``). Two positional
objects make a query see only nearby keys, so the queries of a shard see exactly the keys
``[lo_r, hi_r)`` (:func:`key_ranges`):

* :class:`~poslsh.partitions.Partitions` (positional LSH, fixed blocks): blocks are
  contiguous; ``lo_r`` = the earliest block start of the shard's first query over all heads
  and samples, ``hi_r`` = the shard end (causal) or the latest block end of its last query;
  the halo is bounded by the widest sampled block;
* :class:`~poslsh.AlibiWindow` (exact ALiBi cut at per-head windows): a halo of
  ``W = max_h w_h`` keys on the left (and on the right when not causal).

Either way the halo is independent of ``n``; exact ALiBi would need every key (ring
attention, ``O(n)`` communication per rank).

One call: (1) one ``all_gather`` of a few integers per rank, the shard and a fingerprint of
everything that decides the result (:mod:`.agreement`), checked the same way on every rank,
so a bad layout or a bad input on any rank fails on every rank with the same one-line
error instead of hanging; (2) one batched P2P exchange (:mod:`.exchange`): every rank sends
each other rank the part of its shard that the other's range covers, so a halo longer than
a neighbour's shard is served by the ranks beyond it directly (no relaying); (3) the local
kernel over ``[left halo | shard | right halo]`` with ``q_start``/``k_start``/``seq_len``.
Backward runs the exchange in reverse: the halo's ``dK``/``dV`` go back to their owners,
which add them to their own. Only tensors' devices decide where things run: gloo (CPU) and
NCCL (GPU) take the same path.

Waiting: a rank that stops participating (its process died, it hangs, or it skips the call
or its backward) cannot be detected by the others: they wait inside the collective until
the process group's timeout, ``dist.init_process_group(..., timeout=timedelta(minutes=m))``
(torch's default: 30 minutes for gloo, 10 for NCCL), or a sub-group's own
``dist.new_group(ranks, timeout=...)``; then the collective raises (gloo) or the NCCL
watchdog aborts the process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from ..decoding import Positional, attend
from .agreement import FIELDS, Agreed, agree, gather_layout, partitions_fingerprint, positional_fingerprint
from .exchange import CommStats, comm_stats, halo_exchange
from .layout import ShardLayout, key_ranges, shard_range

__all__ = ["ContextShard", "ShardLayout", "CommStats", "comm_stats", "context_parallel_attention", "shard_range",
           "key_ranges", "positional_fingerprint", "partitions_fingerprint", "gather_layout", "agree", "Agreed",
           "halo_exchange", "FIELDS"]


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal: bool = False,
                               scale: Optional[float] = None, shard_start: Optional[int] = None,
                               seq_len: Optional[int] = None, group=None, backend: str = "auto") -> Tensor:
    """Attention of a sequence sharded contiguously over the ranks of ``group``: positional LSH
    (:func:`poslsh.poslsh_attention`) for partitions, windowed ALiBi
    (:func:`poslsh.windowed_alibi_attention`) for a window. Every rank of the group calls it.

    Args:
        q: ``[B, Hq, L, d]`` this rank's queries, positions ``[shard_start, shard_start + L)``.
        k: ``[B, Hkv, L, d]``, v: ``[B, Hkv, L, dv]``: this rank's keys and values, same positions
            (``Hq`` a multiple of ``Hkv``; ``L`` may differ between ranks).
        positional: the :class:`~poslsh.partitions.Partitions` or the
            :class:`~poslsh.AlibiWindow` (``poslsh.window.make_window(slopes, window)``) of the
            ``Hq`` heads, identical on every rank (checked).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)`` (the resolved value is checked across ranks).
        shard_start: position of this rank's first token; ``None`` on every rank: the sum of
            the lengths of the lower ranks' shards. Shards must be contiguous, ordered by
            rank and cover ``[0, seq_len)`` (checked).
        seq_len: total length ``n`` (checked against the shards), default their sum.
        group: the process group (default: the world).
        backend: the local kernel (a backend that accepts queries and keys at given
            positions; ``"auto"`` picks one); resolved before any exchange, checked across ranks.

    Returns:
        ``[B, Hq, L, dv]``, this rank's rows of the single-device result. Differentiable in
        ``q``, ``k``, ``v``: backward returns the halo's ``dK``/``dV`` to their owners (every rank
        must run it: the exchange's backward is collective).

    Communication per call: one ``all_gather`` of ``len(FIELDS)`` = 17 integers per rank, then
    each rank receives its halos, ``(lo - start) + (hi - end)`` tokens of K and V (and sends
    the same amount of gradient back in backward), independent of ``n``. A rank whose peer
    stops participating waits until the process group's timeout (module docstring).
    """
    layout, scale, backend = agree(q, k, v, positional, causal=causal, scale=scale, shard_start=shard_start,
                                   seq_len=seq_len, group=group, backend=backend)
    k_local, v_local = halo_exchange(k, v, layout, group)
    return attend(q, k_local, v_local, positional, causal=causal, scale=scale, backend=backend,
                  q_start=layout.starts[layout.rank], k_start=layout.lo[layout.rank], seq_len=layout.seq_len)


@dataclass(frozen=True)
class ContextShard:
    """Where this rank's tokens sit in a context-parallel sequence: what a model passes down
    to its attention layers (e.g. ``model(x, poslsh_context=ContextShard(group, start, n))``
    with :mod:`poslsh.integrations.hf`). ``group``: the ranks sharing the sequence (``None``:
    the world); ``shard_start``: position of the first local token; ``seq_len``: ``n``."""

    group: object
    shard_start: int
    seq_len: int

    def attention(self, q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, mask: Optional[Tensor] = None,
                  window: Optional[int] = None, **kwargs) -> Tensor:
        """:func:`context_parallel_attention` of this shard (``kwargs``: causal, scale, backend).
        A model's attention mask or its sliding window (``window``, transformers' ``sliding_window``)
        cannot be sharded: one is an error. (An ALiBi window is part of ``positional``.)"""
        if mask is not None or window is not None:
            raise ValueError("context-parallel attention takes unpadded sequences only: no attention mask "
                             f"(got {'a mask' if mask is not None else 'none'}) and no sliding window (got {window})")
        return context_parallel_attention(q, k, v, positional, shard_start=self.shard_start, seq_len=self.seq_len,
                                          group=self.group, **kwargs)
