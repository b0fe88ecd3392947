"""The window: exact ALiBi cut at a window per head, positional LSH's strongest rival and the
library's recommendation for approximating ALiBi at long context. Everything about it is here:

* :mod:`.kind`: the positional object :class:`AlibiWindow` (:mod:`poslsh.positional`),
  :func:`make_window`, the ``w_h = c sigma_h`` rule :func:`windows_in_sigmas`;
* :mod:`.theory`: how much the cut loses (:func:`window_error_bound`, attainable), the smallest window
  for a tolerance (:func:`smallest_window`), and :func:`logit_range` (the bound's ``R`` on an input);
* :mod:`.cost`: keys per query (:func:`window_keys_per_query`) and the window of positional LSH's cost
  (:func:`cost_matched_window`);
* :mod:`.op`: :func:`windowed_alibi_attention` (every backend: torch, Triton, flex, reference);
  its module, :class:`poslsh.AlibiAttention`, is in :mod:`poslsh.modules`.

The backends' window kernels live with the backends (``ops/torch/plan.window_row_bounds``, the
tiles' Toeplitz bias, ``ops/triton/_window.py``, ``ops/flex.py``); the dense oracle is
:func:`poslsh.alibi_attention` with ``window=``.
"""
from .cost import cost_matched_window, window_keys_per_query
from .kind import AlibiWindow, make_window, windows_in_sigmas
from .op import windowed_alibi_attention
from .theory import logit_range, smallest_window, window_error_bound, window_tail_ratio

__all__ = ["AlibiWindow", "make_window", "windows_in_sigmas", "windowed_alibi_attention", "window_error_bound",
           "smallest_window", "window_tail_ratio", "logit_range", "window_keys_per_query", "cost_matched_window"]
