"""The positional methods a language-model run trains: names, what they mean, table labels.

A method name is a plain name (it becomes a run directory) that :func:`parse_method` maps onto
the fields of :class:`poslsh.integrations.hf.PositionalConfig`; :func:`method_label` is its name
in a table. Imports nothing heavy.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

from poslsh_paper.experiments.command import ConfigError

__all__ = ["METHODS", "GPU_METHODS", "Positional", "parse_method", "method_label"]

METHODS = ("original", "alibi", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "fixed_blocks")
# The GPU tables add the grouped sampler beside the paper's i.i.d. rows, and the ALiBi
# windows that cost what positional LSH costs at s = 10 and 20 (the deterministic rival).
GPU_METHODS = ("original", "alibi", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "poslsh-g5", "poslsh-g10",
               "poslsh-g20", "fixed_blocks", "alibi-wcost10", "alibi-wcost20")


class Positional(NamedTuple):
    """A method's positional scheme: the ``scheme``, ``num_samples``, ``sampler``, ``group_size``,
    ``window_sigmas`` and ``window_cost_samples`` fields of
    :class:`poslsh.integrations.hf.PositionalConfig`."""

    scheme: str                       # original | alibi | poslsh | fixed_blocks | alibi-window
    num_samples: int = 1              # s, partitions per head (poslsh only)
    sampler: str = "iid"              # iid (poslsh-s<k>) | grouped (poslsh-g<k>)
    group_size: Optional[int] = None  # grouped: largest group size (poslsh-g<s>k<size>); None: 4
    window_sigmas: Optional[float] = None       # alibi-w<c>: w_h = ceil(c sigma_h)
    window_cost_samples: Optional[int] = None   # alibi-wcost<s>: positional LSH's keys per query at s
    window_tol: Optional[float] = None          # alibi-tol1e-<k>: the certified window at tolerance 10^-k (BLOOM runs)


# Numbers as written in a method name: canonical only (no leading zeros, no trailing decimal zeros),
# so one method has one name and one run directory (alibi-w4, never alibi-w4.0 or alibi-w04).
_INT = r"[1-9][0-9]*"
_METHOD = re.compile(rf"poslsh-(s|g)({_INT})(?:k({_INT}))?")
_TOL = re.compile(rf"alibi-tol1e-({_INT})")
_WINDOW = re.compile(rf"alibi-w(?:cost({_INT})|((?:0|{_INT})(?:\.[0-9]*[1-9])?))")
_HELP = ("use original, alibi, fixed_blocks, poslsh-s<k> (i.i.d. partitions, e.g. poslsh-s10), poslsh-g<k> (grouped, "
         "e.g. poslsh-g10), poslsh-g<k>k<size> (grouped, groups of at most <size>), alibi-w<c> (exact ALiBi cut at "
         "c sigma_h, e.g. alibi-w4 or alibi-w2.5) alibi-wcost<s> (exact ALiBi cut at the window that costs what "
         "positional LSH costs at s samples, e.g. alibi-wcost10) or, with model.kind bloom, alibi-tol1e-<k> (the "
         "certified window at tolerance 10^-k)")


def parse_method(method: str) -> Positional:
    """``"poslsh-s10"`` -> ``Positional("poslsh", 10)`` (i.i.d. partitions);
    ``"poslsh-g10"`` -> ``Positional("poslsh", 10, "grouped")`` (grouped sampling, groups
    of at most 4, the library's default); ``"poslsh-g20k5"`` -> groups of at most 5;
    ``"alibi-w2.5"`` -> the ``alibi-window`` scheme with ``window_sigmas = 2.5`` (head ``h`` keeps
    ``|i - j| <= ceil(2.5 sigma_h)``); ``"alibi-wcost10"`` -> ``window_cost_samples = 10`` (the
    window of :func:`poslsh.cost.cost_matched_window` at s = 10). Windows do not depend on the
    sequence length. Other methods have ``num_samples = 1``."""
    if method in ("original", "alibi", "fixed_blocks"):
        return Positional(method, 1)
    m = _METHOD.fullmatch(method)
    if m and not (m[1] == "s" and m[3]):
        return Positional("poslsh", int(m[2]), "iid" if m[1] == "s" else "grouped", None if m[3] is None else int(m[3]))
    t = _TOL.fullmatch(method) if isinstance(method, str) else None
    if t:
        return Positional("alibi-window", window_tol=10.0 ** -int(t[1]))
    w = _WINDOW.fullmatch(method) if isinstance(method, str) else None
    if w and w[1]:
        return Positional("alibi-window", window_cost_samples=int(w[1]))
    if w and float(w[2]) > 0:
        return Positional("alibi-window", window_sigmas=float(w[2]))
    if isinstance(method, str) and method.startswith("alibi-w"):
        raise ConfigError(f"method: {method!r} is not a window method: alibi-w<c> takes a number c > 0 written "
                          "without leading or trailing zeros (alibi-w4, alibi-w2.5), alibi-wcost<s> an integer s >= 1")
    raise ConfigError(f"method: unknown method {method!r}; {_HELP}")


METHOD_LABELS = {"original": "Original (RoPE)", "alibi": "ALiBi", "fixed_blocks": "Fixed blocks"}


def method_label(method: str) -> str:
    """The name a table prints: ``poslsh-s10`` -> ``Positional LSH, s=10``,
    ``poslsh-g10`` -> ``Positional LSH, grouped, s=10``, ``alibi-w4`` -> ``ALiBi window 4σ``,
    ``alibi-wcost10`` -> ``ALiBi window at the cost of s=10``."""
    m = _METHOD.fullmatch(method)
    if m and m[1] == "s":
        return f"Positional LSH, s={m[2]}"
    if m:
        return f"Positional LSH, grouped, s={m[2]}" + (f" (groups <= {m[3]})" if m[3] else "")
    t = _TOL.fullmatch(method)
    if t:
        return f"ALiBi certified window, tol 1e-{t[1]}"
    w = _WINDOW.fullmatch(method)
    if w:
        return f"ALiBi window at the cost of s={w[1]}" if w[1] else f"ALiBi window {w[2]}σ"
    return METHOD_LABELS.get(method, method)
