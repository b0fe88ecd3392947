"""One patched ALiBi attention layer's state: its slopes, its positional object (exact, fixed windows,
certified windows or positional LSH), Falcon's bfloat16 bias term, what it last used.

The certified window (``window="certified"``, ``tol``): every call measures a bound on each head's
logit spread on its own queries and keys, ``R_h = 2 scale max_i ||q_i|| max_j ||k_j - kbar||``
(Cauchy-Schwarz: ``|q_i . (k_j - k_l)| <= ||q_i|| ||k_j - k_l|| <= 2 ||q_i|| max_j ||k_j - kbar||``, with
``kbar`` the keys' mean), and takes ``smallest_window(tol, sigma_h, R_h, n=nk)``: the dropped softmax
mass of every query is then ``<= tol`` (:mod:`poslsh.window.theory`), a guarantee for that call, not an
estimate. ``O(B H n d)`` per call, no ``n x n``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Optional

import torch
from torch import Tensor

from ....decoding import PER_HEAD_STORES
from ....partitions import Partitions, sample_partitions
from ....positional import Positional
from ....seeding import stable_seed
from ....window.kind import NO_WINDOW, AlibiWindow, make_window
from ....window.theory import logit_range_bound, smallest_window
from .attend import attend_rows, update_kv
from .call import call_of
from .cache import attend_cached, windowed_cache_of

__all__ = ["LayerAlibi", "STATS_MODES", "keeps_every_key", "layer_attention"]


# alibi_stats()'s "mode" field is a word for people reading the report (documented in docs/alibi_models.md), so
# a string; it is derived here, and only here, from the layer's positional object: None (windows chosen per call),
# an object that cuts no key (exact ALiBi), else its kind's op. Nothing decides anything on these words.
STATS_MODES = {Partitions.op: "positional_lsh", AlibiWindow.op: "window"}
CERTIFIED, EXACT = "certified", "exact"


def keeps_every_key(positional: Positional) -> bool:
    """Exact ALiBi: no head of ``positional`` cuts a key (asked of the object: every head's cache bound is
    :data:`~poslsh.window.kind.NO_WINDOW`)."""
    return all(bound >= NO_WINDOW for bound in positional.cache_bound(per_head=True))


@dataclass
class LayerAlibi:
    """A patched layer: ``slopes`` float64 ``[H]`` in logit units (what multiplies ``|i - j|`` after the
    logit scale), ``scale`` (the logit scale of ``q . k``), the fixed ``positional`` object (exact ALiBi, fixed
    windows or positional LSH; None for certified windows, chosen per call with ``tol``), ``backend``,
    ``key_bias`` (Falcon's bfloat16 rounding term, or None), ``last`` (the windows and logit ranges of the last
    certified call). What it is (:attr:`mode`, :attr:`exact`, :attr:`fixed_windows`) is asked of the object."""

    family: str
    layer: int
    slopes: Tensor
    scale: float
    positional: Optional[Positional]
    tol: Optional[float]
    backend: str
    key_bias: Optional[Callable[[Tensor], Tensor]] = None
    num_samples: Optional[int] = None
    kv_heads: int = 0
    positions: str = "cumsum"                     # how the family counts a row's positions (Family.positions)
    owner: Optional[Callable] = None              # weakref to the patched model's config
    last: dict = field(default_factory=dict)

    @classmethod
    def build(cls, family: str, layer: int, slopes: Tensor, scale: float, *, window, tol, num_samples, seed,
              backend, key_bias=None, kv_heads: int = 0, positions: str = "cumsum") -> "LayerAlibi":
        slopes = slopes.detach().to("cpu", torch.float64)
        common = dict(backend=backend, key_bias=key_bias, kv_heads=int(kv_heads) or int(slopes.numel()),
                      positions=positions)
        if num_samples is not None:
            parts = sample_partitions(1.0 / slopes, num_samples, seed=stable_seed("patch_alibi", seed, layer))
            return cls(family, layer, slopes, scale, parts, None, num_samples=num_samples, **common)
        if isinstance(window, str):                 # "certified": the windows of each call's bound
            return cls(family, layer, slopes, scale, None, float(tol), **common)
        window = NO_WINDOW if window is None else window
        return cls(family, layer, slopes, scale, make_window(slopes, window), None, **common)

    @cached_property
    def exact(self) -> bool:
        """Exact ALiBi: a fixed object that cuts no key."""
        return self.positional is not None and keeps_every_key(self.positional)

    @property
    def fixed_windows(self) -> bool:
        """A per-head window cache can decode this layer: its object is fixed (not chosen per call), its kind keeps
        a store per KV head (:data:`poslsh.decoding.PER_HEAD_STORES`) and it drops keys (exact ALiBi needs all)."""
        return self.positional is not None and self.positional.op in PER_HEAD_STORES and not self.exact

    @property
    def certified(self) -> bool:
        """Windows chosen from the inputs (``window="certified"``): per call without a cache, from the prefill on
        a per-head window cache (:meth:`decoding_window`)."""
        return self.positional is None and self.tol is not None

    @property
    def per_head_cache(self) -> bool:
        """``generate()`` decodes this layer on a per-head window cache: fixed or certified windows of exact ALiBi
        (Falcon's bfloat16 bias adds a per-key rounding a window store does not apply)."""
        return (self.fixed_windows or self.certified) and self.key_bias is None

    @property
    def mode(self) -> str:
        """``alibi_stats()``'s word for this layer: ``"exact"``, ``"window"``, ``"certified"`` or
        ``"positional_lsh"`` (see :data:`STATS_MODES`)."""
        if self.positional is None:
            return CERTIFIED
        return EXACT if self.exact else STATS_MODES[self.positional.op]

    def positional_for(self, query: Tensor, key: Tensor) -> Positional:
        """The positional object of this call (certified: the windows this call's bound needs)."""
        if self.positional is not None:
            if self.positional.device != query.device:
                self.positional = self.positional.to(query.device)
            return self.positional
        R = logit_range_bound(query, key, self.scale)
        w = smallest_window(self.tol, 1.0 / self.slopes, R.cpu(), causal=True, n=max(int(key.shape[2]), 1))
        self.last = {"window": w.tolist(), "logit_range": R.tolist(), "keys": int(key.shape[2])}
        return make_window(self.slopes.to(query.device), w.to(query.device))

    def decoding_window(self, query: Tensor, key: Tensor) -> Positional:
        """The certified windows a per-head window cache keeps for the rest of a sequence, chosen from its prefill
        (``query [B, Hq, n, d]``, ``key [B, Hkv, n, d]``): ``smallest_window(tol, sigma_h, R_h)`` at every length
        (``n=None``), ``R_h`` the prefill's :func:`~poslsh.theory.logit_range_bound`. Rigorous for the prefill's
        queries; for later ones an estimate the cache's certificate checks at every step."""
        R = logit_range_bound(query, key, self.scale)
        w = smallest_window(self.tol, 1.0 / self.slopes, R.cpu(), causal=True, n=None)
        self.last = {"window": w.tolist(), "logit_range": R.tolist(), "keys": int(key.shape[2]), "decoding": True}
        return make_window(self.slopes.to(query.device), w.to(query.device))

    def stats(self) -> dict:
        out = {"layer": self.layer, "family": self.family, "mode": self.mode, "heads": int(self.slopes.numel()),
               "slopes": self.slopes.tolist(), "falcon_bias": "bfloat16" if self.key_bias is not None else None}
        if self.positional is None:                 # certified: the windows of the last call
            out.update(tol=self.tol, window=self.last.get("window"), logit_range=self.last.get("logit_range"),
                       keys=self.last.get("keys"), decoding=self.last.get("decoding", False))
        elif self.num_samples is not None:          # positional LSH
            out["num_samples"] = self.num_samples
        else:
            out["window"] = None if self.exact else self.positional.window.tolist()
        return out


def layer_attention(module, query: Tensor, key: Tensor, value: Tensor, mask, cache, dropout: float) -> Tensor:
    """A patched layer's attention: the key/value step, then every row at its own positions with the
    layer's positional object (:func:`~.attend.attend_rows`). ``mask`` is
    whatever the model passed its layer: only a key to the call (:func:`~.call.call_of`), never
    read. ``[B, Hq, nq, dv]``."""
    st: LayerAlibi = module._poslsh_alibi
    call = call_of(mask)
    windowed = windowed_cache_of(cache)
    if windowed is not None:            # a per-head window cache stores the keys and attends itself
        if module.training:
            raise ValueError("cache: a per-head window cache decodes a model in eval mode; call model.eval()")
        return attend_cached(windowed, st, module.layer_idx, query, key, value, call)
    key, value, k_first = update_kv(cache, key, value, module.layer_idx)
    positional = st.positional_for(query, key)
    p = float(dropout) if module.training else 0.0
    return attend_rows(query, key, value, call, positional, scale=st.scale, backend=st.backend, k_first=k_first,
                       dropout=p, key_bias=st.key_bias, rule=st.positions)
