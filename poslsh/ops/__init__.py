"""Backends of :func:`poslsh.poslsh_attention`, registered in :mod:`.registry`:
``"torch"`` (:mod:`.torch_impl`, portable near-linear), ``"triton"`` (:mod:`.triton`,
fused GPU kernels, when triton is installed) and ``"reference"`` (dense float64-safe
oracle from :mod:`poslsh.reference`)."""
from __future__ import annotations

from .registry import Backend, register_backend, registered, resolve

__all__ = ["Backend", "register_backend", "registered", "resolve", "load_backends"]

_loaded = False


def _reference(q, k, v, partitions, shape, causal, scale, span=None):
    from ..reference import poslsh_attention_reference
    starts = {} if span is None else {"q_start": span.q_start, "k_start": span.k_start}
    return poslsh_attention_reference(q, k, v, partitions, causal=causal, scale=scale, **starts)


def load_backends() -> None:
    """Import every backend module once (each registers itself); triton is optional."""
    global _loaded
    if _loaded:
        return
    from . import torch_impl  # noqa: F401  (registers "torch")
    register_backend("reference", _reference, lambda q: True, spans=True)
    try:
        from . import triton  # noqa: F401  (registers "triton" when triton is installed)
    except ImportError:
        pass
    _loaded = True
