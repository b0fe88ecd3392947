"""``patch_alibi``: unmodified transformers BLOOM, MPT and Falcon (``alibi=True``) models attend through
the library's ops, exact or windowed, at any length, without an ``n x n`` tensor.

What patching does (in place, on the given model and its modules):

* every attention module (``BloomAttention``, ``MptAttention``, ``FalconAttention``) gets a forward that
  runs the module's own projections and output (:mod:`.families`), and attends through
  :func:`poslsh.attend` with the layer's positional object (:mod:`.layer`): exact ALiBi
  (:class:`~poslsh.AlibiWindow` with :data:`~poslsh.window.kind.NO_WINDOW`), fixed or certified windows,
  or positional LSH (:class:`~poslsh.Partitions`);
* ``config._attn_implementation`` becomes ``"poslsh_alibi"``, whose registered mask builder hands the
  model a ``[1, 1, 1, 1]`` placeholder where transformers would build its ``n x n`` mask (the
  implementation name is not saved by ``save_pretrained``);
* forward hooks on the model and its base model refuse ``output_attentions`` / ``head_mask`` and push
  the call's padding mask and packed documents (``position_ids`` that restart, transformers' rule: no
  mask, no cache) where the layers read them (:mod:`.call`): what the model does with its mask
  before the layers run does not matter.
"""
from __future__ import annotations

import numbers
import weakref
from types import MethodType
from typing import Callable, List, Optional

import torch
from torch import Tensor

from ... import warn_if_untested
from .cache import enable_alibi_generation_cache
from .call import placeholder_mask, pop_call, push_call
from .families import Family, family_of, layer_slopes
from .layer import LayerAlibi

__all__ = ["patch_alibi", "alibi_stats", "IMPLEMENTATION", "register_alibi"]

IMPLEMENTATION = "poslsh_alibi"
FALCON_BIASES = ("exact", "bfloat16")


def _unused_attention(*args, **kwargs):
    raise RuntimeError("the poslsh_alibi implementation is only the mask builder of patch_alibi's models; "
                       "attention runs in the patched modules")


def register_alibi() -> None:
    """Register ``"poslsh_alibi"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, _unused_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, placeholder_mask)


def _check_arguments(window, tol, num_samples, falcon_bias, family: Family, backend) -> None:
    if num_samples is not None:
        if window is not None or tol is not None:
            raise ValueError("num_samples: positional LSH replaces the window; pass num_samples or window/tol, "
                             "not both")
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Integral) or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1 (partitions per head), got {num_samples!r}")
    if isinstance(window, str):
        if window != "certified":
            raise ValueError(f"window: {window!r} is not a window; pass None (exact), an int, [H] windows or "
                             "'certified' with tol=")
        if tol is None:
            raise ValueError("window='certified' needs tol= (the largest dropped softmax mass per query, e.g. 1e-3)")
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 < tol < 1:
            raise ValueError(f"tol must be a number in (0, 1), got {tol!r}")
    elif tol is not None:
        raise ValueError("tol: a tolerance chooses certified windows; pass window='certified' with it")
    if falcon_bias not in FALCON_BIASES:
        raise ValueError(f"falcon_bias must be one of {FALCON_BIASES}, got {falcon_bias!r}")
    if falcon_bias != "exact" and family.rounded_bias is None:
        raise ValueError(f"falcon_bias={falcon_bias!r}: only Falcon rounds its bias; this is a {family.name} model")
    if falcon_bias == "bfloat16" and window == "certified":
        raise ValueError("falcon_bias='bfloat16' with window='certified': the rounded bias is not ALiBi, which "
                         "the certified bound assumes; use falcon_bias='exact' or a fixed window")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string ('auto', 'torch', ...), got {type(backend).__name__}")
    from ....ops import load_backends, registry

    load_backends()
    known = {b.name for b in registry.registered("window")} | set(getattr(registry, "_MISSING", {}))
    if backend != "auto" and backend not in known:
        raise ValueError(f"backend: unknown backend {backend!r}; one of {sorted(known | {'auto'})}")


OUTPUT_ATTENTIONS = ("config.output_attentions=True: a patched ALiBi model never forms the n x n attention "
                     "weights; set it to False")


def _config_refusals(config) -> None:
    if getattr(config, "output_attentions", False):
        raise ValueError(OUTPUT_ATTENTIONS)


_GUARDED = {}


def _new_of(cls):
    return cls.__new__(cls)


def _guard_output_attentions(config) -> None:
    """Give ``config.output_attentions = True`` on a patched model the library's line (transformers' setter
    would advise its eager attention): the config becomes an instance of a subclass whose setter says so;
    it pickles as the original class."""
    cls = type(config)
    if getattr(cls, "_poslsh_alibi_guard", False):
        return
    prop = next((vars(c)["output_attentions"] for c in cls.__mro__ if "output_attentions" in vars(c)), None)
    if not isinstance(prop, property) or prop.fset is None:
        return                                  # a release without the setter: the call-time refusal stays

    def setter(self, value):
        if value and getattr(self, "_attn_implementation", None) == IMPLEMENTATION:
            raise ValueError(OUTPUT_ATTENTIONS)
        prop.fset(self, value)

    def reduce_ex(self, protocol):
        return _new_of, (cls,), self.__getstate__()

    if cls not in _GUARDED:
        _GUARDED[cls] = type(cls.__name__, (cls,), {"output_attentions": property(prop.fget, setter),
                                                    "_poslsh_alibi_guard": True, "__reduce_ex__": reduce_ex,
                                                    "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    config.__class__ = _GUARDED[cls]


def _placeholder_bias(shape_of: Callable) -> Callable:
    """What a patched base model builds where its own code builds the ALiBi tensor of its layers
    (``Family.unread_bias``), which the patched layers never read: zeros of the tensor's shape, a stride-0
    view (``O(1)``)."""
    def build(*args, **kwargs) -> Tensor:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, Tensor)), None)
        dtype = kwargs.get("dtype")
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        return torch.zeros((), dtype=dtype, device=device).expand(*shape_of(*args, **kwargs))
    return build


def _pre_hook(module, args, kwargs):
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: a patched ALiBi model never forms the n x n attention weights")
    if kwargs.get("head_mask") is not None:
        raise ValueError("head_mask: a patched ALiBi model does not scale heads; pass head_mask=None")
    _config_refusals(module.config)
    push_call(module, args, kwargs)


def _install_hooks(module) -> None:
    if getattr(module, "_poslsh_alibi_hooks", None):
        return
    module._poslsh_alibi_hooks = (
        module.register_forward_pre_hook(_pre_hook, with_kwargs=True),
        module.register_forward_hook(pop_call, with_kwargs=True, always_call=True))


def patch_alibi(model, *, window=None, tol: Optional[float] = None, num_samples: Optional[int] = None, seed: int = 0,
                backend: str = "auto", falcon_bias: str = "exact"):
    """Make a transformers BLOOM, MPT or Falcon (``alibi=True``) model attend through poslsh's ops, in place.

    Works on every head class (causal LM, sequence / token classification, question answering, the base
    model). Patching again re-configures every layer with the new arguments (idempotent: the same
    arguments give the same model). The weights, the config (but ``_attn_implementation``) and
    ``save_pretrained`` are untouched: a saved model loads unpatched, and ``patch_alibi`` applies again.

    Args:
        model: the model (not a copy; returned).
        window: ``None``: exact ALiBi over every key; a number (whole, or inf) or ``[H]`` (sequence or tensor):
            exact ALiBi cut at those windows, keys with ``|i - j| <= window_h`` (windows that cut no key are exact
            ALiBi, as ``None``); ``"certified"`` with ``tol``: per call and head the smallest window whose bound
            on the dropped softmax mass is ``<= tol`` (:mod:`.layer` says how the logit range is bounded).
        tol: the tolerance of ``window="certified"``.
        num_samples: positional LSH with the model's own bandwidths ``sigma_h = 1 / m_h``: ``num_samples``
            partitions per head, fixed per layer (seeded by ``seed`` and the layer), one softmax with the
            bias ``log count``; exclusive with ``window`` / ``tol``.
        seed: the seed of the partitions.
        backend: the op's backend (``"auto"``, ``"torch"``, ``"triton"``, ``"flex"``, ``"reference"``).
        falcon_bias: ``"exact"`` (default): exact ALiBi at Falcon's slopes; ``"bfloat16"``: transformers'
            bias ``bf16(bf16(m_h) p)`` reproduced (its rounding grows with the position).

    Raises (one line each, at patch time): a model that is not one of the three ALiBi families (Llama,
    Falcon with ``alibi=False``), an MPT variant transformers does not run, ``config.output_attentions``,
    bad ``window`` / ``tol`` / ``num_samples`` / ``falcon_bias`` combinations. At call time:
    ``output_attentions=True``, ``head_mask``, a prepared 4-D mask, a cache that does not hold exactly the
    past keys. A mask with a gap inside a row is served (exactly, by a dense path per query chunk).
    """
    warn_if_untested("patch_alibi")
    fam, attns, bases = family_of(model)
    _check_arguments(window, tol, num_samples, falcon_bias, fam, backend)
    _config_refusals(model.config)
    register_alibi()
    H = fam.heads(attns[0])[0]
    if window is not None and not isinstance(window, (str, numbers.Real)):
        n = len(window) if not isinstance(window, Tensor) else window.numel()
        if n not in (1, H):
            raise ValueError(f"window: got {n} windows for {H} heads")
    for i, module in enumerate(attns):
        slopes, scale, key_bias = layer_slopes(fam, module, falcon_bias)
        layer = module.layer_idx if module.layer_idx is not None else i
        module._poslsh_alibi = LayerAlibi.build(fam.name, layer, slopes, scale, window=window, tol=tol,
                                                num_samples=num_samples, seed=seed, backend=backend,
                                                key_bias=key_bias, kv_heads=fam.kv_heads(module),
                                                positions=fam.positions)
        module._poslsh_alibi.owner = weakref.ref(model.config)
        module.forward = MethodType(fam.forward, module)
    for base in bases:
        for name, shape_of in fam.unread_bias.items():
            setattr(base, name, _placeholder_bias(shape_of))
    for m in {id(x): x for x in [model, *bases]}.values():
        m.config._attn_implementation = IMPLEMENTATION
        _guard_output_attentions(m.config)
        _install_hooks(m)
    enable_alibi_generation_cache(model)
    model._poslsh_alibi_args = dict(window=window, tol=tol, num_samples=num_samples, seed=seed, backend=backend,
                                    falcon_bias=falcon_bias)
    return model


def alibi_stats(model) -> List[dict]:
    """Per patched layer (in order): ``layer``, ``family``, ``mode`` (``"exact"``, ``"window"``, ``"certified"``,
    ``"positional_lsh"``), ``heads``, ``slopes`` (logit units), ``window`` (per head; None: exact; for
    certified windows those of the last call, with ``logit_range``, ``keys`` and ``tol``), ``num_samples``,
    ``falcon_bias``. Raises when the model is not patched."""
    layers = [m._poslsh_alibi for m in model.modules() if isinstance(getattr(m, "_poslsh_alibi", None), LayerAlibi)]
    if not layers:
        raise ValueError("model: not patched; call poslsh.integrations.hf.patch_alibi(model) first")
    return [st.stats() for st in layers]
