"""What a :class:`~poslsh.integrations.hf.cache.PoslshCache` is keyed on: the schemes it serves, the
:class:`CacheSpec` of a model's positional weights, and the check that the attention calling a cache layer is
the one it was built for (one ``ValueError`` line each)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..config import positional_config

__all__ = ["CACHE_KWARG", "BLOCK_SCHEMES", "WINDOW_SCHEMES", "CACHE_SCHEMES", "NEW_CACHE", "CacheSpec", "check_layer"]

CACHE_KWARG = "poslsh_cache_layer"
BLOCK_SCHEMES = ("poslsh", "fixed_blocks")          # the attention passes Partitions
WINDOW_SCHEMES = ("alibi-window",)                  # the attention passes an AlibiWindow
CACHE_SCHEMES = BLOCK_SCHEMES + WINDOW_SCHEMES
NEW_CACHE = "build a new one with poslsh.integrations.hf.generation_cache(model)"
# PositionalConfig fields that cannot change what a window scheme attends to
_NOT_POSITIONAL = ("scheme", "backend", "rope_removed")


@dataclass(frozen=True)
class CacheSpec:
    """What the positional weights of a model's attention depend on (fields a scheme ignores
    are None). A window scheme keys on every field of the model's ``PositionalConfig`` but the
    backend (``params``): whichever of them carry its windows, a change makes the cache stale."""

    scheme: str
    num_heads: int
    num_samples: Optional[int] = None     # poslsh
    eval_seed: Optional[int] = None       # poslsh
    block_size: Optional[int] = None      # fixed_blocks
    params: Optional[tuple] = None        # window schemes: ((field, value), ...)

    @classmethod
    def of(cls, config, scheme: Optional[str] = None) -> "CacheSpec":
        pc = positional_config(config)
        scheme = scheme or config._attn_implementation
        H = int(config.num_attention_heads)
        if scheme == "poslsh":
            return cls(scheme, H, num_samples=pc.num_samples, eval_seed=pc.eval_seed)
        if scheme in WINDOW_SCHEMES:
            return cls(scheme, H, params=tuple((k, _frozen(v)) for k, v in sorted(asdict(pc).items())
                                               if k not in _NOT_POSITIONAL))
        return cls(scheme, H, block_size=pc.block_size)

    def __str__(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if v is not None and k not in ("scheme", "params"))
        extra += "".join(f", {k}={v}" for k, v in self.params or ())
        return f"{self.scheme} ({extra})"


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
