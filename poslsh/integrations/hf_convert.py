"""Turning a transformers model (or config) into a positional-LSH / ALiBi one.

:class:`PositionalConfig` is the scheme of a model, saved with its config as
``config.poslsh``; :func:`convert` writes it, removes RoPE from a model (the rotary
embedding is replaced by :class:`NoRotaryEmbedding`, ``cos = 1, sin = 0``, so
``apply_rotary_pos_emb`` is the identity) and selects the attention
implementation by name. The implementations themselves live in
:mod:`poslsh.integrations.hf`, whose ``apply_positional_scheme`` registers them and
calls :func:`convert`.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..partitions import check_sampler

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "CONFIG_KEY", "PositionalConfig", "positional_config",
           "attention_modules", "NoRotaryEmbedding", "convert"]

SCHEMES = ("original", "alibi", "poslsh", "fixed_blocks")
IMPLEMENTATIONS = ("alibi", "poslsh", "fixed_blocks")
CONFIG_KEY = "poslsh"


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
    backend: str = "auto"        # poslsh_attention backend
    rope_removed: bool = False   # set by apply_positional_scheme on a model

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown positional scheme {self.scheme!r}; choose from {SCHEMES}")
        for name in ("num_samples", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_sampler(self.sampler, self.group_size, name="sampler")

    @property
    def implementation(self) -> str:
        """The ``attn_implementation`` name of this scheme (``sdpa`` for the original)."""
        return "sdpa" if self.scheme == "original" else self.scheme


def positional_config(config) -> PositionalConfig:
    """The :class:`PositionalConfig` of a transformers config (defaults if unset)."""
    raw = getattr(config, CONFIG_KEY, None)
    if isinstance(raw, PositionalConfig):
        return raw
    if raw:
        return PositionalConfig(**raw)
    impl = getattr(config, "_attn_implementation", None)
    return PositionalConfig(scheme=impl if impl in IMPLEMENTATIONS else "original")


def attention_modules(model: nn.Module):
    """The attention layers of a decoder (modules with ``layer_idx`` and ``config``)."""
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "config") and type(m).__name__.endswith("Attention")]


class NoRotaryEmbedding(nn.Module):
    """Stands in for a model's rotary embedding: ``cos = 1``, ``sin = 0``, so
    ``apply_rotary_pos_emb`` returns q and k unchanged (RoPE removed)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = int(dim)

    def forward(self, x: Tensor, position_ids: Tensor, layer_type=None):
        shape = (*position_ids.shape, self.dim)
        return (torch.ones(shape, dtype=x.dtype, device=x.device),
                torch.zeros(shape, dtype=x.dtype, device=x.device))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


# Modules of learned or fixed absolute positions (GPT-2's wpe, OPT's embed_positions, BERT's
# position_embeddings): the scheme cannot remove them, so conversion refuses such models.
_ABSOLUTE_POSITIONS = ("wpe", "embed_positions", "position_embeddings", "pos_emb", "position_embedding")


def _remove_rope(model: nn.Module) -> int:
    """Replace every rotary embedding by :class:`NoRotaryEmbedding`; refuse models whose
    positional signal is something else (it would stay, and the scheme would be added on top)."""
    absolute = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in _ABSOLUTE_POSITIONS]
    if absolute:
        raise ValueError(f"{type(model).__name__} has absolute position embeddings ({', '.join(absolute)}) that "
                         "apply_positional_scheme cannot remove; it converts RoPE models (Llama, Qwen, Mistral "
                         "families) only")
    already = any(isinstance(m, NoRotaryEmbedding) for m in model.modules())
    replaced = 0
    for name, m in list(model.named_modules()):
        if type(m).__name__.endswith("RotaryEmbedding") and not isinstance(m, NoRotaryEmbedding):
            inv = getattr(m, "inv_freq", None)
            if inv is None:
                raise ValueError(f"cannot find the rotary dimension of {name} ({type(m).__name__})")
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], NoRotaryEmbedding(2 * inv.numel()).to(inv.device))
            replaced += 1
    if not replaced and not already:
        raise ValueError(f"found no rotary embedding in {type(model).__name__} to remove: apply_positional_scheme "
                         "converts RoPE models (Llama, Qwen, Mistral families) only")
    return replaced


def _configure(config, pc: PositionalConfig) -> None:
    setattr(config, CONFIG_KEY, asdict(pc))
    if pc.scheme != "original":
        # The positional scheme replaces sliding windows (Mistral); sliding layers are unsupported.
        if getattr(config, "sliding_window", None) is not None:
            config.sliding_window = None
        if hasattr(config, "use_sliding_window"):
            config.use_sliding_window = False
        types = getattr(config, "layer_types", None)
        if types and any(t != "full_attention" for t in types):
            raise ValueError(f"layer types {sorted(set(types))} are not supported; only full_attention")
        if getattr(config, "attention_dropout", 0.0):
            config.attention_dropout = 0.0


def convert(model_or_config, scheme: Optional[str] = None, **params):
    """Give a model (in place) or a config (a copy) the positional scheme ``scheme``
    (default: the saved ``config.poslsh``); ``params`` are :class:`PositionalConfig`
    fields. The attention implementations must be registered (``hf.register()``)."""
    from transformers import PretrainedConfig

    is_config = isinstance(model_or_config, PretrainedConfig)
    config = copy.deepcopy(model_or_config) if is_config else model_or_config.config
    current = positional_config(config)
    base = asdict(current)
    if scheme is not None:
        base["scheme"] = scheme
    base.update(params)
    base["rope_removed"] = False
    pc = PositionalConfig(**base)
    if is_config:
        _configure(config, pc)
        config._attn_implementation = pc.implementation
        return config
    model = model_or_config
    if pc.scheme == "original" and current.rope_removed:
        raise ValueError("this model's RoPE was removed; reload it to get the original scheme back")
    _configure(config, pc)
    if pc.scheme != "original":
        for m in attention_modules(model):   # modules copied the dropout rate at init
            if getattr(m, "attention_dropout", 0.0):
                m.attention_dropout = 0.0
        _remove_rope(model)
        setattr(config, CONFIG_KEY, asdict(PositionalConfig(**{**asdict(pc), "rope_removed": True})))
    model.set_attn_implementation(pc.implementation)
    return model
