"""The window: exact ALiBi cut at a window per head, positional LSH's strongest rival and the
library's recommendation for approximating ALiBi at long context. Everything about it is here:

* :mod:`.kind`: the positional object :class:`AlibiWindow` and :func:`make_window`;
* :mod:`.op`: :func:`windowed_alibi_attention` (every backend: torch, Triton, flex, reference).
"""
from .kind import AlibiWindow, make_window, windows_in_sigmas
from .op import windowed_alibi_attention

__all__ = ["AlibiWindow", "make_window", "windows_in_sigmas", "windowed_alibi_attention"]
