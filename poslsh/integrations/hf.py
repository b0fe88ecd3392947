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
PosLSH / fixed blocks (RoPE removed; see :mod:`poslsh.integrations.hf_convert`).

Partitions: per query head ``sigma_h = 1 / alibi_slope_h`` for the model's number
of query heads (GQA: key/value heads are shared, partitions are per query head).
In training mode every forward pass draws fresh partitions seeded by
``(seed, step, layer)``, where ``step`` is passed along with the inputs:
``model(input_ids, poslsh_step=step)`` (transformers hands extra keyword arguments
down to the attention functions, so gradient-checkpoint recomputation sees the
same step). Without it each layer counts its own training forward passes. In
eval mode each layer has fixed partitions seeded by ``(eval_seed, layer)``. They are drawn
by ``config.poslsh["sampler"]`` (``"iid"``, the default, ``"stratified"`` or ``"grouped"``
with ``group_size``; see :mod:`poslsh.sampling`).
Parameters live in ``config.poslsh`` (a dict, saved with the config). Each
attention layer keeps one :class:`LayerState`: its partitions, already on the
device, and the ALiBi bias of the last shape.

Masks: with no mask (or an all-ones padding mask) the near-linear kernel runs.
A causal mask with contiguous per-row key padding (right or left padding) also
runs the kernel: each row is rolled so its valid tokens start at position 0,
which makes positions after the valid run the only padding, and causal queries
never see them. Any other mask (packed sequences, custom 4-D masks, sliding
windows) is applied exactly by the dense :func:`poslsh.reference.dense_attention`
(``O(nq nk)``), with one warning per model that names the cause.

Decoding with a KV cache: ``generate()`` of a model built, converted or loaded here
uses a bounded :class:`~poslsh.integrations.hf_cache.PoslshCache`
(:func:`generation_cache`, :func:`enable_generation_cache`), which drops the keys no
later query can see. Its steps, and decoding steps against a full cache
(``DynamicCache``, left padding), run :func:`poslsh.poslsh_attention` at the queries'
and keys' positions (``q_start``, ``k_start``), one call per group of rows with equal
offsets: ``O(nq * range * d)``, no ``nq x nk`` tensor. A row's positions start at its
first real token, as in the prefill.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ..alibi import alibi_bias, alibi_sigmas
from ..attention import poslsh_attention
from ..partitions import Partitions, sample_partitions
from ..reference import dense_attention
from ..seeding import stable_seed
from . import hf_cache
from .hf_cache import CACHE_KWARG, PoslshCache, enable_generation_cache, generation_cache
from .hf_convert import (IMPLEMENTATIONS, SCHEMES, NoRotaryEmbedding, PositionalConfig, convert,
                         positional_config)

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "PositionalConfig", "register", "apply_positional_scheme",
           "model_from_config", "from_pretrained", "positional_config", "layer_partitions", "LayerState",
           "NoRotaryEmbedding", "poslsh_attention_forward", "alibi_attention_forward",
           "fixed_blocks_attention_forward", "PoslshCache", "generation_cache", "enable_generation_cache"]

log = logging.getLogger(__name__)
STEP_KWARG = "poslsh_step"
CONTEXT_KWARG = "poslsh_context"   # a poslsh.distributed.ContextShard: the inputs are one rank's shard


# ------------------------------------------------------------------ partitions
@dataclass
class LayerState:
    """What one attention layer keeps between calls (one attribute on the module)."""

    partitions: Dict[str, Tuple[tuple, Partitions]] = field(default_factory=dict)  # slot -> (key, on device)
    auto_step: int = -1                       # training forward passes seen without an explicit step
    alibi: Optional[Tuple[tuple, Tensor]] = None   # (shape key, bias [H, nq, nk])


def layer_state(module: nn.Module) -> LayerState:
    state = module.__dict__.get("_poslsh_state")
    if state is None:
        state = LayerState()
        module.__dict__["_poslsh_state"] = state
    return state


def layer_partitions(module: nn.Module, num_heads: int, scheme: str = "poslsh", *, step: Optional[int] = None,
                     device=None) -> Partitions:
    """The partitions an attention layer uses now, on ``device`` (see the module docstring)."""
    pc = positional_config(module.config)
    state = layer_state(module)
    if scheme == "fixed_blocks":
        key, slot = ("fixed", num_heads, pc.block_size), "fixed"
    else:
        layer = int(getattr(module, "layer_idx", 0) or 0)
        if module.training:
            if step is None:   # no explicit step: count forward passes of this layer
                state.auto_step += 1
                step = state.auto_step
            key, slot = ("train", pc.seed, int(step), layer, num_heads, pc.num_samples), "train"
        else:
            key, slot = ("eval", pc.eval_seed, layer, num_heads, pc.num_samples), "eval"
        if pc.sampler != "iid":      # i.i.d. keeps its seeds (and so every earlier run's partitions)
            key += (pc.sampler, pc.group_size)
    device = torch.device("cpu") if device is None else torch.device(device)
    hit = state.partitions.get(slot)
    if hit is not None and hit[0] == (key, device):
        return hit[1]
    if scheme == "fixed_blocks":
        parts = Partitions.fixed_blocks(num_heads, pc.block_size)
    else:
        parts = sample_partitions(alibi_sigmas(num_heads), pc.num_samples, seed=stable_seed(*key),
                                  method=pc.sampler, group_size=pc.group_size)
    parts = parts.to(device)
    state.partitions[slot] = ((key, device), parts)
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


def _window_mask(allowed: Optional[Tensor], nq: int, nk: int, causal: bool, window: Optional[int],
                 device) -> Optional[Tensor]:
    """The boolean mask of the dense path: the given one, or causal, narrowed to a sliding window."""
    if window is None:
        return allowed
    qpos = torch.arange(nk - nq, nk, device=device)[:, None]
    kpos = torch.arange(nk, device=device)[None, :]
    near = (qpos - kpos < window) & ((kpos <= qpos) if causal else True)
    return near[None, None] if allowed is None else allowed & near


def _dense(query, key, value, allowed, bias, scaling, causal, window) -> Tensor:
    """Exact attention with an additive bias ``[H, nq, nk]``; queries are the last ``nq`` of
    ``nk`` positions. A given mask is authoritative (it already encodes causality)."""
    nq, nk = query.shape[2], key.shape[2]
    mask = _window_mask(allowed, nq, nk, causal, window, query.device)
    return dense_attention(query, key, value, bias[None], allowed=mask, causal=causal and mask is None,
                           scale=scaling)


def _alibi(module, H: int, nq: int, nk: int, device) -> Tensor:
    state = layer_state(module)
    key = (H, nq, nk, str(device))
    if state.alibi is None or state.alibi[0] != key:
        state.alibi = (key, alibi_bias(nk, alibi_sigmas(H).reciprocal(), dtype=torch.float32, device=device,
                                       num_queries=nq))
    return state.alibi[1]


def _sliding(kwargs, nk: int) -> Optional[int]:
    w = kwargs.get("sliding_window")
    return int(w) if w is not None and int(w) < nk else None


# Dense-fallback warnings already given: (id(config), cause) -> config (weak: dies with the model).
_WARNED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _warn_dense_once(module, scheme: str, cause: str) -> None:
    key = (id(module.config), scheme, cause.split(" (")[0])    # the cause without its sizes
    if _WARNED.get(key) is not module.config:
        log.warning("%s attention: %s needs the exact dense O(nq * nk) path (warned once per model)", scheme, cause)
        _WARNED[key] = module.config


def _block_attention_forward(scheme: str, module, query, key, value, attention_mask, scaling=None,
                             dropout: float = 0.0, **kwargs):
    step = kwargs.pop(STEP_KWARG, None)
    context = kwargs.pop(CONTEXT_KWARG, None)
    layer = kwargs.pop(CACHE_KWARG, None)
    _check_kwargs(module, dropout, kwargs)
    query, key, value = _same_dtype(query, key, value)
    H, d, nq, nk = query.shape[1], query.shape[3], query.shape[2], key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if context is None and (layer is not None or nq != nk) and module.training:
        raise ValueError("model is in training mode, which draws new partitions every forward; decoding with a "
                         "KV cache needs the fixed evaluation partitions: call model.eval()")
    parts = layer_partitions(module, H, scheme, step=step, device=query.device)
    backend = positional_config(module.config).backend
    allowed = _allowed(attention_mask)
    if context is not None:   # context parallelism: query/key/value are this rank's shard of each sequence
        with _no_autocast(query.device):
            out = context.attention(query, key, value, parts, causal=causal, scale=scaling, backend=backend,
                                    mask=allowed, window=kwargs.get("sliding_window"))
        return out.transpose(1, 2).contiguous(), None
    if layer is not None:   # a PoslshCache step: the keys are the layer's bounded window
        if kwargs.get("sliding_window") is not None or not causal:
            raise ValueError("cache: a PoslshCache needs causal attention without a sliding window")
        with _no_autocast(query.device):
            out = hf_cache.attend(layer, module, scheme, query, key, value, allowed, parts, scaling, backend,
                                  kwargs.get("position_ids"))
        return out.transpose(1, 2).contiguous(), None
    window = _sliding(kwargs, nk)
    with _no_autocast(query.device):
        out = None
        if nq == nk and window is None:
            out = _kernel(query, key, value, parts, allowed, causal, scaling, backend)
        elif window is None and causal and (pads := hf_cache.left_pads(allowed, query.shape[0], nq, nk)) is not None:
            # decoding against a full cache (keys 0..nk-1, queries the last nq): spans, per row
            out = hf_cache.span_rows_attention(query, key, value, parts, nk - nq, 0, pads, scaling, backend)
        if out is None:   # general mask: exact, dense O(nq * nk)
            cause = ("a sliding window" if window is not None else
                     f"a mask other than causal padding ({nq} queries, {nk} keys: packed sequences, a custom 4-D "
                     "mask or non-causal decoding)")
            _warn_dense_once(module, scheme, cause)
            count = parts.dense_count(nk)[:, nk - nq:, :].to(torch.float64)
            out = _dense(query, key, value, allowed, torch.log(count), scaling, causal, window)
    return out.transpose(1, 2).contiguous(), None


def _kernel(query, key, value, parts, allowed, causal, scaling, backend) -> Optional[Tensor]:
    """The near-linear op when the mask allows it (none, or causal with contiguous padding)."""
    if allowed is None:
        return poslsh_attention(query, key, value, parts, causal=causal, scale=scaling, backend=backend)
    if not causal or (start := _causal_key_runs(allowed)) is None:
        return None
    if bool((start == 0).all()):   # right padding: valid queries never see the padded keys
        return poslsh_attention(query, key, value, parts, causal=True, scale=scaling, backend=backend)
    # left padding: roll each row so it becomes right padding
    q, k, v = (_roll_rows(t, start) for t in (query, key, value))
    return _roll_rows(poslsh_attention(q, k, v, parts, causal=True, scale=scaling, backend=backend), -start)


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
    kwargs.pop(STEP_KWARG, None)
    if kwargs.pop(CONTEXT_KWARG, None) is not None:
        raise ValueError("poslsh_context: exact ALiBi cannot run context-parallel (every query sees every earlier "
                         "key); use the poslsh or fixed_blocks implementation")
    if kwargs.pop(CACHE_KWARG, None) is not None:
        raise ValueError("cache: a PoslshCache serves poslsh/fixed_blocks attention but this model runs alibi; "
                         "use transformers' DynamicCache")
    _check_kwargs(module, dropout, kwargs)
    query, key, value = _same_dtype(query, key, value)
    B, H, nq, d = query.shape
    nk = key.shape[2]
    scaling = d ** -0.5 if scaling is None else scaling
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    bias = _alibi(module, H, nq, nk, query.device)
    with _no_autocast(query.device):
        out = _dense(query, key, value, _allowed(attention_mask), bias, scaling, causal, _sliding(kwargs, nk))
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
def apply_positional_scheme(model_or_config, scheme: Optional[str] = None, **params):
    """Give a Llama/Qwen3/Mistral-family model (in place) or config (a copy) the positional
    scheme ``scheme`` (one of :data:`SCHEMES`; default: ``config.poslsh`` as saved).

    ``"original"`` keeps RoPE and ``sdpa``. ``"alibi"``, ``"poslsh"``, ``"fixed_blocks"`` set
    ``attn_implementation`` to that name and remove RoPE (on a model; for a config use
    :func:`model_from_config`). ``params`` are :class:`PositionalConfig` fields
    (``num_samples``, ``sampler``, ``group_size``, ``block_size``, ``seed``, ``eval_seed``, ``backend``).
    """
    register()
    out = convert(model_or_config, scheme, **params)
    return out if out is not model_or_config else enable_generation_cache(out)


def from_pretrained(path, **kwargs):
    """Load a model saved with ``save_pretrained`` and re-apply its saved positional scheme
    (``config.poslsh``): RoPE removed again and the attention implementation selected.

    Plain ``AutoModelForCausalLM.from_pretrained`` cannot know about the scheme: it would
    load a poslsh / ALiBi model as a RoPE + sdpa model, whose logits are wrong.
    ``kwargs`` go to ``from_pretrained`` (e.g. ``dtype``); nothing is downloaded unless
    ``local_files_only=False`` is passed.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    kwargs.setdefault("local_files_only", True)
    config = AutoConfig.from_pretrained(path, local_files_only=kwargs["local_files_only"])
    pc = positional_config(config)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=pc.implementation, **kwargs)
    if pc.scheme == "original":
        return model
    params = {k: v for k, v in asdict(pc).items() if k not in ("scheme", "rope_removed")}
    return enable_generation_cache(convert(model, pc.scheme, **params))


def model_from_config(config, scheme: Optional[str] = None, **params):
    """``AutoModelForCausalLM.from_config`` with a positional scheme applied (randomly initialised)."""
    from transformers import AutoModelForCausalLM

    register()
    scheme = scheme or positional_config(config).scheme
    cfg = convert(config, scheme, **params)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=positional_config(cfg).implementation)
    return enable_generation_cache(convert(model, scheme, **params))


try:  # register on import when transformers is installed
    register()
except ImportError:  # pragma: no cover - transformers is an optional extra
    pass
