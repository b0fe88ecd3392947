"""What a query can see, and streaming decoding with a bounded KV cache built on it.

Two positional objects decide which keys a query at position ``p`` sees:

* :class:`~poslsh.partitions.Partitions` (positional LSH, fixed blocks): the keys in the
  blocks that contain ``p``, one block per (head, sample). Along the sequence those blocks
  only move forward (block starts are non-decreasing in ``p``);
* :class:`~poslsh.AlibiWindow` (exact ALiBi cut at per-head windows): head ``h`` sees
  the keys ``[p - w_h, p + w_h]``, which also only move forward.

So once the next query is at position ``p``, every key before

    ``first_needed(p) = min over heads h (and samples t) of the first key h sees from p``

is dead for good: no later causal query can see it (partitions: the smallest block start
``start_{h,t}(p)``; a window: ``p - max_h w_h``, clamped at 0). Dropping those keys after each
step keeps attention *exactly* the model's own, not an approximation of it.

Size bound (:func:`cache_bound`): a block of a bin of width ``b`` holds at most ``ceil(b)``
positions, so after a step a layer with partitions keeps ``p - first_needed(p) <= max_block - 1``
keys, ``max_block = max_{h,t} ceil(b_{h,t})``, whatever the context length; eq. (4)
(:func:`poslsh.theory.block_size_bound`) bounds the widest bin with high probability
(:func:`cache_bound_whp`). A shared window keeps exactly ``min(p, max_h w_h)`` keys. A step of
``nq`` new tokens attends to at most ``bound + nq`` keys. One tensor for all heads holds the keys
of the head that needs the most; ``per_head=True`` gives what each query head needs on its own,
and an ALiBi window is stored that way (:mod:`.heads`: each KV head keeps ``w_j + 1`` rows).

:class:`KVWindow` is the cache of one attention layer for one stream (all batch rows at the
same positions); :func:`packed_windows` continues every document of a packed prefill as its
own stream. The transformers cache (:mod:`poslsh.integrations.hf.cache`) applies the same rule
per layer, with left padding. :mod:`poslsh.distributed` uses :func:`reach` for its halos.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ..attention import attend
from ..documents import make_documents
from ..ops import load_backends, registry
from ..positional import Positional, as_positions, check_positional
from ..theory import block_size_bound
from .heads import HeadWindows

__all__ = ["Positional", "check_positional", "attend", "reach", "first_needed", "cache_bound",
           "cache_bound_whp", "span_backend", "KVWindow", "document_rows", "packed_windows"]

SEQUENCE_KINDS = ("sequence", "window")     # the kinds a stream decodes with
PER_HEAD_STORES = {"window": HeadWindows}   # ops whose kinds keep a store per head (looked up like the registry)


def _stream_kind(positional, name: str = "positional") -> Positional:
    return check_positional(positional, name, op=SEQUENCE_KINDS)


def reach(positional: Positional, seq_len: int, positions) -> Tuple[Tensor, Tensor]:
    """The keys ``[first, end)`` a query at each of ``positions`` (int ``[P]``, in ``[0, seq_len)``)
    can see under some head (and sample), causality aside: int64 ``[P]`` each, on the CPU
    (:meth:`~poslsh.positional.Positional.reach` over the heads)."""
    pos = as_positions(positions)
    first, end = _stream_kind(positional).reach(pos.to(positional.device), seq_len)
    return first.amin(0).cpu(), end.amax(0).cpu()


def first_needed(positional: Positional, positions, *, per_head: bool = False) -> Tensor:
    """The first key position a causal query at each of ``positions`` (int ``[P]``, >= 0) can
    see, over all heads (and samples): int64 ``[P]``; keys before it are never seen by a query
    at ``p`` or later. ``per_head``: each query head's own first key, int64 ``[H, P]``."""
    return _stream_kind(positional).first_needed(positions, per_head=per_head)


def cache_bound(positional: Positional, *, per_head: bool = False) -> Union[int, List[int]]:
    """Most keys a layer keeps after a step (one cache tensor for all heads): partitions
    ``max_block - 1`` with ``max_block = max_{h,t} ceil(b_{h,t})`` (a bin of width ``b <= 1``
    holds one position); a window ``max_h w_h``. ``per_head``: what each query head needs."""
    return _stream_kind(positional).cache_bound(per_head=per_head)


def cache_bound_whp(sigma, num_samples: int, delta: float = 0.01) -> float:
    """Eq. (4) per head, maximised over heads: with probability at least ``1 - H * delta``
    the partitions drawn for bandwidths ``sigma`` (``[H]``) and ``num_samples`` samples
    give :func:`cache_bound` below this value, for any context length."""
    sig = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1)
    return max(block_size_bound(num_samples=num_samples, sigma=float(x), delta=delta) for x in sig) - 1.0


def span_backend(backend: str, q: Tensor, op: str = "sequence") -> str:
    """``backend`` if it runs ``op`` with queries and keys at given positions, else ``"auto"``
    (e.g. the Triton kernels compute self-attention only: decoding steps use the torch backend)."""
    load_backends()
    if backend == "auto":
        return backend
    ok = {b.name for b in registry.registered(op) if "spans" in b.features[op] and b.can_run(q)}
    return backend if backend in ok else "auto"


class KVWindow:
    """Bounded KV cache of one attention layer for one token stream.

    Every batch row sits at the same positions. With an :class:`~poslsh.AlibiWindow` (``per_head=True``,
    the default) each KV head keeps its own window in a ring (:class:`~poslsh.decoding.heads.HeadWindows`:
    ``sum_j (w_j + 1)`` rows, attended in place); otherwise (partitions, or ``per_head=False``) one tensor
    holds the keys and values of positions ``[start, end)`` for every head: :meth:`step` appends a chunk,
    attends its queries to the kept keys (``q_start = end``, ``k_start = start``), then drops every key
    before :func:`first_needed` of the next position, never more than :attr:`bound` keys after a step,
    ``bound + nq`` during one (see the module docstring).

    Args:
        positional: the layer's fixed :class:`Partitions` or :class:`AlibiWindow` (``Hq`` heads).
        scale: logit scale (default ``1 / sqrt(d)``).
        backend: backend of the op (one that accepts positions; others mean ``"auto"``).
        per_head: per-head storage where the kind has one (a window); False: one shared tensor.
        certificate: a :class:`~poslsh.decoding.Certificate` checked at every step (per-head windows only).
        sinks: keep the first ``sinks`` positions exactly (per-head windows only).
    """

    def __init__(self, positional: Positional, *, scale: Optional[float] = None, backend: str = "auto",
                 per_head: bool = True, certificate=None, sinks: int = 0):
        self.positional, self.scale, self.backend = _stream_kind(positional), scale, backend
        self.op = positional.op
        store = PER_HEAD_STORES.get(positional.op) if per_head else None
        if store is None and (certificate is not None or sinks):
            raise ValueError("certificate / sinks: only a per-head window cache checks a certificate or keeps sink "
                             "keys: pass a poslsh.AlibiWindow with per_head=True (positional LSH keeps its own bound)")
        self.store = None if store is None else store(positional, scale=scale, certificate=certificate, sinks=sinks,
                                                      backend=span_backend(backend, torch.empty(0), self.op))
        self._k: Optional[Tensor] = None     # [B, Hkv, end - start, d] (shared storage only)
        self._v: Optional[Tensor] = None     # [B, Hkv, end - start, dv]
        self.start = 0                       # position of the first kept key (per head: of the widest ring)
        self.end = 0                         # tokens seen = position of the next query
        self.peak = 0                        # most keys a step attended to
        self.bound = positional.cache_bound()

    @property
    def k(self) -> Optional[Tensor]:
        """``[B, Hkv, end - start, d]``: the kept keys (shared storage only)."""
        return self._shared("k", self._k)

    @k.setter
    def k(self, value: Optional[Tensor]) -> None:
        self._k = value

    @property
    def v(self) -> Optional[Tensor]:
        """``[B, Hkv, end - start, dv]``: the kept values (see :attr:`k`)."""
        return self._shared("v", self._v)

    @v.setter
    def v(self, value: Optional[Tensor]) -> None:
        self._v = value

    def _shared(self, name: str, value: Optional[Tensor]) -> Optional[Tensor]:
        if self.store is not None:
            raise AttributeError(f"KVWindow.{name}: a window cache stores each KV head's own window (no one "
                                 "[B, Hkv, size, d] tensor; kept_keys(), nbytes() say what it holds); "
                                 "KVWindow(window, per_head=False) keeps one shared tensor")
        return value

    @property
    def size(self) -> int:
        """Keys kept now (``end - start``): for every head, or (per-head storage) by the widest ring, which
        holds ``min(end, w + 1)``."""
        return self.end - self.start

    @property
    def needed_per_head(self) -> List[int]:
        """Of the kept keys, how many each query head can still see (``<= size``)."""
        return [self.end - int(f) for f in self.positional.first_needed([self.end], per_head=True)[:, 0]]

    def kept_keys(self) -> Tensor:
        """Keys each KV head holds now: LongTensor ``[Hkv]``."""
        if self.store is not None:
            return self.store.kept_keys()
        return torch.full((0 if self._k is None else self._k.shape[1],), self.size, dtype=torch.int64)

    def nbytes(self) -> int:
        """Bytes of the key/value storage."""
        if self.store is not None:
            return self.store.nbytes()
        return sum(t.numel() * t.element_size() for t in (self._k, self._v) if t is not None)

    def _sync(self) -> None:
        st = self.store
        self.end, self.peak = st.total, st.peak
        self.start = self.end - (int(st.kept_keys().max()) if st.K is not None and st.Hkv else 0)

    @classmethod
    def from_prefill(cls, positional: Positional, k: Tensor, v: Tensor, *, start: int = 0,
                     scale: Optional[float] = None, backend: str = "auto", **options) -> "KVWindow":
        """Continue a stream whose keys and values at positions ``[start, start + nk)`` are
        ``k [B, Hkv, nk, d]``, ``v [B, Hkv, nk, dv]`` (a prefill computed elsewhere, e.g.
        packed): keeps a copy of only the keys the next query can need. ``options``: as for the class."""
        win = cls(positional, scale=scale, backend=backend, **options)
        end = start + k.shape[2]
        keep_from = int(win.positional.first_needed([end])[0])
        if start > keep_from:
            raise ValueError(f"k: the keys start at position {start} but the next query, at {end}, can see keys "
                             f"from {keep_from}: pass the prefill's keys from position {keep_from} or earlier")
        if win.store is not None:
            win.store.fill(k, v, start=start)
            win._sync()
            return win
        win.k, win.v = (t[:, :, keep_from - start:].clone() for t in (k, v))
        win.start, win.end = keep_from, end
        return win

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend the next ``nq`` tokens.

        Args:
            q: ``[B, Hq, nq, d]`` queries at positions ``[end, end + nq)``.
            k: ``[B, Hkv, nq, d]``, v: ``[B, Hkv, nq, dv]`` their keys and values.
        Returns:
            ``[B, Hq, nq, dv]``: the causal attention of the chunk, equal to the rows
            ``[end, end + nq)`` of the full-sequence forward.
        """
        if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
            raise ValueError(f"q, k, v must hold the same nq new tokens, got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
        if self.store is not None:
            out = self.store.attend(q, k, v)
            self._sync()
            return out
        if self.k is not None and (k.shape[:2] != self.k.shape[:2] or k.dtype != self.k.dtype):
            raise ValueError(f"k: got [B, Hkv] = {list(k.shape[:2])} / {k.dtype}, the window holds "
                             f"{list(self.k.shape[:2])} / {self.k.dtype}: use one KVWindow per stream and layer")
        nq = q.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.peak = max(self.peak, self.k.shape[2])
        out = attend(q, self.k, self.v, self.positional, causal=True, scale=self.scale,
                     backend=span_backend(self.backend, q, self.op), q_start=self.end, k_start=self.start)
        self.end += nq
        self.evict()
        return out

    def evict(self) -> int:
        """Drop the keys no query at ``end`` or later can see; returns how many were dropped (shared storage;
        per-head rings overwrite their dead key at the next step)."""
        if self.store is not None:
            return 0
        keep_from = max(self.start, int(self.positional.first_needed([self.end])[0]))
        drop = keep_from - self.start
        if drop > 0:
            # A view: the next step's cat copies only the kept keys. After a long prompt most
            # of the storage is dead, so copy now rather than hold it for a step.
            keep = self.k.shape[2] - drop
            self.k, self.v = self.k[:, :, drop:], self.v[:, :, drop:]
            if drop > keep:
                self.k, self.v = self.k.clone(), self.v.clone()
            self.start = keep_from
        return drop


# ------------------------------------------------------------------ packed prefill
def document_rows(k: Tensor, v: Tensor, *, cu_seqlens: Optional[Tensor] = None,
                  document_ids: Optional[Tensor] = None) -> List[Tuple[Tensor, Tensor]]:
    """Split the keys ``k [B, Hkv, n, d]`` and values ``v [B, Hkv, n, dv]`` of a packed prefill into
    one ``(k_d [1, Hkv, L_d, d], v_d [1, Hkv, L_d, dv])`` per document (views), batch row by batch
    row, in order. Positions restart at 0 in every document (:mod:`poslsh.documents`), so
    ``k_d`` holds document ``d``'s keys at its own positions ``[0, L_d)``. With ``cu_seqlens``
    (``B = 1``) every one of its ``D`` documents gets an entry, empty ones included."""
    B, n = k.shape[0], k.shape[2]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k and v must agree in [batch, heads, seqlen], got {tuple(k.shape)} and {tuple(v.shape)}")
    docs = make_documents(B, n, cu_seqlens=cu_seqlens, document_ids=document_ids, device=k.device)
    if docs is None:
        raise ValueError("document_rows needs cu_seqlens or document_ids (the packed prefill's documents)")
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64).cpu()
        lengths = [(cu[1:] - cu[:-1]).tolist()]
    else:
        lengths = [docs.lengths(b).tolist() for b in range(B)]
    rows = []
    for b, row in enumerate(lengths):
        a = 0
        for m in row:
            rows.append((k[b:b + 1, :, a:a + m], v[b:b + 1, :, a:a + m]))
            a += m
    return rows


def packed_windows(positional: Positional, k: Tensor, v: Tensor, *, cu_seqlens: Optional[Tensor] = None,
                   document_ids: Optional[Tensor] = None, scale: Optional[float] = None,
                   backend: str = "auto") -> List[KVWindow]:
    """After a packed prefill (``k [B, Hkv, n, d]``, ``v [B, Hkv, n, dv]`` of the packed tokens and
    their documents): one :class:`KVWindow` per document (:func:`document_rows` order), each
    continuing its document exactly as if it had been run alone, positions from 0."""
    return [KVWindow.from_prefill(positional, kd, vd, scale=scale, backend=backend)
            for kd, vd in document_rows(k, v, cu_seqlens=cu_seqlens, document_ids=document_ids)]
