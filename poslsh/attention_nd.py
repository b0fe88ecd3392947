"""The former home of the grid op, kept for one release: it is :mod:`poslsh.attention` now."""
from ._compat import moved_names

moved_names(globals(), {"poslsh_attention_2d": (lambda: _attention().poslsh_attention_2d,
                                                "poslsh.attention.poslsh_attention_2d (now poslsh.poslsh_attention_nd)")})


def _attention():
    from . import attention
    return attention
