"""``poslsh_attention``: the public op and its backend dispatcher."""
from __future__ import annotations

from typing import Callable, Dict, Optional

from torch import Tensor

from ._validation import AttnShape, check_heads, check_qkv, check_scale
from .partitions import Partitions
from .reference import poslsh_attention_reference

__all__ = ["poslsh_attention", "available_backends", "register_backend"]

# name -> (is_available(q) -> bool, fn(q, k, v, partitions, shape, causal, scale) -> out)
_BACKENDS: Dict[str, tuple] = {}
# Preference order for backend="auto": the first available one wins. The Triton
# kernel is only auto-selected for CUDA tensors (on CPU it runs only under the
# interpreter, TRITON_INTERPRET=1, for tests).
_AUTO_ORDER = ["triton", "torch"]


def register_backend(name: str, fn: Callable, is_available: Callable[[Tensor], bool]) -> None:
    """Register a backend; ``fn(q, k, v, partitions, shape, causal, scale) -> out``."""
    _BACKENDS[name] = (is_available, fn)


def _torch_backend(q, k, v, partitions, shape: AttnShape, causal: bool, scale: float) -> Tensor:
    from .ops import torch_impl

    return torch_impl.attention(q, k, v, partitions, shape, causal, scale)


def _reference_backend(q, k, v, partitions, shape, causal, scale) -> Tensor:
    return poslsh_attention_reference(q, k, v, partitions, causal=causal, scale=scale)


register_backend("torch", _torch_backend, lambda q: True)
register_backend("reference", _reference_backend, lambda q: True)


def _load_optional_backends() -> None:
    try:  # the Triton kernel registers itself on import when triton is installed
        from .ops import triton as _triton  # noqa: F401
    except ImportError:
        pass


def available_backends(q: Optional[Tensor] = None) -> list:
    """Names of the backends usable for ``q`` (all registered ones when ``q`` is None)."""
    _load_optional_backends()
    return [name for name, (ok, _) in _BACKENDS.items() if q is None or ok(q)]


def poslsh_attention(q: Tensor, k: Tensor, v: Tensor, partitions: Partitions, *, causal: bool = False,
                     scale: Optional[float] = None, backend: str = "auto") -> Tensor:
    """Positional-LSH approximation of ALiBi attention (paper section 4).

    Computes, for every query ``i``,
    ``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
    with ``s_ik = scale * q_i . k_k`` (keys ``k <= i`` only when ``causal``), where
    ``block_t(i)`` is the block of ``i`` in sample ``t`` of ``partitions``: the
    ALiBi weights ``exp(-|i-k|/sigma)`` replaced by the mean mask ``M~``.

    Args:
        q: ``[B, Hq, n, d]`` queries.
        k: ``[B, Hkv, n, d]`` keys; ``Hq`` must be a multiple of ``Hkv`` (GQA:
            query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, n, dv]`` values.
        partitions: :class:`Partitions` with ``Hq`` heads (any device).
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"`` (fastest available), ``"torch"`` (portable, near
            linear: ``O(n d s b)`` time, ``O(n (d + s))`` memory), ``"triton"``
            (fused GPU kernel, CUDA tensors) or ``"reference"`` (dense ``n x n``).

    Returns:
        ``[B, Hq, n, dv]`` in ``q.dtype``. Differentiable in ``q``, ``k``, ``v``.
    """
    if not isinstance(partitions, Partitions):
        raise TypeError(f"partitions must be a poslsh.Partitions, got {type(partitions).__name__}")
    shape = check_qkv(q, k, v)
    check_heads(partitions, shape.q_heads)
    scale = check_scale(scale, shape.head_dim)
    _load_optional_backends()
    if backend == "auto":
        backend = next(name for name in _AUTO_ORDER if name in _BACKENDS and _BACKENDS[name][0](q)
                       and (name != "triton" or q.is_cuda))
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {sorted(_BACKENDS)}")
    is_available, fn = _BACKENDS[backend]
    if not is_available(q):
        raise ValueError(f"backend {backend!r} cannot run on {q.device} / {q.dtype} tensors")
    return fn(q, k, v, partitions.to(q.device), shape, bool(causal), scale)
