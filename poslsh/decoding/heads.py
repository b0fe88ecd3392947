"""Per-head KV storage for ALiBi windows: each KV head keeps exactly its own window, ``w_j + 1`` rows.

Layout (:class:`HeadWindows`, one attention layer, ``B`` rows). One flat buffer ``K [B, N, d]``,
``V [B, N, dv]`` holds a ring per KV head: head ``j`` owns the rows ``[off_j, off_j + A_j)`` and
position ``x`` lives in row ``off_j + x mod C_j`` (``C_j = w_j + 1``, ``w_j`` the widest window of its
query heads: GQA). Before a ring is full its allocation ``A_j`` grows geometrically (by 1/8) up to
``C_j``, so a layer holds ``sum_j min(tokens, C_j)`` rows (at most 1/8 more while growing), never
``Hkv x max_j C_j``. ``pos [N]`` records each row's position (rows hold every batch row at the same
padded position; a row's own positions start at its first real token: left padding).

A decoding step (one token) writes its key into each ring (the overwritten row is the one key no later
query of that head can see), then attends **in place**: the KV heads are sorted by ring size and cut
into buckets of neighbours (:func:`head_buckets`: one batched matmul per bucket over the bucket's rows,
a bucket merged where an op call costs more than the extra products), each bucket a view of the
buffer; the bias ``-m_h (p - pos)`` is masked outside the head's window and its own ring. Nothing of
size ``Hkv x max window`` is built. A chunk of several tokens (prefill) gathers each ring in position
order once and calls the window op (``poslsh.attend``) per group of rows with equal padding.

Sink keys (``sinks=k``): the first ``k`` positions of every row are kept beside the rings and attended
with their ALiBi bias wherever they fall outside the window; the two parts merge through their lse.
The certificate (:mod:`.certificate`) checks every step's dropped mass.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..attention import attend
from ..positional import check_positional
from ..window.kind import make_window
from .certificate import Certificate, certify_step
from .rows import check_row_positions, observe_rows, row_groups
from .sinks import sink_attention

__all__ = ["HeadWindows", "head_buckets", "OP_COST"]

EMPTY = -(2 ** 62)          # the position of a row never written: farther than any window
FAR = 2 ** 61               # windows are clamped here (NO_WINDOW included): an empty row stays out of reach
GROW = 1.125                # a ring's allocation grows by this factor (and at least 64 rows) until full
OP_COST = 2 ** 18           # one more op call, in multiply-adds (bucketing)


def head_buckets(rows: Sequence[int], per_row: Sequence[int]) -> List[Tuple[int, int]]:
    """Cut heads (in order) into contiguous buckets ``[a, b)`` minimising
    ``sum_buckets (OP_COST + (sum_{a..b} per_row) * (sum_{a..b} rows))``: a bucket computes every one of
    its query heads against all of its rows (``per_row[j]``: multiply-adds per row per head, i.e. query
    heads x (d + dv)). Dynamic programming, O(H^2)."""
    H = len(rows)
    best, cut = [0.0] + [math.inf] * H, [0] * (H + 1)
    for b in range(1, H + 1):
        n = w = 0
        for a in range(b - 1, -1, -1):
            n, w = n + rows[a], w + per_row[a]
            c = best[a] + OP_COST + n * w
            if c < best[b]:
                best[b], cut[b] = c, a
    out, b = [], H
    while b > 0:
        out.append((cut[b], b))
        b = cut[b]
    return out[::-1]


class HeadWindows:
    """The per-head window KV cache of one attention layer (see the module docstring).

    Args:
        window: the layer's :class:`~poslsh.AlibiWindow` (``Hq`` query heads).
        scale: logit scale (default ``1 / sqrt(d)``).
        certificate: a :class:`~poslsh.decoding.Certificate` to check every step (None: none).
        sinks: keep the first ``sinks`` positions of every row exactly.
        backend: backend of the window op for chunks of several tokens.
        name: how messages name this cache (e.g. ``"layer 3"``).
    """

    def __init__(self, window, *, scale: Optional[float] = None, certificate: Optional[Certificate] = None,
                 sinks: int = 0, backend: str = "auto", name: str = "cache"):
        self.window = check_positional(window, "window", op="window")
        slopes, win = window.tensors()
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks: the number of first positions kept exactly must be an int >= 0, got {sinks!r}")
        self.slopes = slopes.detach().to("cpu", torch.float64)
        self.certificate, self.sinks, self.scale, self.backend, self.name = certificate, sinks, scale, backend, name
        w = [min(int(x), FAR) for x in win.tolist()]
        self.win = certificate.check_windows(w, f"{name}: window") if certificate is not None else w
        self.Hq = len(self.win)
        self.total = 0                            # tokens seen (padded) = position of the next query
        self.pads: Optional[List[Optional[int]]] = None
        self.K: Optional[Tensor] = None
        self.peak = 0                             # most rows one step attended to
        self.failed: Optional[str] = None
        self.stats: Dict[str, object] = {"steps": 0, "worst": 0.0, "exceeded": [0] * self.Hq,
                                         "widened": [0] * self.Hq}
        self._warned: set = set()
        self.last_bound: Optional[Tensor] = None  # [B, Hq, nq] of the last step (certificate)
        self.last_error_bound: Optional[Tensor] = None   # [B, Hq, nq, dv]

    # ------------------------------------------------------------------ layout
    def _init(self, k: Tensor, v: Tensor) -> None:
        B, Hkv, _, d = k.shape
        if self.Hq % Hkv:
            raise ValueError(f"k: {Hkv} key/value heads do not divide the window's {self.Hq} query heads")
        self.B, self.Hkv, self.r, self.d, self.dv = B, Hkv, self.Hq // Hkv, d, v.shape[-1]
        self.dtype, self.device = k.dtype, k.device
        self.pads = [None] * B if self.pads is None else self.pads
        self.alloc = [0] * Hkv
        self.K, self.V = k.new_zeros(B, 0, d), v.new_zeros(B, 0, self.dv)
        self.pos = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.owner: List[int] = []
        self.key_norm = k.new_zeros(B, Hkv, dtype=torch.float64)
        self.v_hi = v.new_full((B, Hkv, self.dv), -math.inf, dtype=torch.float64)
        self.v_lo = v.new_full((B, Hkv, self.dv), math.inf, dtype=torch.float64)
        self.sink_k, self.sink_v = k.new_zeros(B, Hkv, self.sinks, d), v.new_zeros(B, Hkv, self.sinks, self.dv)
        self.sink_n = [0] * B
        self.held_from = [0] * Hkv                # per KV head: no key before this padded position is held
        self._caps()
        self._layout(self.alloc)

    def _caps(self) -> None:
        self.kv_win = [max(self.win[j * self.r:(j + 1) * self.r]) for j in range(self.Hkv)]
        self.cap = [w + 1 for w in self.kv_win]

    def _layout(self, alloc: List[int]) -> None:
        """Re-lay the rings with allocations ``alloc`` (and the current capacities), keeping every live row."""
        order = sorted(range(self.Hkv), key=lambda j: (alloc[j], j))
        off, o = [0] * self.Hkv, 0
        for j in order:
            off[j], o = o, o + alloc[j]
        K, V = self.K.new_zeros(self.B, o, self.d), self.V.new_zeros(self.B, o, self.dv)
        pos = torch.full((o,), EMPTY, dtype=torch.int64, device=self.device)
        if self.K.shape[1]:
            own = torch.tensor(self.owner, dtype=torch.int64, device=self.device)
            capt = torch.tensor(self.cap, dtype=torch.int64, device=self.device)[own]
            keep = (self.pos != EMPTY) & (self.pos >= self.total - capt)
            src = torch.nonzero(keep).flatten()
            x = self.pos[src]
            dst = torch.tensor(off, dtype=torch.int64, device=self.device)[own[src]] + x % capt[src]
            K[:, dst], V[:, dst], pos[dst] = self.K[:, src], self.V[:, src], x
        self.K, self.V, self.pos, self.alloc, self.off, self.order = K, V, pos, list(alloc), off, order
        self.owner = [j for j in order for _ in range(alloc[j])]
        self._off_t = torch.tensor(off, dtype=torch.int64, device=self.device)
        self._cap_t = torch.tensor(self.cap, dtype=torch.int64, device=self.device)
        q_order = [h for j in order for h in range(j * self.r, (j + 1) * self.r)]
        self._q_order = torch.tensor(q_order, dtype=torch.int64, device=self.device)
        self._q_back = torch.argsort(self._q_order)
        self._buckets = []
        width = self.r * (self.d + self.dv + 8)
        for a, b in head_buckets([alloc[j] for j in order], [width] * len(order)):
            heads = order[a:b]
            lo, hi = off[heads[0]], off[heads[-1]] + alloc[heads[-1]]
            qh = [h for j in heads for h in range(j * self.r, (j + 1) * self.r)]
            own = torch.tensor(self.owner[lo:hi], dtype=torch.int64)
            qkv = torch.tensor(qh, dtype=torch.int64) // self.r
            win = torch.tensor([self.win[h] for h in qh], dtype=torch.int64)
            reach = torch.where(own[None] == qkv[:, None], win[:, None], torch.full_like(own[None], -1))
            neg = (-self.slopes[qh]).to(self.dtype if self.dtype.is_floating_point else torch.float32)
            self._buckets.append((a * self.r, b * self.r, lo, hi, reach.to(self.device), neg[:, None].to(self.device)))

    def effective_windows(self, p0: int, nq: int) -> Tensor:
        """``[Hq, nq]``: the window of each head at the queries ``[p0, p0 + nq)``, cut where a ring widened by the
        certificate has not refilled yet (its keys before ``held_from`` are gone)."""
        held = torch.tensor(self.held_from, device=self.device).repeat_interleave(self.r)[:, None]
        w = torch.tensor(self.win, device=self.device)[:, None]
        return torch.minimum(w, torch.arange(p0, p0 + nq, device=self.device)[None] - held)

    def _ensure(self, upto: int) -> None:
        """Room in every ring for the positions ``[upto - C_j, upto)``."""
        need = [min(c, upto) for c in self.cap]
        if all(a >= n for a, n in zip(self.alloc, need)):
            return
        self._layout([a if a >= n else min(c, max(n, math.ceil(GROW * a), a + 64))
                      for a, n, c in zip(self.alloc, need, self.cap)])

    # ------------------------------------------------------------------ rows
    def select_rows(self, index: Tensor) -> None:
        """Keep the batch rows ``index`` (beam reordering, selection), in that order."""
        idx = index.to(torch.int64).reshape(-1)
        rows = torch.arange(len(self.pads))[idx.cpu()].tolist()
        self.pads = [self.pads[i] for i in rows]
        if self.K is None:
            return
        self.sink_n = [self.sink_n[i] for i in rows]
        idx = idx.to(self.device)
        for name in ("K", "V", "key_norm", "v_hi", "v_lo", "sink_k", "sink_v"):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.B = len(rows)

    # ------------------------------------------------------------------ stats
    def kept_keys(self) -> Tensor:
        """Rows each KV head holds now: LongTensor ``[Hkv]`` (``min(tokens, w_j + 1)``, sinks apart)."""
        if self.K is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.tensor([min(self.total, c) for c in self.cap], dtype=torch.int64)

    def nbytes(self) -> int:
        """Bytes of the key/value storage (rings and sinks)."""
        if self.K is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.K, self.V, self.sink_k, self.sink_v))

    # ------------------------------------------------------------------ filling
    def fill(self, k: Tensor, v: Tensor, *, start: int = 0, pads: Optional[List[Optional[int]]] = None) -> None:
        """Hold the keys ``k [B, Hkv, L, d]`` / values of padded positions ``[start, start + L)`` (a prefill
        computed elsewhere), before any step; keeps each ring's last ``C_j`` of them."""
        if self.K is not None and self.total:
            raise ValueError(f"{self.name}: fill() starts a cache; this one already holds {self.total} tokens")
        if (self.certificate is not None or self.sinks) and start > 0:
            raise ValueError(f"k: the keys start at position {start}, but the certificate and the sinks need every "
                             "key of the sequence: pass the prefill's keys from position 0")
        self.pads = list(pads) if pads is not None else [0] * k.shape[0]
        self._init(k, v)
        L = k.shape[2]
        self.total = start + L
        self._ensure(self.total + 1)
        self._write(k, v, start)

    def _write(self, k: Tensor, v: Tensor, p0: int, valid: Optional[Tensor] = None) -> None:
        """Store the ``nq`` keys of positions ``[p0, p0 + nq)`` (each ring keeps its last ``C_j``), the norms,
        value ranges and sinks."""
        nq = k.shape[2]
        dev = self.device
        if nq == 1:
            slots = self._off_t + p0 % self._cap_t
            self.K[:, slots], self.V[:, slots] = k[:, :, 0], v[:, :, 0]
            self.pos[slots] = p0
        else:
            x = torch.arange(p0, p0 + nq, device=dev)
            keep = x[None] >= (p0 + nq - self._cap_t)[:, None]             # [Hkv, nq]
            jj, tt = torch.nonzero(keep, as_tuple=True)
            dst = self._off_t[jj] + x[tt] % self._cap_t[jj]
            self.K[:, dst], self.V[:, dst] = k[:, jj, tt], v[:, jj, tt]
            self.pos[dst] = x[tt]
        real = None
        if any(p is None or p > p0 for p in self.pads):                    # padding among the new tokens
            pads = torch.tensor([p0 + nq if p is None else p for p in self.pads], device=dev)
            real = (torch.arange(p0, p0 + nq, device=dev)[None] >= pads[:, None])[:, None, :, None]   # [B,1,nq,1]
        if self.certificate is not None:
            kn = k.to(torch.float64).norm(dim=-1, keepdim=True)
            vv = v.to(torch.float64)
            hi, lo = vv, vv
            if real is not None:
                kn, hi, lo = kn.masked_fill(~real, 0), vv.masked_fill(~real, -math.inf), vv.masked_fill(~real, math.inf)
            self.key_norm = torch.maximum(self.key_norm, kn.amax((2, 3)))
            self.v_hi, self.v_lo = torch.maximum(self.v_hi, hi.amax(2)), torch.minimum(self.v_lo, lo.amin(2))
        if self.sinks:
            for b, pad in enumerate(self.pads):
                if pad is None or self.sink_n[b] >= self.sinks:
                    continue
                o0 = max(pad, p0)
                take = min(p0 + nq, pad + self.sinks) - o0
                if take > 0:
                    self.sink_k[b, :, o0 - pad:o0 - pad + take] = k[b, :, o0 - p0:o0 - p0 + take]
                    self.sink_v[b, :, o0 - pad:o0 - pad + take] = v[b, :, o0 - p0:o0 - p0 + take]
                    self.sink_n[b] = o0 - pad + take

    # ------------------------------------------------------------------ a step
    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, valid: Optional[Tensor] = None,
               position_ids: Optional[Tensor] = None) -> Tensor:
        """Store the ``nq`` new keys/values ``k, v [B, Hkv, nq, d]`` at padded positions ``[total, total + nq)``
        and return the causal windowed ALiBi attention of their queries ``q [B, Hq, nq, d]``: ``[B, Hq, nq, dv]``
        (zero at padding). ``valid [B, nq]``: which new tokens are real (left padding; None: all);
        ``position_ids``: checked to continue the cache (:func:`.rows.check_row_positions`)."""
        if self.failed is not None:
            raise ValueError(f"{self.name}: {self.failed}; build a new cache")
        nq = q.shape[2]
        if q.dim() != 4 or k.dim() != 4 or k.shape[2] != nq or v.shape[:3] != k.shape[:3] or q.shape[0] != k.shape[0]:
            raise ValueError(f"q [B, Hq, nq, d], k / v [B, Hkv, nq, d] of the same nq new tokens expected, got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if q.shape[1] != self.Hq:
            raise ValueError(f"q: {q.shape[1]} query heads, the window has {self.Hq}")
        if self.K is None:
            self.pads = [None] * q.shape[0] if self.pads is None else self.pads
            self._init(k, v)
        elif tuple(k.shape[:2]) != (self.B, self.Hkv) or k.dtype != self.dtype or k.device != self.device:
            raise ValueError(f"k: got [B, Hkv] = {list(k.shape[:2])} {k.dtype} on {k.device}, the cache holds "
                             f"{[self.B, self.Hkv]} {self.dtype} on {self.device}: one cache per batch and layer")
        if nq == 0:
            return q.new_zeros(*q.shape[:3], v.shape[-1])
        if nq > 1 and not self._complete(self.total):   # a widened ring still refilling: token by token
            return torch.cat([self.attend(*(t[:, :, i:i + 1] for t in (q, k, v)), position_ids=None if position_ids
                                          is None else position_ids[..., i:i + 1], valid=None if valid is None
                                          else valid[:, i:i + 1]) for i in range(nq)], 2)
        observe_rows(self.pads, self.total, valid, nq)
        check_row_positions(self.pads, self.total, position_ids, valid, nq)
        p0 = self.total
        scale = q.shape[-1] ** -0.5 if self.scale is None else float(self.scale)
        if nq == 1:
            self._ensure(p0 + 1)
            self._write(k, v, p0)
            out, lse = self._step(q[:, :, 0], p0, scale)
            out, lse = out[:, :, None], (lse[:, :, None] if lse is not None else None)
        else:
            out, lse = self._chunk(q, k, v, p0, scale)
            self._ensure(p0 + nq)
            self._write(k, v, p0)
        if self.sinks and any(n for n in self.sink_n):
            out, lse = sink_attention(self, q, out, lse, p0, scale)
        self.total = p0 + nq
        if self.certificate is not None:
            certify_step(self, q, lse, p0, scale)
        return out

    def _floors(self, p: int) -> Optional[Tensor]:
        """Per row the first padded position it may see at query position ``p`` (None: no row needs a mask)."""
        lim = max(0, p + 1 - max(self.cap))        # the rings hold no position before lim
        if all(pad is not None and pad <= lim for pad in self.pads):
            return None
        return torch.tensor([p if pad is None or pad > p else pad for pad in self.pads], device=self.device)

    def _step(self, q: Tensor, p: int, scale: float) -> Tuple[Tensor, Optional[Tensor]]:
        """One query per row at padded position ``p``, its key already in the rings."""
        want_lse = self.certificate is not None or self.sinks > 0
        qs = q.index_select(1, self._q_order)
        floors = self._floors(p)
        outs, lses = [], []
        dist = p - self.pos                                 # [N], every ring at once
        distf = dist.to(q.dtype)
        for qa, qb, lo, hi, reach, neg in self._buckets:
            bias = (distf[lo:hi] * neg).masked_fill_(dist[lo:hi] > reach, -math.inf)
            if floors is not None:
                bias = bias.masked_fill((self.pos[lo:hi][None] < floors[:, None])[:, None], -math.inf)
            s = torch.baddbmm(bias.expand(q.shape[0], -1, -1), qs[:, qa:qb], self.K[:, lo:hi].transpose(1, 2),
                              alpha=scale)
            if want_lse:
                lse = torch.logsumexp(s, -1, keepdim=True)
                outs.append(torch.bmm(torch.exp(s - lse), self.V[:, lo:hi]))
                lses.append(lse[..., 0])
            else:
                outs.append(torch.bmm(torch.softmax(s, -1), self.V[:, lo:hi]))
        self.peak = max(self.peak, self.K.shape[1])
        out = torch.cat(outs, 1).index_select(1, self._q_back)
        lse = torch.cat(lses, 1).index_select(1, self._q_back) if want_lse else None
        if floors is not None and any(pad is None or pad > p for pad in self.pads):
            dead = torch.tensor([pad is None or pad > p for pad in self.pads], device=self.device)
            out = out.masked_fill(dead[:, None, None], 0)
            lse = lse.masked_fill(dead[:, None], -math.inf) if lse is not None else None
        return out, lse

    def _chunk(self, q: Tensor, k: Tensor, v: Tensor, p0: int, scale: float) -> Tuple[Tensor, Tensor]:
        """Queries ``[p0, p0 + nq)``: each ring in position order (its last ``w_j`` keys), then the window op per
        group of rows with equal padding."""
        B, nq = q.shape[0], q.shape[2]
        L = max(min(p0, c - 1) for c in self.cap)
        keys, vals = k, v
        if L > 0:
            kk, vk = self.ordered(L, self._cap_t - 1)
            keys, vals = torch.cat([kk, k], 2), torch.cat([vk, v], 2)
        self.peak = max(self.peak, keys.shape[2] * self.Hkv)
        window = make_window(self.slopes, torch.tensor(self.win)).to(self.device)
        out = q.new_zeros(B, self.Hq, nq, v.shape[-1])
        lse = torch.full((B, self.Hq, nq), -math.inf, dtype=torch.float64 if q.dtype == torch.float64 else
                         torch.float32, device=self.device)
        runs = [None if pad is None else (pad, p0 + nq) for pad in self.pads]
        for s, rows in row_groups(runs, p0, nq, p0 - L, keys.shape[2]).items():
            r = slice(None) if len(rows) == B else torch.tensor(rows, device=self.device)
            o, l = attend(q[r, :, s.i0:s.i1], keys[r, :, s.j0:s.j1], vals[r, :, s.j0:s.j1], window, causal=True,
                          scale=scale, backend=self.backend, q_start=s.q_start, k_start=s.k_start, return_lse=True)
            if len(rows) == B and s.i0 == 0:
                out, lse = o, l.to(lse.dtype)
            else:
                out[r, :, s.i0:s.i1], lse[r, :, s.i0:s.i1] = o, l.to(lse.dtype)
        return out, lse

    def _complete(self, p0: int) -> bool:
        """Every ring holds all of its last ``w_j`` positions before ``p0`` (not so while a widened ring refills)."""
        L = max(min(p0, c - 1) for c in self.cap)
        if L <= 0 or self.K is None:
            return True
        x = torch.arange(p0 - L, p0, device=self.device)
        need = x[None] >= (p0 - (self._cap_t - 1))[:, None]
        idx = torch.where(need, self._off_t[:, None] + x[None] % self._cap_t[:, None], torch.zeros_like(x[None]))
        return bool(((self.pos[idx] == x[None]) | ~need).all())

    def ordered(self, L: int, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """The keys and values of positions ``[total - L, total)`` in order, ``[B, Hkv, L, d]`` (a copy), zero
        where head ``j`` holds none or beyond its last ``keep[j]`` positions (default: all it holds)."""
        p0 = self.total
        keep = self._cap_t if keep is None else keep
        x = torch.arange(p0 - L, p0, device=self.device)
        have = x[None] >= (p0 - keep)[:, None]                                       # [Hkv, L]
        idx = torch.where(have, self._off_t[:, None] + x[None] % self._cap_t[:, None], torch.zeros_like(x[None]))
        have &= self.pos[idx] == x[None]
        gone = ~have[None, :, :, None]
        kk = self.K[:, idx.flatten()].view(self.B, self.Hkv, L, self.d).masked_fill(gone, 0)
        vk = self.V[:, idx.flatten()].view(self.B, self.Hkv, L, self.dv).masked_fill(gone, 0)
        return kk, vk

    def _own(self, p0: int, nq: int) -> Tensor:
        """``[B, 1, nq]`` each query's own position (negative at padding)."""
        pads = torch.tensor([p0 + nq if p is None else p for p in self.pads], device=self.device)
        return (torch.arange(p0, p0 + nq, device=self.device)[None] - pads[:, None])[:, None]
