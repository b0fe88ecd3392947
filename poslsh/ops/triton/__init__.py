"""Fused Triton kernels for positional-LSH attention and for exact ALiBi in per-head windows
(the ``"triton"`` backend of the ``"sequence"`` and ``"window"`` ops).

Importing this package registers the backend with :mod:`poslsh.ops.registry` when
triton is installed, and does nothing otherwise. The backend runs

* on CUDA tensors (compiled kernels, autotuned), and
* on CPU tensors while ``TRITON_INTERPRET=1`` is set (Triton's interpreter:
  slow, for tests).

See ``docs/triton.md`` for the design.
"""
from __future__ import annotations

import os
from typing import Optional

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError:          # triton missing: the backend simply isn't registered
    triton = None

__all__ = ["AVAILABLE"]
AVAILABLE = triton is not None

if AVAILABLE:
    from ..registry import register_backend
    from ._config import MAX_HEAD_DIM, SUPPORTED_DTYPES, version_problem
    from ._ops import (attention, triton_attention_bwd, triton_attention_fwd, triton_window_bwd,
                       triton_window_fwd, window_attention)

    __all__ += ["attention", "window_attention", "triton_attention_fwd", "triton_attention_bwd",
                "triton_window_fwd", "triton_window_bwd", "is_available"]

    def why_not(q) -> Optional[str]:
        """None for CUDA tensors (fp16/bf16/fp32, head dim <= 256) and CPU tensors under
        ``TRITON_INTERPRET=1``; otherwise the reason."""
        if q.dtype not in SUPPORTED_DTYPES:
            return f"it runs {', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)} only, not {q.dtype}"
        if q.dim() == 4 and q.shape[-1] > MAX_HEAD_DIM:
            return f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}"
        if q.is_cuda or (q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
            return None
        return f"it needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got {q.device}"

    def is_available(q) -> bool:
        return why_not(q) is None

    def _sequence(call):
        return attention(call.q, call.k, call.v, call.positional, causal=call.causal, scale=call.scale,
                         return_lse=True, documents=call.documents)

    def _window(call):
        return window_attention(call.q, call.k, call.v, call.positional, causal=call.causal, scale=call.scale,
                                return_lse=True, documents=call.documents)

    # "auto" picks the kernel for CUDA tensors only (on CPU it runs under the interpreter: tests),
    # and only with a triton it can run on; backend="triton" on an older one raises the reason.
    # Not supported: queries and keys at given positions ("spans": decoding, context parallelism).
    _TOO_OLD = version_problem() is not None
    FEATURES = ("documents", "lse")
    register_backend("triton", _sequence, op="sequence", features=FEATURES, why_not=why_not,
                     preferred=lambda q: q.is_cuda and not _TOO_OLD, priority=10)
    register_backend("triton", _window, op="window", features=FEATURES)
