"""The halo exchange: one batch of point-to-point messages, differentiable."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import ShardLayout

__all__ = ["CommStats", "comm_stats", "halo_exchange"]


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
    of ``layout``, contiguous. Differentiable: gradients of halo rows flow back to their owners.
    Collective in forward *and* backward: every rank of ``group`` runs both."""
    return _HaloExchange.apply(k, v, layout, group)
