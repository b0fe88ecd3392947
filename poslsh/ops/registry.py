"""The backend registry: every implementation of ``poslsh_attention`` registers here.

A backend is a function ``fn(q, k, v, partitions, shape, causal, scale) -> out``
plus two predicates on the query tensor: ``can_run(q)`` (it would work on these
tensors) and ``preferred(q)`` (``backend="auto"`` may pick it). ``"auto"`` takes
the first preferred backend in decreasing ``priority``. Backends register
themselves when their module is imported (:func:`poslsh.ops.load_backends`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from torch import Tensor

__all__ = ["Backend", "register_backend", "registered", "resolve"]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[..., Tensor]              # (q, k, v, partitions, shape, causal, scale) -> out
    can_run: Callable[[Tensor], bool]      # usable for these tensors
    preferred: Callable[[Tensor], bool]    # eligible for backend="auto"
    priority: int = 0                      # "auto" tries higher priorities first
    spans: bool = False                    # accepts span= (queries and keys at given positions)


_BACKENDS: Dict[str, Backend] = {}


def register_backend(name: str, fn: Callable[..., Tensor], can_run: Callable[[Tensor], bool], *,
                     preferred: Optional[Callable[[Tensor], bool]] = None, priority: int = 0,
                     spans: bool = False) -> None:
    """Register (or replace) backend ``name``; ``preferred`` defaults to "never auto-picked";
    ``spans``: ``fn`` also takes ``span=`` (:class:`poslsh.ops.torch_plan.Span`)."""
    _BACKENDS[name] = Backend(name, fn, can_run, preferred or (lambda q: False), priority, spans)


def registered() -> List[Backend]:
    """All registered backends, highest priority first."""
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


def resolve(name: str, q: Tensor, *, spans: bool = False) -> Backend:
    """The backend ``name`` (or the ``"auto"`` choice) for ``q``; a ValueError that
    names the backend and the way out when it cannot run. ``spans``: the call places
    queries and keys at given positions, which only some backends support."""
    if name == "auto":
        for b in registered():
            if b.preferred(q) and b.can_run(q) and (b.spans or not spans):
                return b
        raise ValueError(f"backend='auto': no registered backend can run on {q.device} / {q.dtype} tensors")
    if name not in _BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; available: {sorted(_BACKENDS)}")
    b = _BACKENDS[name]
    if spans and not b.spans:
        raise ValueError(f"backend={name!r} computes self-attention only (q_start = k_start = 0, equal lengths); "
                         f"use one of {[x.name for x in registered() if x.spans]} for queries and keys at other positions")
    if not b.can_run(q):
        raise ValueError(f"backend={name!r} cannot run on {q.device} / {q.dtype} tensors; "
                         f"use backend='auto' or one of {[x.name for x in registered() if x.can_run(q)]}")
    return b
