"""The schemes' entry points: a model (or config) given a positional scheme, built from a config, or loaded
with its saved scheme; each registers the attention implementations and enables the bounded cache of
``generate()``."""
from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from ..cache import enable_generation_cache
from ..config import positional_config
from .attention import register
from .convert import convert

__all__ = ["apply_positional_scheme", "from_pretrained", "model_from_config"]


def apply_positional_scheme(model_or_config, scheme: Optional[str] = None, **params):
    """Give a Llama/Qwen3/Mistral-family model (in place) or config (a copy) the positional
    scheme ``scheme`` (one of :data:`SCHEMES`; default: ``config.poslsh`` as saved).

    ``"original"`` keeps RoPE and ``sdpa``. ``"alibi"``, ``"poslsh"``, ``"fixed_blocks"``,
    ``"alibi-window"`` set ``attn_implementation`` to that name and remove RoPE (on a model; for
    a config use :func:`model_from_config`). ``params`` are :class:`PositionalConfig` fields
    (``num_samples``, ``sampler``, ``group_size``, ``block_size``, ``seed``, ``eval_seed``,
    ``backend``; for ``"alibi-window"`` exactly one of ``window_sigmas``, ``window_cost_samples``).
    """
    register()
    out = convert(model_or_config, scheme, **params)
    return out if out is not model_or_config else enable_generation_cache(out)


def from_pretrained(path, **kwargs):
    """Load a model saved with ``save_pretrained`` and re-apply its saved positional scheme
    (``config.poslsh``): RoPE removed, the attention implementation selected, and the
    bounded cache of ``generate()`` enabled.

    Plain ``AutoModelForCausalLM.from_pretrained`` gives the same logits for models saved by
    this version (with poslsh imported); models saved before it came back as RoPE + sdpa, which
    this function still loads correctly. ``kwargs`` go to ``from_pretrained`` (e.g. ``dtype``);
    nothing is downloaded unless ``local_files_only=False`` is passed.
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
