"""The call contract between the dispatcher and the backends: where queries and keys sit
(:class:`Span`) and one validated call (:class:`Call`), with the checks every backend relies on.

The dispatcher (:mod:`poslsh.attention`) builds a :class:`Call` once, checks it (shapes, positions,
documents, and that the keys cover every key the queries can see: :func:`check_covered`, the same
check and message on every backend), asks the registry (:mod:`.registry`) for a backend and hands
it the call. A backend reads the positional object through its protocol (:mod:`poslsh.positional`).
"""
from __future__ import annotations

from typing import FrozenSet, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._validation import AttnShape
from ..positional import Positional

__all__ = ["Span", "Call", "make_span", "check_covered"]


class Span(NamedTuple):
    """Absolute positions: query row ``i`` is token ``q_start + i``, key row ``j`` is token
    ``k_start + j``, in a sequence of ``seq_len`` tokens (blocks end there)."""

    q_start: int
    k_start: int
    n_q: int
    n_k: int
    seq_len: int

    @staticmethod
    def self_attention(n: int) -> "Span":
        return Span(0, 0, n, n, n)

    @property
    def is_self(self) -> bool:
        return self.q_start == self.k_start == 0 and self.n_q == self.n_k == self.seq_len

    @property
    def delta(self) -> int:
        """Query row ``i`` sits at key row ``i + delta``."""
        return self.q_start - self.k_start


class Call(NamedTuple):
    """One validated attention call, as the dispatcher hands it to a backend.

    ``positional`` is the op's positional object (:mod:`poslsh.positional`), already on
    ``q.device``; ``shape`` the :class:`~poslsh._validation.AttnShape`; ``span`` a :class:`Span`
    when queries and keys sit at given positions (None: self-attention); ``documents`` a
    :class:`~poslsh.documents.Documents` for packed sequences (None: one document per row);
    ``grid`` the ``(height, width)`` of the ``"nd"`` op. A backend returns ``(out [B, Hq, n, dv] in
    q.dtype, lse [B, Hq, n] or None)``; ``lse`` (float32, float64 for float64 input, natural log)
    is required when ``return_lse``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    positional: Positional
    shape: AttnShape
    causal: bool
    scale: float
    span: Optional[Span] = None
    documents: Optional[object] = None
    return_lse: bool = False
    grid: Optional[Tuple[int, int]] = None

    def needs(self) -> FrozenSet[str]:
        """The features this call needs (keys of :data:`poslsh.ops.registry.FEATURES`)."""
        out = set()
        if self.span is not None:
            out.add("spans")
        if self.documents is not None:
            out.add("documents")
        if self.return_lse:
            out.add("lse")
        return frozenset(out)


def _position(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def make_span(shape: AttnShape, causal: bool, q_start: Optional[int], k_start: Optional[int],
              seq_len: Optional[int]) -> Span:
    """Validate the positions of a call with queries and keys at given positions (a missing
    ``q_start`` or ``k_start`` is 0)."""
    q_start = _position("q_start", 0 if q_start is None else q_start)
    k_start = _position("k_start", 0 if k_start is None else k_start)
    q_end, k_end = q_start + shape.seqlen, k_start + shape.kv_len
    if seq_len is None:
        if not causal:
            raise ValueError("seq_len: non-causal attention at given positions needs the sequence length "
                             "(keys to the right of the queries count too)")
        seq_len = max(q_end, k_end)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < max(q_end, k_end):
        raise ValueError(f"seq_len must be an int >= the last query and key position + 1 "
                         f"({max(q_end, k_end)}), got {seq_len!r}")
    return Span(q_start, k_start, shape.seqlen, shape.kv_len, seq_len)


def check_covered(positional: Positional, span: Span, causal: bool) -> None:
    """The keys ``[k_start, k_start + n_k)`` must hold every key the queries ``[q_start, q_start + n_q)``
    can see (:meth:`~poslsh.positional.Positional.reach`); a ValueError names the gap. Inside
    ``torch.compile`` a runtime assert with the same rule."""
    if causal and span.k_start == 0 and span.n_k >= span.q_start + span.n_q:
        return      # every key from position 0 to the last query's is held: a causal reach is inside it
    pos = torch.arange(span.q_start, span.q_start + span.n_q, device=positional.device)
    first, end = positional.reach(pos, span.seq_len)                                   # [H, n_q]
    need_lo = first.amin()
    need_hi = (torch.minimum(end, pos + 1) if causal else end).amax()
    ok = (need_lo >= span.k_start) & (need_hi <= span.k_start + span.n_k)
    if torch.compiler.is_compiling():
        torch._assert_async(ok, "the keys must hold every key the queries can see (pass the missing keys)")
    elif not bool(ok):
        lo, hi = int(need_lo), int(need_hi)
        raise ValueError(
            f"keys cover positions [{span.k_start}, {span.k_start + span.n_k}) but the queries at "
            f"[{span.q_start}, {span.q_start + span.n_q}) can see keys in [{lo}, {hi}): pass keys from "
            f"k_start <= {lo} to at least {hi} (a cache must not drop keys a later query needs)")
