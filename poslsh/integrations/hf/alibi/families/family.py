"""What an ALiBi model family is to :func:`~poslsh.integrations.hf.alibi.patch_alibi` (:class:`Family`), and
the call's arguments read by name, whatever the order a transformers release passes them in."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

from torch import Tensor

from .... import BELOW_TRANSFORMERS, MIN_TRANSFORMERS

__all__ = ["Family", "arguments", "signature_of"]


@functools.lru_cache(maxsize=256)
def signature_of(fn) -> inspect.Signature:
    """``inspect.signature(fn)``, once per function (a decoding step binds every layer's arguments)."""
    return inspect.signature(fn)


@dataclass(frozen=True)
class Family:
    """One ALiBi family of transformers, as its code computes attention.

    ``forward`` replaces the attention module's forward (its own projections, then
    :func:`~poslsh.integrations.hf.alibi.layer.layer_attention`); ``slopes(H)`` are the model's own (float32
    ``[H]``); ``check(config)`` refuses variants the model's code does not run; ``heads(module)`` is
    ``(H, head_dim)``, ``scale(module)`` the logit scale, ``kv_heads(module)`` the key/value heads.
    ``positions``: how the model counts a row's positions (``"cumsum"``: real tokens; ``"index"``: the index
    from the first real token; :func:`~poslsh.integrations.hf.alibi.attend.row_positions`). ``bias_scaled``: the
    bias is scaled with the logits (``(q . k + m_h p) / sqrt(d)``). ``rounded_bias(slopes32, head_dim)``: the
    model's own rounded bias term, reproduced with ``falcon_bias="bfloat16"`` (None: the family has none).
    ``unread_bias``: the base model's methods that build its own ALiBi tensor for the layers, which the patched
    layers never read (BLOOM's ``O(B H n)`` per forward, at every decoding step), each with the shape its
    tensor has (``(args, kwargs) -> shape``): a patched model's return zeros of that shape as a stride-0 view,
    ``O(1)`` memory, so whatever the model's code does with the tensor's shape still holds.
    """

    name: str
    base_class: str
    attention_class: str
    forward: Callable
    slopes: Callable[[int], Tensor]
    check: Callable
    heads: Callable
    scale: Callable
    kv_heads: Callable
    positions: str = "cumsum"
    bias_scaled: bool = False
    rounded_bias: Optional[Callable] = None
    unread_bias: Dict[str, Callable] = field(default_factory=dict)


def arguments(self, args, kwargs) -> dict:
    """The call's arguments by the names of the module's own (unpatched) forward, whatever their order or
    number in this transformers release; the cache under ``"cache"`` (``layer_past`` / ``past_key_values``)."""
    try:
        sig = signature_of(type(self).forward)
        named = dict(sig.bind(self, *args, **kwargs).arguments)
        for p in sig.parameters.values():           # the **kwargs entry, flattened
            if p.kind is p.VAR_KEYWORD:
                named.update(named.pop(p.name, {}) or {})
    except TypeError as e:
        raise TypeError(f"{type(self).__name__}: this transformers release calls its attention with arguments the "
                        f"patched forward cannot bind ({e}); patch_alibi is tested with transformers "
                        f">={MIN_TRANSFORMERS},<{BELOW_TRANSFORMERS}") from None
    if named.get("output_attentions"):
        raise ValueError("output_attentions=True: a patched ALiBi model never forms the n x n attention weights; "
                         "call it with output_attentions=False")
    for name in ("cache", "layer_past", "past_key_values"):
        if named.get(name) is not None:
            named["cache"] = named[name]
    return named
