"""The window op: exact ALiBi attention cut at a window per head (the strongest rival of positional LSH)."""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from .._compat import one_rate
from ..attention import POSITIONS_DOC, _dispatch
from .kind import make_window

__all__ = ["windowed_alibi_attention"]


def windowed_alibi_attention(q: Tensor, k: Tensor, v: Tensor, slopes=None, *, window: Union[int, Tensor, None] = None,
                             sigma=None, causal: bool = False, scale: Optional[float] = None, backend: str = "auto",
                             q_start: Optional[int] = None, k_start: Optional[int] = None,
                             seq_len: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                             document_ids: Optional[Tensor] = None, return_lse: bool = False):
    """Exact ALiBi attention cut at a window per head: the strongest baseline of positional LSH.

    Computes ``softmax_j(scale * q_i . k_j - m_h |i - j|) v_j`` over the keys with
    ``|i - j| <= window_h`` (and ``j <= i`` when ``causal``): exact ALiBi inside the window, no
    weight outside. Cost per query ``O(window_h)`` keys; the dropped tail is bounded by
    :func:`poslsh.window.window_error_bound` and :func:`poslsh.window.smallest_window` gives the
    smallest window for a tolerance. The log-sum-exp is ``log sum_j e^{s_ij - m_h |i - j|}``. With an
    :class:`~poslsh.AlibiWindow` already built, :func:`poslsh.attend` takes it as it is.

    Args:
        q: ``[B, Hq, n, d]`` queries (float16, bfloat16, float32 or float64).
        k: ``[B, Hkv, nk, d]`` keys (``nk = n`` for self-attention); ``Hq`` a multiple of ``Hkv``
            (GQA: query head ``h`` uses key/value head ``h // (Hq // Hkv)``).
        v: ``[B, Hkv, nk, dv]`` values.
        slopes: ``[Hq]`` ALiBi slopes ``m_h`` (:func:`poslsh.alibi_slopes`), finite, ``>= 0``; or by keyword
            ``sigma=`` ``[Hq]``, the bandwidths ``sigma_h = 1 / m_h`` (exactly one of the two).
        window: keys with ``|i - j| <= window`` attend: an int for every head, or ``[Hq]`` (a sequence or
            an int tensor; whole floats too) (0: each query sees itself only; ``>= n``: exact ALiBi, as is
            ``inf`` or any window past int64). Positions are absolute with
            ``q_start`` / ``k_start`` and restart in every packed document.
        causal: attend only to keys at positions ``<= i``.
        scale: logit scale, default ``1 / sqrt(d)``.
        backend: ``"auto"``, ``"torch"`` (the window as one block per query on the tiles of
            positional LSH: ``O(n (w + 64) d)`` time, ``O(n)`` memory; every feature), ``"triton"``,
            ``"flex"`` or ``"reference"`` (dense ``n x n``); :func:`poslsh.available_backends` with
            ``op="window"`` lists them."""
    slopes = one_rate(slopes, sigma, want="slopes", where="windowed_alibi_attention")
    positional = make_window(slopes, window)
    return _dispatch(q, k, v, positional, causal=causal, scale=scale, backend=backend, q_start=q_start,
                     k_start=k_start, seq_len=seq_len, cu_seqlens=cu_seqlens, document_ids=document_ids,
                     return_lse=return_lse)


windowed_alibi_attention.__doc__ += POSITIONS_DOC
