"""The former home of the window's bounds, kept for one release: :mod:`poslsh.window.theory` now."""
from ._compat import moved_names

_NAMES = ("window_tail_ratio", "window_error_bound", "logit_range", "alibi_window")


def _get(name):
    from .window import theory
    return getattr(theory, name)


moved_names(globals(), {name: ((lambda name=name: _get(name)), f"poslsh.window.theory.{name}") for name in _NAMES})
