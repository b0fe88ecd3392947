"""Hugging Face ``transformers`` integration, without forking transformers.

Importing this module registers three attention implementations with
``transformers.AttentionInterface`` (and a matching mask builder with
``AttentionMaskInterface``, so padding masks reach them):

* ``"poslsh"``: positional-LSH attention (:func:`poslsh.poslsh_attention`);
* ``"fixed_blocks"``: the paper's fixed-blocks baseline (one deterministic partition);
* ``"alibi"``: exact ALiBi attention (dense, the baseline PosLSH approximates).

Any Llama / Qwen3 / Mistral-family model then runs with
``attn_implementation="poslsh"``. :func:`apply_positional_scheme` goes further
and turns a model (or config) into one whose *only* positional signal is ALiBi /
PosLSH / fixed blocks: the rotary embedding is replaced by one returning
``cos = 1, sin = 0`` (so ``apply_rotary_pos_emb`` is the identity).

Partitions: per query head ``sigma_h = 1 / alibi_slope_h`` for the model's number
of query heads (GQA: key/value heads are shared, partitions are per query head).
In training mode every forward pass draws fresh partitions seeded by
``(seed, step, layer)`` where ``step`` is set with :func:`set_training_step`
(so runs are reproducible and gradient-checkpoint recomputation sees the same
partitions); in eval mode each layer has fixed partitions seeded by
``(eval_seed, layer)``. Parameters live in ``config.poslsh`` (a dict, saved
with the config).

Masks: with no mask (or an all-ones padding mask) the near-linear kernel runs.
A causal mask with contiguous per-row key padding (right or left padding) also
runs the kernel: each row is rolled so its valid tokens start at position 0,
which makes positions after the valid run the only padding, and causal queries
never see them. Any other mask (packed sequences, decoding with a KV cache,
custom 4-D masks) is applied exactly by a dense ``O(n^2)`` fallback.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..alibi import alibi_sigmas, alibi_slopes
from ..attention import poslsh_attention
from ..partitions import Partitions, sample_partitions

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "PositionalConfig", "register", "apply_positional_scheme",
           "model_from_config", "positional_config", "set_training_step", "layer_partitions",
           "NoRotaryEmbedding", "poslsh_attention_forward", "alibi_attention_forward",
           "fixed_blocks_attention_forward"]

log = logging.getLogger(__name__)

SCHEMES = ("original", "alibi", "poslsh", "fixed_blocks")
IMPLEMENTATIONS = ("alibi", "poslsh", "fixed_blocks")
CONFIG_KEY = "poslsh"


@dataclass(frozen=True)
class PositionalConfig:
    """Positional scheme of a model, stored as ``config.poslsh``."""

    scheme: str = "poslsh"       # one of SCHEMES
    num_samples: int = 10        # s, partitions per head (poslsh)
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


def positional_config(config) -> PositionalConfig:
    """The :class:`PositionalConfig` of a transformers config (defaults if unset)."""
    raw = getattr(config, CONFIG_KEY, None)
    if isinstance(raw, PositionalConfig):
        return raw
    if raw:
        return PositionalConfig(**raw)
    impl = getattr(config, "_attn_implementation", None)
    return PositionalConfig(scheme=impl if impl in IMPLEMENTATIONS else "original")


# ------------------------------------------------------------------ partitions
def partition_seed(*parts) -> int:
    """A stable 63-bit seed from its parts (independent of Python's hash salt)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _attention_modules(model: nn.Module):
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "config") and type(m).__name__.endswith("Attention")]


def set_training_step(model: nn.Module, step: int) -> None:
    """Make training-mode partitions of every layer depend on ``step`` (call before each
    forward pass; the trainer does). Without it each layer counts its own training
    forward passes, which is not safe with gradient checkpointing."""
    for m in _attention_modules(model):
        m.poslsh_step = int(step)


def layer_partitions(module: nn.Module, num_heads: int, scheme: str = "poslsh") -> Partitions:
    """The partitions an attention layer uses now (see the module docstring)."""
    pc = positional_config(module.config)
    cache = module.__dict__.setdefault("_poslsh_partitions", {})
    if scheme == "fixed_blocks":
        key = ("fixed", num_heads, pc.block_size)
        slot = "fixed"
    else:
        layer = int(getattr(module, "layer_idx", 0) or 0)
        if module.training:
            step = getattr(module, "poslsh_step", None)
            if step is None:   # no explicit step: count forward passes of this layer
                step = module.__dict__.get("_poslsh_auto_step", -1) + 1
                module._poslsh_auto_step = step
            key = ("train", pc.seed, step, layer, num_heads, pc.num_samples)
            slot = "train"
        else:
            key = ("eval", pc.eval_seed, layer, num_heads, pc.num_samples)
            slot = "eval"
    hit = cache.get(slot)
    if hit is not None and hit[0] == key:
        return hit[1]
    if scheme == "fixed_blocks":
        parts = Partitions.fixed_blocks(num_heads, pc.block_size)
    else:
        parts = sample_partitions(alibi_sigmas(num_heads), pc.num_samples, seed=partition_seed(*key))
    cache[slot] = (key, parts)
    return parts


# ----------------------------------------------------------------------- masks
def _allowed(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """A 4-D mask as booleans ``[B, 1|H, nq, nk]`` (True = attend), or None."""
    if attention_mask is None:
        return None
    m = attention_mask
    if not isinstance(m, Tensor) or m.dim() != 4:
        raise ValueError("the poslsh/alibi attention implementations need a 4-D attention mask "
                         f"(or None), got {type(m).__name__} of shape {getattr(m, 'shape', None)}")
    if m.dtype == torch.bool:
        return m
    if m.dtype.is_floating_point:  # additive mask: 0 = attend, very negative = masked
        allowed = m > torch.finfo(m.dtype).min / 2
        if bool((m[allowed] != 0).any()):
            raise ValueError("additive float masks with non-zero biases are not supported by the "
                             "poslsh/alibi attention implementations (only 0 / -inf masks)")
        return allowed
    raise TypeError(f"unsupported attention mask dtype {m.dtype}")


def _causal_key_runs(allowed: Tensor) -> Optional[Tensor]:
    """If ``allowed`` is a causal mask with one contiguous run of valid keys per row
    (right or left padding), the start of each row's run ``[B]``; else None."""
    B, h, nq, nk = allowed.shape
    if nq != nk:
        return None
    a = allowed[:, 0]
    if h > 1 and not bool((allowed == a[:, None]).all()):
        return None
    valid = a.any(dim=1)                                              # [B, nk]
    tri = torch.ones(nk, nk, dtype=torch.bool, device=a.device).tril()
    if not torch.equal(a, tri[None] & valid[:, None, :]):
        return None
    idx = torch.arange(nk, device=a.device)
    count = valid.sum(1)
    start = torch.where(valid, idx, nk).amin(1)
    end = torch.where(valid, idx + 1, 0).amax(1)
    start = torch.where(count > 0, start, 0)
    end = torch.where(count > 0, end, 0)
    if not torch.equal(count, end - start):
        return None
    return start


def _roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """``y[b, :, j] = x[b, :, (j + shift[b]) % n]`` for ``x [B, H, n, d]``."""
    n = x.shape[2]
    idx = (torch.arange(n, device=x.device)[None] + shift[:, None]) % n            # [B, n]
    return torch.gather(x, 2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


# ------------------------------------------------------------- attention cores
def _check_kwargs(module, dropout: float, kwargs) -> None:
    if dropout and dropout > 0:
        raise NotImplementedError("attention dropout is not supported by the poslsh/alibi attention "
                                  "implementations; set config.attention_dropout = 0")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("logit softcapping is not supported by the poslsh/alibi attention implementations")
    if kwargs.get("output_attentions"):
        log.warning("poslsh/alibi attention does not return attention weights (output_attentions ignored)")


def _same_dtype(query: Tensor, key: Tensor, value: Tensor):
    """One dtype for q, k, v: under autocast (e.g. bf16 on CUDA) Qwen3's q/k norms return
    float32 while v is bf16, and the kernels want a single dtype."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
    else:
        dt = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dt), key.to(dt), value.to(dt)


def _no_autocast(device: torch.device):
    # The kernels pick their own accumulation dtype; autocast inside them mixes dtypes.
    return torch.autocast(device_type=device.type, enabled=False)


def _dense_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Optional[Tensor], bias: Tensor,
                     scaling: float, causal: bool, sliding_window: Optional[int] = None) -> Tensor:
    """Exact attention with an additive bias ``[H, nq, nk]`` (``-inf`` allowed) and a mask.
    Queries are the last ``nq`` positions of the ``nk`` keys (KV-cache decoding)."""
    B, H, nq, _ = query.shape
    nk = key.shape[2]
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    if allowed is None:
        qpos = torch.arange(nk - nq, nk, device=query.device)[:, None]
        kpos = torch.arange(nk, device=query.device)[None, :]
        allowed = (kpos <= qpos) if causal else torch.ones(nq, nk, dtype=torch.bool, device=query.device)
        if sliding_window is not None:
            allowed = allowed & (qpos - kpos < sliding_window)
        allowed = allowed[None, None]
    lowest = torch.finfo(ct).min
    # finfo.min, not -inf: a row with nothing to attend (padding) gets uniform weights, not NaN.
    mask = torch.where(allowed, bias.to(ct)[None], lowest).clamp_min(lowest)
    group = H // key.shape[1]
    k = key.to(ct).repeat_interleave(group, dim=1)
    v = value.to(ct).repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query.to(ct), k, v, attn_mask=mask, scale=scaling)
    return out.to(query.dtype)


def _alibi_bias(module, H: int, nq: int, nk: int, device) -> Tensor:
    cache = module.__dict__.setdefault("_poslsh_alibi_bias", {})
    key = (H, nq, nk, str(device))
    if key not in cache:
        cache.clear()
        slopes = alibi_slopes(H, dtype=torch.float32, device=device)
        qpos = torch.arange(nk - nq, nk, device=device, dtype=torch.float32)
        kpos = torch.arange(nk, device=device, dtype=torch.float32)
        cache[key] = -slopes[:, None, None] * (qpos[:, None] - kpos[None, :]).abs()
    return cache[key]


def _sliding(kwargs, nk: int) -> Optional[int]:
    w = kwargs.get("sliding_window")
    return int(w) if w is not None and int(w) < nk else None


def _block_attention_forward(scheme: str, module, query, key, value, attention_mask, scaling=None,
                             dropout: float = 0.0, **kwargs):
    _check_kwargs(module, dropout, kwargs)
    query, key, value = _same_dtype(query, key, value)
    H, d, nk = query.shape[1], query.shape[3], key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    parts = layer_partitions(module, H, scheme)
    backend = positional_config(module.config).backend
    allowed = _allowed(attention_mask)
    window = _sliding(kwargs, nk)
    with _no_autocast(query.device):
        out = _block_core(query, key, value, parts, allowed, causal, scaling, backend, window, scheme, module)
    return out.transpose(1, 2).contiguous(), None


def _block_core(query, key, value, parts, allowed, causal, scaling, backend, window, scheme, module):
    nq, nk = query.shape[2], key.shape[2]
    out = None
    if nq == nk and window is None:
        if allowed is None:
            out = poslsh_attention(query, key, value, parts, causal=causal, scale=scaling, backend=backend)
        elif causal and (start := _causal_key_runs(allowed)) is not None:
            if bool((start == 0).all()):   # right padding: valid queries never see the padded keys
                out = poslsh_attention(query, key, value, parts, causal=True, scale=scaling, backend=backend)
            else:                          # left padding: roll each row so it becomes right padding
                q, k, v = (_roll_rows(t, start) for t in (query, key, value))
                o = poslsh_attention(q, k, v, parts, causal=True, scale=scaling, backend=backend)
                out = _roll_rows(o, -start)
    if out is None:  # general mask / KV-cache decoding: exact, dense O(nq * nk)
        if not module.__dict__.get("_poslsh_warned_dense"):
            log.warning("%s attention: mask or shapes need the dense O(n^2) fallback (nq=%d, nk=%d)",
                        scheme, nq, nk)
            module._poslsh_warned_dense = True
        count = parts.to(query.device).dense_count(nk)[:, nk - nq:, :].to(torch.float64)
        out = _dense_attention(query, key, value, allowed, torch.log(count), scaling, causal, window)
    return out


def poslsh_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="poslsh"``:
    ``(module, q [B,Hq,n,d], k/v [B,Hkv,n,d], mask, ...) -> ([B, n, Hq, d], None)``."""
    return _block_attention_forward("poslsh", module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def fixed_blocks_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="fixed_blocks"``."""
    return _block_attention_forward("fixed_blocks", module, query, key, value, attention_mask, scaling, dropout,
                                    **kwargs)


def alibi_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function for ``attn_implementation="alibi"``: exact ALiBi with
    slopes for the model's number of query heads (dense ``O(n^2)``, like stock ``sdpa``)."""
    _check_kwargs(module, dropout, kwargs)
    query, key, value = _same_dtype(query, key, value)
    B, H, nq, d = query.shape
    nk = key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    bias = _alibi_bias(module, H, nq, nk, query.device)
    with _no_autocast(query.device):
        out = _dense_attention(query, key, value, _allowed(attention_mask), bias, scaling, causal,
                               _sliding(kwargs, nk))
    return out.transpose(1, 2).contiguous(), None


_FUNCTIONS = {"poslsh": poslsh_attention_forward, "fixed_blocks": fixed_blocks_attention_forward,
              "alibi": alibi_attention_forward}


def register() -> None:
    """Register the three implementations (idempotent; done on import)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    for name, fn in _FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        # Without a mask function transformers passes attention_mask=None to unknown
        # implementations, silently dropping padding. sdpa's mask is a boolean 4-D
        # mask, or None when it is plainly causal (no padding).
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


# ------------------------------------------------------------------ conversion
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


def _remove_rope(model: nn.Module) -> int:
    replaced = 0
    for name, m in list(model.named_modules()):
        if type(m).__name__.endswith("RotaryEmbedding") and not isinstance(m, NoRotaryEmbedding):
            inv = getattr(m, "inv_freq", None)
            if inv is None:
                raise ValueError(f"cannot find the rotary dimension of {name} ({type(m).__name__})")
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], NoRotaryEmbedding(2 * inv.numel()).to(inv.device))
            replaced += 1
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


def apply_positional_scheme(model_or_config, scheme: Optional[str] = None, **params):
    """Give a Llama/Qwen3/Mistral-family model (in place) or config (a copy) the positional
    scheme ``scheme`` (one of :data:`SCHEMES`; default: ``config.poslsh`` as saved).

    ``"original"`` keeps RoPE and ``sdpa``. ``"alibi"``, ``"poslsh"``, ``"fixed_blocks"`` set
    ``attn_implementation`` to that name and remove RoPE (on a model; for a config use
    :func:`model_from_config`). ``params`` are :class:`PositionalConfig` fields
    (``num_samples``, ``block_size``, ``seed``, ``eval_seed``, ``backend``).
    """
    register()
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
    impl = "sdpa" if pc.scheme == "original" else pc.scheme
    if is_config:
        _configure(config, pc)
        config._attn_implementation = impl
        return config
    model = model_or_config
    if pc.scheme == "original" and current.rope_removed:
        raise ValueError("this model's RoPE was removed; reload it to get the original scheme back")
    _configure(config, pc)
    if pc.scheme != "original":
        for m in _attention_modules(model):   # modules copied the dropout rate at init
            if getattr(m, "attention_dropout", 0.0):
                m.attention_dropout = 0.0
        _remove_rope(model)
        pc = PositionalConfig(**{**asdict(pc), "rope_removed": True})
        setattr(config, CONFIG_KEY, asdict(pc))
    model.set_attn_implementation(impl)
    return model


def model_from_config(config, scheme: Optional[str] = None, **params):
    """``AutoModelForCausalLM.from_config`` with a positional scheme applied (randomly initialised)."""
    from transformers import AutoModelForCausalLM

    register()
    pc = positional_config(config)
    scheme = scheme or pc.scheme
    impl = "sdpa" if scheme == "original" else scheme
    model = AutoModelForCausalLM.from_config(apply_positional_scheme(config, scheme, **params),
                                             attn_implementation=impl)
    return apply_positional_scheme(model, scheme, **params)


try:  # register on import when transformers is installed
    register()
except ImportError:  # pragma: no cover - transformers is an optional extra
    pass
