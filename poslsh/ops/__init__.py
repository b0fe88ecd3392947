"""Backends of the library's ops, registered in :mod:`.registry`:
``"torch"`` (:mod:`.torch_impl`, portable near-linear; :mod:`.torch_grid` for the ``"grid"``
op), ``"triton"`` (:mod:`.triton`, fused GPU kernels, when triton is installed), ``"flex"``
(:mod:`.flex`, PyTorch's FlexAttention, when torch has it) and ``"reference"`` (the dense
float64-safe oracles of :mod:`poslsh.reference`)."""
from __future__ import annotations

from .registry import Backend, Call, register_backend, registered, resolve

__all__ = ["Backend", "Call", "register_backend", "registered", "resolve", "load_backends"]

_loaded = False


def _reference_args(call: Call) -> dict:
    args = dict(causal=call.causal, scale=call.scale, return_lse=True)
    if call.span is not None:
        args.update(q_start=call.span.q_start, k_start=call.span.k_start)
    if call.documents is not None:       # a document's start index names it
        args.update(document_ids=call.documents.start)
    return args


def _reference_sequence(call: Call):
    from ..reference import poslsh_attention_reference
    return poslsh_attention_reference(call.q, call.k, call.v, call.positional, **_reference_args(call))


def _reference_window(call: Call):
    from ..reference import alibi_attention
    w = call.positional
    return alibi_attention(call.q, call.k, call.v, w.slopes, window=w.window, **_reference_args(call))


def _reference_grid(call: Call):
    from ..reference import poslsh_attention_reference_nd
    return poslsh_attention_reference_nd(call.q, call.k, call.v, call.positional, grid=call.grid, causal=call.causal,
                                         scale=call.scale, return_lse=True)


def load_backends() -> None:
    """Import every backend module once (each registers itself); triton is optional."""
    global _loaded
    if _loaded:
        return
    from . import torch_impl  # noqa: F401  (registers "torch")
    everything = ("spans", "documents", "lse")
    register_backend("reference", _reference_sequence, op="sequence", features=everything)
    register_backend("reference", _reference_window, op="window", features=everything)
    from . import torch_grid  # noqa: F401  (registers "torch" for the "grid" op)
    register_backend("reference", _reference_grid, op="grid", features=("lse",))
    try:
        from . import triton  # registers "triton" when triton is installed
        missing = None if triton.AVAILABLE else ('it needs the triton package and a CUDA GPU '
                                                 '(pip install "poslsh[triton]")')
    except ImportError as e:
        missing = f"importing triton failed ({e})"
    if missing:
        from .registry import register_missing
        register_missing("triton", missing)
    from . import flex  # noqa: F401  (registers "flex" when torch has FlexAttention)
    _loaded = True
