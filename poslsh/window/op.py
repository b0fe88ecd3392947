"""Exact ALiBi attention, whole or cut at a window per head: the fast op (every backend, ``O(n)``
memory); its dense float64 oracle is :func:`poslsh.reference.alibi_attention_reference`."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ..attention import POSITIONS_DOC, _dispatch
from .kind import make_window

__all__ = ["alibi_attention", "windowed_alibi_attention"]


def alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes, *, window: Union[int, Tensor, None] = None,
                    causal: bool = False, scale: Optional[float] = None, backend: str = "auto",
                    q_start: Optional[int] = None, k_start: Optional[int] = None, seq_len: Optional[int] = None,
                    cu_seqlens: Optional[Tensor] = None, document_ids: Optional[Tensor] = None,
                    return_lse: bool = False):
    """Exact ALiBi attention, ``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j``, whole or cut at a window
    per head (the strongest baseline of positional LSH), near-linear in memory on every backend.

    With ``window`` only the keys with ``|i - j| <= window_h`` attend (and ``j <= i`` when ``causal``):
    exact ALiBi inside the window, no weight outside, ``O(window_h)`` keys per query. The dropped tail is
    bounded by :func:`poslsh.theory.window_error_bound`; :func:`poslsh.theory.smallest_window` gives the
    smallest window for a tolerance. The log-sum-exp is ``log sum_j e^{s_ij - m_h |i - j|}``. Float64 in,
    float64 exact out (the same answer as the dense oracle,
    :func:`poslsh.reference.alibi_attention_reference`). With an :class:`~poslsh.AlibiWindow` already
    built, :func:`poslsh.attend` takes it as it is. ``poslsh.windowed_alibi_attention`` is this function.

    Args:
        q: ``[B, Hq, n, d]`` queries (float16, bfloat16, float32 or float64).
        k: ``[B, Hkv, nk, d]`` keys (``nk = n`` for self-attention); ``Hq`` a multiple of ``Hkv``
            (GQA: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, nk, dv]`` values.
        slopes: ``[Hq]`` ALiBi slopes ``m_h`` (:func:`poslsh.alibi_slopes`; from bandwidths, ``1 / sigma``),
            finite, ``>= 0``.
        window: ``None`` (the default): no cut, exact ALiBi over every key. Else keys with
            ``|i - j| <= window`` attend: an int for every head, or ``[Hq]`` (a sequence or an int tensor;
            whole floats too) (0: each query sees itself only; ``>= n``, ``inf`` or any window past int64:
            no cut). Positions are absolute with ``q_start`` / ``k_start`` and restart in every packed
            document.
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"``, ``"torch"`` (band kernels: query tiles against the key blocks they can see,
            ``O(n (w + 64) d)`` time, ``O(n)`` memory; every feature), ``"triton"``, ``"flex"`` or
            ``"reference"`` (dense ``n x n``); :func:`poslsh.available_backends` with ``op="window"`` lists them."""
    positional = make_window(slopes, window)
    return _dispatch(q, k, v, positional, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse)


alibi_attention.__doc__ += POSITIONS_DOC
# The same op under the name that puts the window first (the name of 0.2); one definition.
windowed_alibi_attention = alibi_attention
