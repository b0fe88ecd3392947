"""Turning a transformers model (or config) into a positional-LSH / ALiBi one.

:class:`PositionalConfig` is the scheme of a model, saved with its config as
``config.poslsh``; :func:`convert` writes it, removes RoPE from a model (the rotary
embedding is replaced by :class:`NoRotaryEmbedding`, ``cos = 1, sin = 0``, so
``apply_rotary_pos_emb`` is the identity) and selects the attention
implementation by name. The implementations themselves live in
:mod:`poslsh.integrations.hf`, which registers them.

The saved config carries the scheme for plain ``AutoModelForCausalLM.from_pretrained``:

* ``rope_parameters["rope_type"] = "poslsh_no_rotation"`` (:data:`NO_ROTATION`), a rope type
  registered in transformers' ``ROPE_INIT_FUNCTIONS`` when poslsh's integration is imported: all
  frequencies 0, so the model's own rotary embedding gives ``cos = 1, sin = 0`` (the replaced
  type is kept as ``replaced_rope_type``);
* ``attn_implementation`` (a top-level key of ``config.json``, which transformers reads when
  loading), so ``from_pretrained`` selects ``"poslsh"`` / ``"alibi"`` / ... without being told.

With poslsh imported a plain load is the saved model; without it, transformers refuses the
unknown attention implementation (``ValueError: Specified attn_implementation="poslsh" is not
supported``). Building such a model with another implementation raises (never a silent model
without its positional signal).
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Optional, Union

import torch
from torch import Tensor, nn

from ..alibi import alibi_sigmas, alibi_slopes
from ..window.kind import AlibiWindow, make_window, windows_in_sigmas
from ..cost import cost_matched_window
from ..partitions import check_sampler

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "CONFIG_KEY", "NO_ROTATION", "PositionalConfig", "positional_config",
           "attention_modules", "NoRotaryEmbedding", "register_rope_type", "convert"]

SCHEMES = ("original", "alibi", "poslsh", "fixed_blocks", "alibi-window")
IMPLEMENTATIONS = ("alibi", "poslsh", "fixed_blocks", "alibi-window")
CONFIG_KEY = "poslsh"
NO_ROTATION = "poslsh_no_rotation"      # the rope type of a model whose RoPE was removed
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
    # query equal positional LSH's at window_cost_samples i.i.d. samples (poslsh.cost.cost_matched_window)
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
            raise ValueError(f"window_sigmas / window_cost_samples are for the alibi-window scheme, not {self.scheme!r}")

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


# ------------------------------------------------------------ the "no rotation" rope type
def _no_rotation_parameters(config, device=None, seq_len=None, layer_type=None, **kwargs):
    """``ROPE_INIT_FUNCTIONS[NO_ROTATION]``: every inverse frequency 0 (``cos = 1, sin = 0``).

    It runs when a model is built from a config with this rope type, after transformers has
    resolved the attention implementation: a model built with another implementation than its
    scheme's would silently lose its positional signal, so that raises instead."""
    pc = positional_config(config)
    impl = getattr(config, "_attn_implementation", None)
    if pc.scheme == "original" or impl != pc.implementation:
        raise ValueError(f"attn_implementation: this model's positional scheme is {pc.scheme!r} (config.poslsh, RoPE "
                         f"removed) but it is being built with attn_implementation={impl!r}; load it with "
                         f"attn_implementation={pc.implementation!r} (the saved config names it) or "
                         "poslsh.integrations.hf.from_pretrained")
    config.attn_implementation = impl    # kept in config.json by the next save_pretrained (see the module docstring)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return torch.zeros(len(range(0, dim, 2)), dtype=torch.float, device=device), 1.0


def _validate_no_rotation(self, rope_parameters, ignore_keys=None) -> None:
    """The config-side check transformers looks up for a rope type: nothing to validate."""


def register_rope_type() -> None:
    """Register :data:`NO_ROTATION` with transformers (idempotent)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RotaryEmbeddingConfigMixin

    ROPE_INIT_FUNCTIONS[NO_ROTATION] = _no_rotation_parameters
    # transformers warns on every config of a rope type without a `_validate_<type>_rope_parameters`
    setattr(RotaryEmbeddingConfigMixin, f"_validate_{NO_ROTATION}_rope_parameters", _validate_no_rotation)


def _rope_dicts(config) -> list:
    """The rope parameter dicts of a config (one, or one per layer type), [] if it has none."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = [v for v in params.values() if isinstance(v, dict)]
    return nested if nested and "rope_type" not in params else [params]


def _set_rotation(config, removed: bool) -> None:
    """Mark the config's rope type as :data:`NO_ROTATION` (``removed``) or restore the replaced one."""
    for params in _rope_dicts(config):
        if removed and params.get("rope_type") != NO_ROTATION:
            params["replaced_rope_type"] = params.get("rope_type", "default")
            params["rope_type"] = NO_ROTATION
        elif not removed and params.get("rope_type") == NO_ROTATION:
            params["rope_type"] = params.pop("replaced_rope_type", "default")


# Modules of learned or fixed absolute positions (GPT-2's wpe, OPT's embed_positions, BERT's
# position_embeddings): the scheme cannot remove them, so conversion refuses such models.
_ABSOLUTE_POSITIONS = ("wpe", "embed_positions", "position_embeddings", "pos_emb", "position_embedding")


def _rotary_modules(model: nn.Module) -> list:
    """``(name, module)`` of every rotary embedding still to replace; refuse models whose
    positional signal is something else (it would stay, and the scheme would be added on top)."""
    absolute = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in _ABSOLUTE_POSITIONS]
    if absolute:
        raise ValueError(f"{type(model).__name__} has absolute position embeddings ({', '.join(absolute)}) that "
                         "apply_positional_scheme cannot remove; it converts RoPE models (Llama, Qwen, Mistral "
                         "families) only")
    found = [(name, m) for name, m in model.named_modules()
             if type(m).__name__.endswith("RotaryEmbedding") and not isinstance(m, NoRotaryEmbedding)]
    for name, m in found:
        if getattr(m, "inv_freq", None) is None:
            raise ValueError(f"cannot find the rotary dimension of {name} ({type(m).__name__})")
    if not found and not any(isinstance(m, NoRotaryEmbedding) for m in model.modules()):
        raise ValueError(f"found no rotary embedding in {type(model).__name__} to remove: apply_positional_scheme "
                         "converts RoPE models (Llama, Qwen, Mistral families) only")
    return found


def _remove_rope(model: nn.Module, found: list) -> None:
    """Replace the rotary embeddings ``found`` by :class:`NoRotaryEmbedding`."""
    for name, m in found:
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], NoRotaryEmbedding(2 * m.inv_freq.numel()).to(m.inv_freq.device))


def _configure(config, pc: PositionalConfig) -> None:
    if pc.scheme == "original":
        setattr(config, CONFIG_KEY, asdict(pc))
        _set_rotation(config, removed=False)
        config.__dict__.pop("attn_implementation", None)
        return
    if not _rope_dicts(config):
        raise ValueError(f"{type(config).__name__} has no rope_parameters: a converted model could not be saved so "
                         "that transformers reloads it without RoPE; apply_positional_scheme converts RoPE models "
                         "(Llama, Qwen, Mistral families) only")
    types = getattr(config, "layer_types", None)
    if types and any(t != "full_attention" for t in types):
        raise ValueError(f"layer types {sorted(set(types))} are not supported; only full_attention")
    setattr(config, CONFIG_KEY, asdict(pc))
    _set_rotation(config, removed=True)
    config.attn_implementation = pc.implementation   # saved in config.json: from_pretrained selects it
    # The positional scheme replaces sliding windows (Mistral); sliding layers are unsupported.
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = None
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = False
    if getattr(config, "attention_dropout", 0.0):
        config.attention_dropout = 0.0


def _merged(current: PositionalConfig, scheme: Optional[str], params: dict) -> PositionalConfig:
    """``current`` with ``scheme`` and ``params``; the window fields of another scheme, or the other
    window field when one is given, are dropped rather than carried over."""
    base = asdict(current)
    if scheme is not None and scheme != current.scheme:
        base.update(dict.fromkeys(WINDOW_FIELDS))
    if any(f in params for f in WINDOW_FIELDS):
        base.update(dict.fromkeys(WINDOW_FIELDS))
    if scheme is not None:
        base["scheme"] = scheme
    base.update(params)
    base["rope_removed"] = False
    return PositionalConfig(**base)


def convert(model_or_config, scheme: Optional[str] = None, **params):
    """Give a model (in place) or a config (a copy) the positional scheme ``scheme``
    (default: the saved ``config.poslsh``); ``params`` are :class:`PositionalConfig`
    fields. The attention implementations must be registered (``hf.register()``)."""
    from transformers import PretrainedConfig

    is_config = isinstance(model_or_config, PretrainedConfig)
    config = copy.deepcopy(model_or_config) if is_config else model_or_config.config
    current = positional_config(config)
    pc = _merged(current, scheme, params)
    if is_config:
        _configure(config, pc)
        config._attn_implementation = pc.implementation
        return config
    model = model_or_config
    rotation_gone = current.rope_removed or any(
        p.get("rope_type") == NO_ROTATION for p in _rope_dicts(config)) or any(
        isinstance(m, NoRotaryEmbedding) for m in model.modules())
    if pc.scheme == "original" and rotation_gone:
        raise ValueError("this model's RoPE was removed; reload it to get the original scheme back")
    found = _rotary_modules(model) if pc.scheme != "original" else []   # refuse before changing anything
    _configure(config, pc)
    if pc.scheme != "original":
        for m in attention_modules(model):   # modules copied the dropout rate at init
            if getattr(m, "attention_dropout", 0.0):
                m.attention_dropout = 0.0
        _remove_rope(model, found)
        setattr(config, CONFIG_KEY, asdict(PositionalConfig(**{**asdict(pc), "rope_removed": True})))
    model.set_attn_implementation(pc.implementation)
    return model
