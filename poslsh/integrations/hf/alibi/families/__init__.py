"""The ALiBi families of transformers as they are, one module each: which modules attend, their slopes as
the model's code computes them, the logit scale, what each refuses, and each attention module's patched
forward (its own projections, then :func:`~poslsh.integrations.hf.alibi.layer.layer_attention`).

:mod:`.bloom`, :mod:`.mpt`, :mod:`.falcon`. A new ALiBi family is a module here defining its ``FAMILY``
(a :class:`~.family.Family`: names, forward, slopes, refusals, how to read heads and scale) and one entry in
:data:`FAMILIES`; nothing outside this package names a family.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch
from torch import Tensor

from . import bloom, falcon, mpt
from .family import Family

__all__ = ["Family", "FAMILIES", "family_of", "layer_slopes"]

FAMILIES = {fam.name: fam for fam in (bloom.FAMILY, mpt.FAMILY, falcon.FAMILY)}    # by config.model_type


def family_of(model) -> Tuple[Family, List[torch.nn.Module], List[torch.nn.Module]]:
    """The model's family, its attention modules (in layer order) and its base models; one line for a
    model that is not BLOOM, MPT or ALiBi Falcon."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model: a transformers BLOOM, MPT or Falcon model expected, got {type(model).__name__}")
    kind = getattr(model.config, "model_type", None)
    fam = FAMILIES.get(kind)
    if fam is None:
        raise ValueError(f"model: {type(model).__name__} (model_type {kind!r}) is not an ALiBi model patch_alibi "
                         "knows (BLOOM, MPT, Falcon with alibi=True); RoPE models take "
                         "poslsh.integrations.hf.apply_positional_scheme")
    fam.check(model.config)
    attn = [m for m in model.modules() if type(m).__name__ == fam.attention_class]
    other = [m for m in model.modules() if type(m).__name__.startswith(fam.attention_class[:-9])
             and type(m).__name__.endswith(("Attention", "Attention2")) and type(m).__name__ != fam.attention_class]
    if other:
        raise ValueError(f"model: {type(other[0]).__name__} is not the eager {fam.attention_class} (flash-attention "
                         "has no ALiBi in transformers); load the model with the default attention implementation")
    if not attn:
        raise ValueError(f"model: {type(model).__name__} has no {fam.attention_class} module")
    bases = [m for m in model.modules() if type(m).__name__ == fam.base_class]
    return fam, attn, bases


def layer_slopes(fam: Family, module, falcon_bias: str) -> Tuple[Tensor, float, object]:
    """``(slopes in logit units [H] float64, logit scale, key_bias or None)`` of one attention module: the
    family's slopes, divided by ``sqrt(head_dim)`` where its bias is scaled with the logits; with
    ``falcon_bias="bfloat16"`` (a family with a rounded bias), its rounded slopes and the rounding term."""
    H, d = fam.heads(module)
    scale = fam.scale(module)
    root = math.sqrt(d) if fam.bias_scaled else 1.0
    if falcon_bias == "bfloat16":
        return fam.slopes(H).to(torch.bfloat16).to(torch.float64) / root, scale, fam.rounded_bias(fam.slopes(H), d)
    m = fam.slopes(H).to(torch.float64)
    return (m / root if fam.bias_scaled else m), scale, None
