"""The window's bounds, part of the theory: defined in the window's room (:mod:`poslsh.window.theory`,
with the statement and proof); this module names them here."""
from ..window.theory import logit_range, logit_range_bound, smallest_window, window_error_bound, window_tail_ratio

__all__ = ["window_tail_ratio", "window_error_bound", "smallest_window", "logit_range", "logit_range_bound"]
