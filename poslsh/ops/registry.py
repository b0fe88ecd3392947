"""The backend registry: every implementation of the library's attention ops registers here.

Three ops share one registry:

* ``"sequence"``: positional LSH on a 1-D sequence (:func:`poslsh.poslsh_attention`),
  the positional object a :class:`~poslsh.partitions.Partitions`;
* ``"window"``: exact ALiBi cut at a per-head window (:func:`poslsh.windowed_alibi_attention`),
  the positional object an :class:`~poslsh.AlibiWindow`;
* ``"nd"``: positional LSH over token coordinates, on a 2-D token grid so far
  (:func:`poslsh.poslsh_attention_nd`), the positional object a :class:`~poslsh.partitions_nd.PartitionsND`.

The op of a call is its positional object's (``positional.op``, :mod:`poslsh.positional`).

A backend registers one function per op, ``fn(call: Call) -> (out, lse or None)``, with the
optional features it supports (:data:`FEATURES`) and ``why_not(q)``: ``None`` when it can run
on these tensors, else the reason in a few words (xformers' ``not_supported_reasons``).
``backend="auto"`` takes the first *preferred* backend, in decreasing ``priority``, that can run
and has every feature the call needs; naming a backend that cannot gives one ``ValueError``
that says why and which backends can. Backends register themselves when their module is
imported (:func:`poslsh.ops.load_backends`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple

from torch import Tensor

from .call import Call

__all__ = ["OPS", "FEATURES", "Call", "Backend", "register_backend", "mark_missing", "registered", "resolve", "reasons",
           "check_op"]

OPS = ("sequence", "window", "nd")


def check_op(op: str) -> str:
    """``op`` if it is one of :data:`OPS`."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op

# What a call may need beyond plain self-attention.
FEATURES = {
    "spans": "queries and keys at given positions (q_start / k_start / seq_len)",
    "documents": "packed documents (cu_seqlens / document_ids)",
    "lse": "the log-sum-exp (return_lse=True)",
}


@dataclass(frozen=True)
class Backend:
    name: str
    fns: Dict[str, Callable[[Call], Tuple[Tensor, Optional[Tensor]]]] = field(default_factory=dict)
    features: Dict[str, FrozenSet[str]] = field(default_factory=dict)   # per op
    why_not: Callable[[Tensor], Optional[str]] = lambda q: None          # None: can run on these tensors
    preferred: Callable[[Tensor], bool] = lambda q: False               # eligible for backend="auto"
    priority: int = 0                                                    # "auto" tries higher first

    def can_run(self, q: Tensor) -> bool:
        return self.why_not(q) is None

    def missing(self, op: str, needs: Iterable[str]) -> List[str]:
        """Why this backend cannot serve ``op`` with ``needs`` (empty: it can)."""
        if op not in self.fns:
            return [f"it does not implement the {op!r} op"]
        return [f"it does not support {FEATURES[f]}" for f in sorted(needs) if f not in self.features[op]]


_BACKENDS: Dict[str, Backend] = {}
_MISSING: Dict[str, str] = {}       # a known backend this installation lacks -> what it needs


def mark_missing(name: str, needs: str) -> None:
    """Backend ``name`` is not installed here; naming it says ``needs`` (not "unknown backend")."""
    _MISSING[name] = needs


def register_backend(name: str, fn: Callable[[Call], Tuple[Tensor, Optional[Tensor]]], *, op: str = "sequence",
                     features: Iterable[str] = (), why_not: Optional[Callable[[Tensor], Optional[str]]] = None,
                     preferred: Optional[Callable[[Tensor], bool]] = None, priority: Optional[int] = None) -> None:
    """Register ``fn`` as backend ``name``'s implementation of ``op`` (replacing an earlier one).

    ``why_not``, ``preferred`` and ``priority`` describe the backend as a whole; given again for
    another op they replace the earlier ones. ``preferred`` defaults to "never auto-picked"."""
    op = check_op(op)
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {sorted(FEATURES)}")
    old = _BACKENDS.get(name, Backend(name))
    _BACKENDS[name] = Backend(
        name, {**old.fns, op: fn}, {**old.features, op: frozenset(features)},
        why_not or old.why_not, preferred or old.preferred, old.priority if priority is None else priority)


def registered(op: Optional[str] = None) -> List[Backend]:
    """The registered backends (those implementing ``op`` when given), highest priority first."""
    return sorted((b for b in _BACKENDS.values() if op is None or op in b.fns), key=lambda b: -b.priority)


def reasons(backend: Backend, call_op: str, needs: Iterable[str], q: Tensor) -> List[str]:
    """Everything that stops ``backend`` from serving the call (empty: it can)."""
    out = backend.missing(call_op, needs)
    why = backend.why_not(q)
    if why:
        out.append(why)
    return out


def resolve(name: str, op: str, q: Tensor, needs: Iterable[str] = ()) -> Backend:
    """The backend ``name`` (or the ``"auto"`` choice) for an ``op`` call on ``q`` that needs
    the features ``needs``; a one-line ValueError that says why it cannot and which can."""
    needs = frozenset(needs)
    able = [b.name for b in registered(op) if not reasons(b, op, needs, q)]
    if name == "auto":
        for b in registered(op):
            if b.preferred(q) and not reasons(b, op, needs, q):
                return b
        wants = "".join(f", {FEATURES[f]}" for f in sorted(needs))
        raise ValueError(f"backend='auto': no backend runs the {op!r} op on {q.device} / {q.dtype} tensors{wants}"
                         + (f"; these can if named: {able}" if able else ""))
    if name not in _BACKENDS and name in _MISSING:
        raise ValueError(f"backend={name!r} is not available here: {_MISSING[name]}; available: {sorted(_BACKENDS)}")
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; available: {sorted(_BACKENDS)}")
    why = reasons(_BACKENDS[name], op, needs, q)
    if why:
        raise ValueError(f"backend={name!r} cannot run this call: {'; '.join(why)}; "
                         f"use backend='auto' or one of {able}")
    return _BACKENDS[name]
