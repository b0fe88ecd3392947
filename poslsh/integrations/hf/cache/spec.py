"""What a :class:`~poslsh.integrations.hf.cache.PoslshCache` is keyed on: the schemes it serves, the
:class:`CacheSpec` of a model's positional weights, and the check that the attention calling a cache layer is
the one it was built for (one ``ValueError`` line each)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ....decoding import PER_HEAD_STORES
from ..config import POSITIONAL_FIELDS, SCHEME_RULES, positional_config

__all__ = ["CACHE_KWARG", "WINDOW_SCHEMES", "CACHE_SCHEMES", "FULL_SCHEMES", "NEW_CACHE", "CacheSpec", "check_layer"]

CACHE_KWARG = "poslsh_cache_layer"
# The schemes a cache serves: those whose positional object drops keys (exact ALiBi keeps every one) ...
CACHE_SCHEMES = tuple(name for name, rules in SCHEME_RULES.items() if rules.near_linear)
# ... and of them, those whose kind keeps a store per KV head (asked of the kind, as decoding asks it)
WINDOW_SCHEMES = tuple(name for name in CACHE_SCHEMES if SCHEME_RULES[name].kind.op in PER_HEAD_STORES)
# ... and the schemes that need every key (exact ALiBi): generate() appends them in place (AppendCache)
FULL_SCHEMES = tuple(name for name, rules in SCHEME_RULES.items() if not rules.near_linear)
NEW_CACHE = "build a new one with poslsh.integrations.hf.generation_cache(model)"


@dataclass(frozen=True)
class CacheSpec:
    """What the positional weights of a model's attention depend on: its scheme, its query heads and the
    ``PositionalConfig`` fields the scheme's positional object reads (``params``, its
    :attr:`~poslsh.integrations.hf.config.SchemeRules.depends_on`; a scheme without rules: every positional
    field). A change of any makes the cache stale."""

    scheme: str
    num_heads: int
    params: tuple = ()                    # ((field, value), ...)

    @classmethod
    def of(cls, config, scheme: Optional[str] = None) -> "CacheSpec":
        pc = positional_config(config)
        scheme = scheme or config._attn_implementation
        rules = SCHEME_RULES.get(scheme)
        depends_on = POSITIONAL_FIELDS if rules is None else rules.depends_on
        return cls(scheme, int(config.num_attention_heads),
                   tuple((name, _frozen(getattr(pc, name))) for name in depends_on))

    def __str__(self) -> str:
        return f"{self.scheme} (num_heads={self.num_heads}{''.join(f', {k}={v}' for k, v in self.params)})"


def _frozen(value):
    """A config value as something comparable and hashable (lists and dicts become tuples)."""
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items()))
    return tuple(_frozen(x) for x in value) if isinstance(value, (list, tuple)) else value


def check_layer(layer, module, scheme: str) -> None:
    """Raise if the attention calling cache layer ``layer`` is not the one it was built for."""
    now = CacheSpec.of(module.config, scheme)
    if now != layer.spec:
        raise ValueError(f"cache: this PoslshCache was built for {layer.spec} but the model runs {now}: {NEW_CACHE}")
    if layer._owner() is not module.config:
        raise ValueError(f"cache: this PoslshCache was built for another model instance: {NEW_CACHE}")
    if getattr(module, "layer_idx", layer.index) != layer.index:
        raise ValueError(f"cache: layer {layer.index} was updated by attention layer {module.layer_idx}")
    if module.training:
        raise ValueError("model is in training mode, which draws new partitions every forward; decoding with a "
                         "cache needs the fixed evaluation partitions: call model.eval()")
