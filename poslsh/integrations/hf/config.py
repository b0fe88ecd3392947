"""The positional scheme of a converted model, saved with its config as ``config.poslsh``
(:class:`PositionalConfig`), and what each scheme is (:data:`SCHEME_RULES`).

Shared by the schemes (:mod:`.schemes` converts models and attends with it) and the cache (:mod:`.cache`
keys a :class:`~poslsh.integrations.hf.cache.PoslshCache` on it), so it sits below both.

A scheme's name is its ``attn_implementation`` (``"poslsh"``, ``"fixed_blocks"``, ``"alibi"``,
``"alibi-window"``): a user-facing word, saved in ``config.json``, so it stays a string. Everything else about a
scheme is its entry in :data:`SCHEME_RULES`, and whatever depends on its positional kind (e.g. whether a cache
keeps a store per head) is asked of the kind, as the core asks ``positional.op``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import NamedTuple, Optional, Tuple, Union

from ...alibi import alibi_sigmas, alibi_slopes
from ...partitions import Partitions, check_sampler
from ...cost import cost_matched_window
from ...window.kind import AlibiWindow, make_window, windows_in_sigmas

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "CONFIG_KEY", "WINDOW_FIELDS", "POSITIONAL_FIELDS", "SchemeRules",
           "SCHEME_RULES", "PositionalConfig", "positional_config"]

CONFIG_KEY = "poslsh"
WINDOW_FIELDS = ("window_sigmas", "window_cost_samples")


@dataclass(frozen=True)
class PositionalConfig:
    """Positional scheme of a model, stored as ``config.poslsh``."""

    scheme: str = "poslsh"       # one of SCHEMES
    num_samples: int = 10        # s, partitions per head (poslsh)
    sampler: str = "iid"         # how the s partitions are drawn: iid | stratified | grouped (poslsh.sampling)
    group_size: Union[int, str, None] = None  # grouped: largest group size k (None: 4; "sqrt": G ~ sqrt(s))
    block_size: int = 512        # fixed_blocks block size
    seed: int = 0                # training partitions: seeded by (seed, step, layer)
    eval_seed: int = 0           # eval partitions: seeded by (eval_seed, layer)
    backend: str = "auto"        # backend of poslsh_attention / windowed_alibi_attention
    rope_removed: bool = False   # set by apply_positional_scheme on a model
    # alibi-window, exactly one of: w_h = ceil(window_sigmas * sigma_h), or the window whose keys per
    # query equal positional LSH's at window_cost_samples i.i.d. samples (poslsh.window.cost_matched_window)
    window_sigmas: Optional[float] = None
    window_cost_samples: Optional[int] = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown positional scheme {self.scheme!r}; choose from {SCHEMES}")
        for name in ("num_samples", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_sampler(self.sampler, self.group_size, name="sampler")
        c, s = self.window_sigmas, self.window_cost_samples
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 0):
            raise ValueError(f"window_sigmas must be a finite number > 0 (the window in units of sigma_h), got {c!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"window_cost_samples must be an int >= 1 (the s to match), got {s!r}")
        if self.scheme == "alibi-window" and (c is None) == (s is None):
            raise ValueError("alibi-window needs exactly one of window_sigmas (w_h = window_sigmas * sigma_h) or "
                             f"window_cost_samples (positional LSH's keys per query at s samples), got {c!r} and {s!r}")
        if self.scheme != "alibi-window" and (c is not None or s is not None):
            raise ValueError(f"window_sigmas / window_cost_samples are for the alibi-window scheme, not "
                             f"{self.scheme!r}")

    @property
    def implementation(self) -> str:
        """The ``attn_implementation`` name of this scheme (``sdpa`` for the original)."""
        return "sdpa" if self.scheme == "original" else self.scheme

    def alibi_window(self, num_heads: int) -> AlibiWindow:
        """The per-head window of the alibi-window scheme for ``num_heads`` query heads."""
        if self.scheme != "alibi-window":
            raise ValueError(f"scheme {self.scheme!r} has no ALiBi window")
        sigma = alibi_sigmas(num_heads)
        if self.window_sigmas is not None:
            window = windows_in_sigmas(self.window_sigmas, sigma)
        else:
            window = cost_matched_window(sigma, self.window_cost_samples)
        return make_window(alibi_slopes(num_heads), window)


# The fields that decide a scheme's positional object (all but the scheme's name, the backend and a flag).
POSITIONAL_FIELDS = tuple(sorted(f.name for f in fields(PositionalConfig)
                                 if f.name not in ("scheme", "backend", "rope_removed")))


class SchemeRules(NamedTuple):
    """What differs between the schemes; everything else is one attention function and one cache."""

    kind: type            # the positional kind its layers attend with (asked: its op, its per-head store)
    near_linear: bool     # the near-linear ops and a bounded cache (else exact ALiBi: dense like stock sdpa)
    resampled: bool       # training draws new partitions every forward (decoding needs model.eval())
    depends_on: Tuple[str, ...]    # PositionalConfig fields its positional object depends on (a cache keys on them)


SCHEME_RULES = {
    "alibi": SchemeRules(AlibiWindow, near_linear=False, resampled=False, depends_on=()),
    "poslsh": SchemeRules(Partitions, near_linear=True, resampled=True,
                          depends_on=("num_samples", "eval_seed", "sampler", "group_size")),
    "fixed_blocks": SchemeRules(Partitions, near_linear=True, resampled=True, depends_on=("block_size",)),
    # whichever fields carry its windows: every positional field (a change makes a cache stale)
    "alibi-window": SchemeRules(AlibiWindow, near_linear=True, resampled=False, depends_on=POSITIONAL_FIELDS),
}
IMPLEMENTATIONS = tuple(SCHEME_RULES)                # the attn_implementation names registered
SCHEMES = ("original",) + IMPLEMENTATIONS            # "original": RoPE and sdpa, as the model came


def positional_config(config) -> PositionalConfig:
    """The :class:`PositionalConfig` of a transformers config (defaults if unset)."""
    raw = getattr(config, CONFIG_KEY, None)
    if isinstance(raw, PositionalConfig):
        return raw
    if raw:
        return PositionalConfig(**raw)
    impl = getattr(config, "_attn_implementation", None)
    if impl == "alibi-window":
        raise ValueError("attn_implementation='alibi-window' needs its window: convert the model or config with "
                         "poslsh.integrations.hf.apply_positional_scheme(..., 'alibi-window', window_sigmas=...) "
                         "or window_cost_samples=...")
    return PositionalConfig(scheme=impl if impl in IMPLEMENTATIONS else "original")
