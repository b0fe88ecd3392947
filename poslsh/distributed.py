"""Context parallelism: positional-LSH attention over a sequence sharded across ranks.

Rank ``r`` of a process group holds the contiguous shard ``[S_r, S_r + L_r)`` of a
sequence of ``n`` tokens (shards ordered by rank, covering ``[0, n)``). A query sees
only keys in its own blocks, and blocks are contiguous, so the queries of a shard
see exactly the keys ``[lo_r, hi_r)``: ``lo_r`` = the earliest block start of the
shard's first query over all heads and samples, ``hi_r`` = the shard end (causal) or
the latest block end of its last query (non-causal). Outside the shard that is a
*halo*, bounded by the widest sampled block and independent of ``n``; exact ALiBi
would need every key (ring attention, ``O(n)`` communication per rank).

One call: (1) one ``all_gather`` of a few integers per rank (shard, shapes, a
fingerprint of the partitions), which every rank checks the same way, so a bad
layout fails on every rank with the same one-line error instead of hanging; every
rank then computes every rank's key range from the (verified identical)
partitions; (2) one batched P2P exchange (``batch_isend_irecv``): every rank
sends each other rank the part of its shard that the other's range covers, so a
halo longer than a neighbour's shard is served by the ranks beyond it directly
(no relaying); (3) the local kernel over ``[left halo | shard | right halo]``
through :func:`poslsh.poslsh_attention` with ``q_start``/``k_start``/``seq_len``.
Backward runs the exchange in reverse: the halo's ``dK``/``dV`` go back to their
owners, which add them to their own. Only tensors' devices decide where things
run: gloo (CPU) and NCCL (GPU) take the same path.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._validation import check_heads, check_qkv
from .attention import poslsh_attention
from .partitions import Partitions

__all__ = ["ContextShard", "ShardLayout", "CommStats", "comm_stats", "context_parallel_attention", "shard_range",
           "key_ranges", "partitions_fingerprint", "gather_layout", "halo_exchange"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Per-rank integers of the one metadata all_gather (their order in the gathered table).
_FIELDS = ("ok", "start", "length", "seq_len", "causal", "fingerprint", "batch", "q_heads", "kv_heads", "head_dim",
           "v_dim", "dtype")


@dataclass
class CommStats:
    """What the halo exchanges of this process sent and received (bytes, messages) and the
    seconds spent in them (waits for peers included). Reset with :meth:`reset`."""

    sent_bytes: int = 0
    received_bytes: int = 0
    messages: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.sent_bytes = self.received_bytes = self.messages = 0
        self.seconds = 0.0


comm_stats = CommStats()


def shard_range(seq_len: int, rank: int, world: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s shard when ``seq_len`` tokens are split into
    ``world`` contiguous shards ordered by rank (the first ``seq_len % world`` ranks
    get one token more)."""
    if not (0 <= rank < world <= seq_len):
        raise ValueError(f"cannot give rank {rank} of {world} a non-empty shard of {seq_len} tokens")
    base, extra = divmod(seq_len, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def key_ranges(partitions: Partitions, seq_len: int, starts: Sequence[int], lengths: Sequence[int],
               causal: bool) -> Tuple[List[int], List[int]]:
    """The keys ``[lo_r, hi_r)`` that the queries of each shard ``[starts[r], starts[r] +
    lengths[r])`` can see, over all heads and samples; each range holds its shard.

    Block starts and ends grow along the sequence, so a shard's first query has the
    earliest start and its last query the latest end: ``O(H s P)`` work for ``P``
    shards, whatever ``seq_len`` is."""
    first = torch.as_tensor(list(starts), dtype=torch.int64)
    last = first + torch.as_tensor(list(lengths), dtype=torch.int64) - 1
    start, _ = partitions.block_bounds(seq_len, first.to(partitions.device))     # [H, s, P]
    _, end = partitions.block_bounds(seq_len, last.to(partitions.device))
    lo = torch.minimum(start.amin((0, 1)).cpu(), first)
    hi = last + 1 if causal else torch.maximum(end.amax((0, 1)).cpu(), last + 1)
    return lo.tolist(), hi.tolist()


def partitions_fingerprint(partitions: Partitions) -> int:
    """A signed 64-bit hash of the partitions' shape, widths and offsets (bit for bit)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(tuple(partitions.widths.shape)).encode())
    for t in (partitions.widths, partitions.offsets):
        h.update(t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


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


def _one_line(what: str, values: Sequence[int]) -> str:
    return f"context-parallel ranks disagree on {what}: {list(values)} (rank by rank); every rank must pass the same"


def _check_table(table: List[List[int]], explicit: List[bool]) -> Tuple[List[int], List[int], int]:
    """Validate the gathered metadata (identically on every rank); returns starts, lengths, seq_len."""
    col = {name: [row[i] for row in table] for i, name in enumerate(_FIELDS)}
    for name in ("causal", "batch", "q_heads", "kv_heads", "head_dim", "v_dim", "dtype"):
        if len(set(col[name])) > 1:
            shown = [str(_DTYPES[x]) for x in col[name]] if name == "dtype" else col[name]
            raise ValueError(_one_line(name, shown))
    if len(set(col["fingerprint"])) > 1:
        groups = {}
        for r, fp in enumerate(col["fingerprint"]):
            groups.setdefault(fp, []).append(r)
        raise ValueError(f"context-parallel partitions differ across ranks (fingerprints split the ranks into "
                         f"{list(groups.values())}); every rank must use the same partitions (same seed, step, layer)")
    if len(set(explicit)) > 1:
        raise ValueError(f"context-parallel shard_start given on ranks {[r for r, e in enumerate(explicit) if e]} "
                         f"only: pass it on every rank or on none")
    lengths = col["length"]
    starts = col["start"] if explicit[0] else [sum(lengths[:r]) for r in range(len(lengths))]
    n = sum(lengths)
    given = {x for x in col["seq_len"] if x >= 0}
    if len(given) > 1 or (given and given != {n}) or len(set(x >= 0 for x in col["seq_len"])) > 1:
        raise ValueError(f"context-parallel seq_len {col['seq_len']} (rank by rank) must be the same on every rank "
                         f"and equal the shards' total length {n}")
    shown = " ".join(f"[{a}, {a + m})" for a, m in zip(starts, lengths))
    for r, (a, m) in enumerate(zip(starts, lengths)):
        expected = starts[r - 1] + lengths[r - 1] if r else 0
        if a != expected:
            where = f"rank {r - 1}'s shard ends at {expected}" if r else "the first shard must start at 0"
            raise ValueError(f"context-parallel shards must be contiguous and ordered by rank, covering [0, {n}): "
                             f"rank {r} holds [{a}, {a + m}) but {where} (shards rank by rank: {shown})")
    return starts, lengths, n


def gather_layout(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool,
                  shard_start: Optional[int] = None, seq_len: Optional[int] = None, group=None) -> ShardLayout:
    """One ``all_gather`` of each rank's metadata, checked identically on every rank, and
    every rank's key range from the partitions. ``q [B, Hq, L, d]``, ``k/v [B, Hkv, L, d|dv]``
    are this rank's shard (only their shapes, dtype and device are used)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context-parallel attention needs an initialised torch.distributed process group")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("context-parallel attention: this process is not a member of the given group")
    # A bad input on one rank must not leave the others waiting in a collective: every rank
    # joins the all_gather, and an error found locally is raised after it, on every rank.
    error, mine = None, [0] * len(_FIELDS)
    try:
        shape = check_qkv(q, k, v)
        check_heads(partitions, shape.q_heads)
        for name, x in (("shard_start", shard_start), ("seq_len", seq_len)):
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {x!r}")
        mine = [1, -1 if shard_start is None else shard_start, shape.seqlen, -1 if seq_len is None else seq_len,
                int(bool(causal)), partitions_fingerprint(partitions), shape.batch, shape.q_heads, shape.kv_heads,
                shape.head_dim, shape.v_dim, _DTYPES.index(q.dtype)]
    except (TypeError, ValueError) as e:
        error = e
    local = torch.tensor(mine, dtype=torch.int64, device=q.device if isinstance(q, Tensor) else "cpu")
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    table = torch.stack(parts).tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row[0] != 1]
    if failed:
        raise ValueError(f"context-parallel attention: bad input on rank(s) {failed} (see the error raised there)")
    starts, lengths, n = _check_table(table, [row[1] >= 0 for row in table])
    lo, hi = key_ranges(partitions, n, starts, lengths, bool(causal))
    return ShardLayout(rank, n, tuple(starts), tuple(lengths), tuple(lo), tuple(hi), bool(causal))


def _p2p(sends: List[Tuple[int, Tensor]], recvs: List[Tuple[int, Tensor]], group) -> None:
    """One batch of isend/irecv (peers are ranks of ``group``), waited for; counted in :data:`comm_stats`."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=p) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=p) for p, t in recvs]
    if not ops:
        return
    t0 = time.perf_counter()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    comm_stats.seconds += time.perf_counter() - t0
    comm_stats.messages += len(sends)
    comm_stats.sent_bytes += sum(t.numel() * t.element_size() for _, t in sends)
    comm_stats.received_bytes += sum(t.numel() * t.element_size() for _, t in recvs)


class _HaloExchange(torch.autograd.Function):
    """``k [B, Hkv, L, d]``, ``v [B, Hkv, L, dv]`` (this rank's shard) -> the same over its key
    range ``[lo, hi)``; backward sends the halo rows' gradients back to their owners and adds
    what comes back. A piece's K and V travel as one ``[B, Hkv, rows, d + dv]`` message."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, layout: ShardLayout, group):
        ctx.layout, ctx.group, d = layout, group, k.shape[-1]
        a, rank = layout.shard()[0], layout.rank
        sends = [(j, torch.cat([k[:, :, x - a:y - a], v[:, :, x - a:y - a]], -1)) for j, x, y in layout.sends()]
        recvs = [(j, k.new_empty(*k.shape[:2], y - x, d + v.shape[-1])) for j, x, y in layout.recvs()]
        _p2p(sends, recvs, group)
        # Peers' pieces in rank order tile [lo, start) and [end, hi) around the own shard.
        left, right = [t for j, t in recvs if j < rank], [t for j, t in recvs if j > rank]
        k_local = torch.cat([t[..., :d] for t in left] + [k] + [t[..., :d] for t in right], 2)
        v_local = torch.cat([t[..., d:] for t in left] + [v] + [t[..., d:] for t in right], 2)
        return k_local, v_local

    @staticmethod
    def backward(ctx, dk_local: Tensor, dv_local: Tensor):
        layout, d = ctx.layout, dk_local.shape[-1]
        a, b = layout.shard()
        lo = layout.lo[layout.rank]
        # Reverse of forward: what came from a peer goes back to it; what went out comes back.
        back = [(j, torch.cat([dk_local[:, :, x - lo:y - lo], dv_local[:, :, x - lo:y - lo]], -1))
                for j, x, y in layout.recvs()]
        incoming = [(x, y, dk_local.new_empty(*dk_local.shape[:2], y - x, d + dv_local.shape[-1]))
                    for _, x, y in layout.sends()]
        _p2p(back, [(j, t) for (j, _, _), (_, _, t) in zip(layout.sends(), incoming)], ctx.group)
        dk, dv = dk_local[:, :, a - lo:b - lo].clone(), dv_local[:, :, a - lo:b - lo].clone()
        for x, y, t in incoming:      # in rank order: the same sums on every run
            dk[:, :, x - a:y - a] += t[..., :d]
            dv[:, :, x - a:y - a] += t[..., d:]
        return dk, dv, None, None


def halo_exchange(k: Tensor, v: Tensor, layout: ShardLayout, group=None) -> Tuple[Tensor, Tensor]:
    """This rank's key range: ``k [B, Hkv, L, d]``, ``v [B, Hkv, L, dv]`` (its shard) ->
    ``k_local [B, Hkv, hi - lo, d]``, ``v_local [B, Hkv, hi - lo, dv]`` for keys ``[lo, hi)``
    of ``layout``, contiguous. Differentiable: gradients of halo rows flow back to their owners."""
    return _HaloExchange.apply(k, v, layout, group)


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool = False,
                               scale: Optional[float] = None, shard_start: Optional[int] = None,
                               seq_len: Optional[int] = None, group=None, backend: str = "auto") -> Tensor:
    """Positional-LSH attention (:func:`poslsh.poslsh_attention`) of a sequence sharded
    contiguously over the ranks of ``group``; every rank of the group calls it.

    Args:
        q: ``[B, Hq, L, d]`` this rank's queries, positions ``[shard_start, shard_start + L)``.
        k: ``[B, Hkv, L, d]``, v: ``[B, Hkv, L, dv]``: this rank's keys and values, same positions
            (``Hq`` a multiple of ``Hkv``; ``L`` may differ between ranks).
        partitions: :class:`Partitions` with ``Hq`` heads, identical on every rank (checked).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        shard_start: position of this rank's first token; ``None`` on every rank: the sum of
            the lengths of the lower ranks' shards. Shards must be contiguous, ordered by
            rank and cover ``[0, seq_len)`` (checked).
        seq_len: total length ``n`` (checked against the shards), default their sum.
        group: the process group (default: the world).
        backend: the local kernel (a backend that accepts queries and keys at given
            positions; ``"auto"`` picks one).

    Returns:
        ``[B, Hq, L, dv]``, this rank's rows of the single-device result. Differentiable in
        ``q``, ``k``, ``v``: backward returns the halo's ``dK``/``dV`` to their owners.

    Communication per call: one ``all_gather`` of 12 integers per rank, then each rank
    receives its halos, ``(lo - start) + (hi - end)`` tokens of K and V (and sends the
    same amount of gradient back in backward), independent of ``n``.
    """
    layout = gather_layout(q, k, v, partitions, causal=causal, shard_start=shard_start, seq_len=seq_len,
                           group=group)
    k_local, v_local = halo_exchange(k, v, layout, group)
    return poslsh_attention(q, k_local, v_local, partitions, causal=causal, scale=scale, backend=backend,
                            q_start=layout.starts[layout.rank], k_start=layout.lo[layout.rank],
                            seq_len=layout.seq_len)


@dataclass(frozen=True)
class ContextShard:
    """Where this rank's tokens sit in a context-parallel sequence: what a model passes down
    to its attention layers (e.g. ``model(x, poslsh_context=ContextShard(group, start, n))``
    with :mod:`poslsh.integrations.hf`). ``group``: the ranks sharing the sequence (``None``:
    the world); ``shard_start``: position of the first local token; ``seq_len``: ``n``."""

    group: object
    shard_start: int
    seq_len: int

    def attention(self, q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, mask: Optional[Tensor] = None,
                  window: Optional[int] = None, **kwargs) -> Tensor:
        """:func:`context_parallel_attention` of this shard (``kwargs``: causal, scale, backend).
        A model's attention mask or sliding window cannot be sharded: one is an error."""
        if mask is not None or window is not None:
            raise ValueError("context-parallel attention takes unpadded sequences only: no attention mask "
                             f"(got {'a mask' if mask is not None else 'none'}) and no sliding window (got {window})")
        return context_parallel_attention(q, k, v, partitions, shard_start=self.shard_start, seq_len=self.seq_len,
                                          group=self.group, **kwargs)
