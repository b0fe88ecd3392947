"""Backends of the library's ops, registered in :mod:`.registry`:
``"torch"`` (:mod:`.torch`, portable near-linear: :mod:`.torch.ops` for the 1-D ops, :mod:`.torch.grid`
for the ``"nd"`` op), ``"triton"`` (:mod:`.triton`, fused GPU kernels, when triton is installed), ``"flex"``
(:mod:`.flex`, PyTorch's FlexAttention, when torch has it) and ``"reference"`` (the dense
float64-safe oracles of :mod:`poslsh.reference`)."""
from __future__ import annotations

from torch import __version__ as _TORCH_VERSION    # the name ``torch`` here is the subpackage .torch

from .registry import Backend, Call, mark_missing, register_backend, registered, resolve

__all__ = ["Backend", "Call", "register_backend", "registered", "resolve", "load_backends"]

_loaded = False
TRITON_REQUIREMENT = "triton>=3.4"     # the [triton] extra of pyproject.toml (a test checks they agree)


def _reference(call: Call):
    """The dense oracle of either 1-D op (:func:`poslsh.reference.reference_attention`)."""
    from ..reference import reference_attention
    span = call.span
    return reference_attention(call.q, call.k, call.v, call.positional, causal=call.causal, scale=call.scale,
                               q_start=None if span is None else span.q_start,
                               k_start=None if span is None else span.k_start, documents=call.documents,
                               return_lse=True)


def _reference_grid(call: Call):
    from ..reference import poslsh_attention_reference_nd
    return poslsh_attention_reference_nd(call.q, call.k, call.v, call.positional, grid=call.grid, causal=call.causal,
                                         scale=call.scale, return_lse=True)


def load_backends() -> None:
    """Import every backend module once (each registers itself); triton is optional."""
    global _loaded
    if _loaded:
        return
    from .torch import ops  # noqa: F401  (registers "torch" for the "sequence" and "window" ops)
    everything = ("spans", "documents", "lse")
    register_backend("reference", _reference, op="sequence", features=everything)
    register_backend("reference", _reference, op="window", features=everything)
    from .torch import grid  # noqa: F401  (registers "torch" for the "nd" op)
    register_backend("reference", _reference_grid, op="nd", features=("lse",))
    from . import triton  # (registers "triton" when triton is installed)
    if not triton.AVAILABLE:
        mark_missing("triton", f'it needs triton, which is not installed (pip install "{TRITON_REQUIREMENT}", the '
                     "[triton] extra of poslsh), and CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    from . import flex  # (registers "flex" when torch has FlexAttention)
    if not flex.AVAILABLE:
        mark_missing("flex", f"it needs FlexAttention (torch.nn.attention.flex_attention), which torch "
                     f"{_TORCH_VERSION} does not have")
    _loaded = True
