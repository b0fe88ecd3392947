"""Old spellings kept for one release, and the two words for ALiBi's per-head rate.

Renamed names and keywords keep working for one release and say so once
(:class:`PoslshDeprecationWarning`, a ``FutureWarning``: shown by default). A parameter that moved
does not silently take its old place: the functions whose order changed refuse the old order in one line.
Every rename and its replacement: ``CHANGELOG.md`` (0.3.0).

The rate: the ops, biases and modules speak of ALiBi's ``slopes`` ``m_h`` (flash-attention's
``alibi_slopes``), the samplers, cost and theory of the bandwidth ``sigma_h = 1 / m_h`` (the paper's
math is in ``sigma``); each also takes the other word by keyword (:func:`one_rate`).
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from ._validation import check_has_values

__all__ = ["PoslshDeprecationWarning", "warn_once", "renamed_keywords", "positional_up_to", "moved_names",
           "one_rate", "takes_slopes_too", "reset_warnings"]


class PoslshDeprecationWarning(FutureWarning):
    """A renamed name or keyword of poslsh: it works for one more release (see ``CHANGELOG.md``)."""


_WARNED: set = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` the first time ``key`` is seen in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, PoslshDeprecationWarning, stacklevel=stacklevel)


def reset_warnings() -> None:
    """Forget which old spellings have warned (tests of the shims)."""
    _WARNED.clear()


def renamed_keywords(**renames: str) -> Callable:
    """Decorator: the keyword ``old`` of the function is now ``new`` (``@renamed_keywords(s="num_samples")``);
    ``old=`` still works with one warning, ``old`` and ``new`` together are refused."""
    def wrap(fn):
        where = fn.__qualname__

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{where}: pass {new}= only ({old}= is its old name)")
                    warn_once(f"{fn.__module__}.{where}:{old}", f"{where}({old}=...) is now {where}({new}=...); "
                              f"the old keyword goes in the next release")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return inner
    return wrap


def positional_up_to(count: int, order: str) -> Callable:
    """Decorator for a function whose parameter order changed: more than ``count`` positional
    arguments are refused in one line naming the new ``order`` (they would silently mean other things)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if len(args) > count:
                raise TypeError(f"{fn.__qualname__}: its arguments after the first {count} are keyword-only since "
                                f"poslsh 0.3.0 (the order changed to {order}): pass them by name")
            return fn(*args, **kwargs)
        return inner
    return wrap


def moved_names(module_globals: dict, moved: Dict[str, tuple]) -> None:
    """Give a module a ``__getattr__`` for names that moved: ``moved[name] = (get, new_path)``, with
    ``get()`` returning the object; the old name works with one warning naming ``new_path``. Calls add up."""
    table = module_globals.setdefault("_MOVED_NAMES", {})
    table.update(moved)
    module = module_globals["__name__"]

    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        get, new_path = table[name]
        warn_once(f"{module}.{name}", f"{module}.{name} moved to {new_path}; the old name goes in the next release")
        return get()
    module_globals["__getattr__"] = __getattr__


def _rate(x, name: str) -> Tensor:
    if isinstance(x, Tensor):
        return x.detach().to(torch.float64)
    if isinstance(x, bool) or not (isinstance(x, numbers.Real) or isinstance(x, (list, tuple))):
        raise TypeError(f"{name} must be a tensor, a number or a list of per-head numbers, got {type(x).__name__}")
    try:
        return torch.as_tensor(x, dtype=torch.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be numbers (one per head): {e}") from None


def one_rate(slopes, sigma, *, want: str, where: str, default: Optional[Callable[[], Tensor]] = None):
    """ALiBi's per-head rate given as exactly one of ``slopes`` (``m_h``) or ``sigma`` (``1 / m_h``),
    returned in the word ``want`` (``"slopes"`` or ``"sigma"``); the word the caller used comes back
    unchanged (its checks stay the callee's). Neither: ``default()`` when given, else a one-line error."""
    if slopes is not None and sigma is not None:
        raise TypeError(f"{where}: pass slopes= or sigma= (sigma_h = 1 / slope_h), not both")
    if slopes is None and sigma is None:
        if default is not None:
            return default()
        raise TypeError(f"{where}: pass the per-head rate, slopes= (ALiBi's m_h) or sigma= (1 / m_h)")
    given, word = (slopes, "slopes") if slopes is not None else (sigma, "sigma")
    check_has_values(given, word)
    if word == want:
        return given
    t = _rate(given, word)
    return 1.0 / t          # slope 0 <-> sigma inf: the callee's checks decide what it accepts


def _inverse(x, name: str):
    """``1 / x`` keeping the kind of value: a number stays a number (``1 / 0 = inf``), anything else a tensor."""
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return math.inf if x == 0 else 1.0 / float(x)
    return 1.0 / _rate(x, name)


def takes_slopes_too(fn):
    """Decorator for a function of the bandwidth ``sigma`` (samplers, cost, theory): it also takes
    ``slopes=`` by keyword (``sigma = 1 / slopes``), exactly one of the two."""
    params = inspect.signature(fn).parameters
    if "sigma" not in params:
        raise TypeError(f"{fn.__qualname__} has no sigma parameter")

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if "slopes" in kwargs:
            slopes = kwargs.pop("slopes")
            given = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
            if given.get("sigma") is not None:
                raise TypeError(f"{fn.__qualname__}: pass sigma= or slopes= (sigma_h = 1 / slope_h), not both")
            kwargs["sigma"] = _inverse(check_has_values(slopes, "slopes"), "slopes")
        return fn(*args, **kwargs)
    inner.rate_words = ("sigma", "slopes")        # what the vocabulary test reads
    return inner
