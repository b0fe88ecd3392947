"""The window: exact ALiBi cut at a window per head, positional LSH's strongest rival and the
library's recommendation for approximating ALiBi at long context. Its pieces sit on their floors
(``docs/architecture.md``), so this package's face is its lowest one, the positional object:

* :mod:`.kind` (here): :class:`AlibiWindow`, :func:`make_window` (``window=None``: no cut, exact ALiBi),
  the ``w_h = c sigma_h`` rule :func:`windows_in_sigmas`, :data:`NO_WINDOW`;
* :mod:`.theory` (also :mod:`poslsh.theory`): how much the cut loses (:func:`~.theory.window_error_bound`,
  attainable), the smallest window for a tolerance (:func:`~.theory.smallest_window`), and
  :func:`~.theory.logit_range` (the bound's ``R`` on an input);
* :mod:`.op`: :func:`poslsh.alibi_attention` (exact ALiBi, or cut at ``window=``) and its name with the
  window in front, :func:`poslsh.windowed_alibi_attention`, on every backend; the module,
  :class:`poslsh.AlibiAttention`, is in :mod:`poslsh.modules`.

Keys per query and the window of positional LSH's cost are in :mod:`poslsh.cost`. The backends' window
kernels live with the backends (``ops/torch/plan.window_row_bounds``, ``ops/torch/band.py``,
``ops/triton/_window.py``, ``ops/flex.py``); the dense oracle is
:func:`poslsh.reference.alibi_attention_reference`.
"""
from .kind import NO_WINDOW, AlibiWindow, make_window, windows_in_sigmas

__all__ = ["AlibiWindow", "make_window", "windows_in_sigmas", "NO_WINDOW"]
