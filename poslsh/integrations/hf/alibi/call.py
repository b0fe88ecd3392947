"""What a patched ALiBi model's layers know of the call they serve: the padding mask and the packed
documents, taken from the model's own arguments, never from what the model made of them.

transformers' BLOOM, MPT and Falcon turn the 2-D ``attention_mask`` into a 4-D one and then do their own
things with it (Falcon 5.25 adds its ALiBi tensor onto it before any layer runs). A patched model does not
depend on any of that: a forward pre-hook on each base model (``BloomModel``, ``MptModel``,
``FalconModel``) reads ``attention_mask`` and ``position_ids`` from its arguments and pushes an
:class:`AlibiCall` that every patched layer of that forward reads (:func:`call_of`); the registered mask
builder only hands the model a ``[1, 1, 1, 1]`` placeholder, so no ``n x n`` mask is ever formed and
whatever the model adds to it stays ``O(B H n)``.

Gradient checkpointing replays a layer in the backward, after the hook's frame is gone: each layer
remembers the call behind the mask tensor it received (by storage, so the detached copies of reentrant
checkpointing find it too) and a replay finds it there.
"""
from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..masks import documents_from_positions

__all__ = ["AlibiCall", "CALLS", "call_of", "placeholder_mask", "push_call", "pop_call", "row_runs"]


@dataclass
class AlibiCall:
    """One forward of a patched base model: ``valid [B, L]`` bool (the 2-D mask over past and new
    tokens; None: every token real) and ``documents [B, n]`` (packed documents of a prefill, or None)."""

    valid: Optional[Tensor]
    documents: Optional[Tensor]
    _runs: Dict[int, tuple] = field(default_factory=dict, repr=False)

    def valid_for(self, total: int) -> Optional[Tensor]:
        """``valid`` cut to the first ``total`` tokens (the keys a layer holds); one line when too short."""
        if self.valid is None:
            return None
        if self.valid.shape[-1] < total:
            raise ValueError(f"attention_mask: {self.valid.shape[-1]} columns for {total} tokens (past and new); "
                             "pass a mask over every token the model has seen")
        return self.valid[:, :total]

    def runs(self, B: int, total: int) -> List[Optional[Tuple[int, int]]]:
        """:func:`row_runs` of :meth:`valid_for` (once per forward and length: one host sync, not one per layer)."""
        if total not in self._runs:
            self._runs[total] = tuple(row_runs(self.valid_for(total), B, total))
        return list(self._runs[total])


NO_CALL = AlibiCall(None, None)

# The calls of the base-model forwards now running (a stack: a model may call another), and the calls
# behind the mask tensors the layers received (a replay under gradient checkpointing reads these).
CALLS: List[AlibiCall] = []
_SEEN: "OrderedDict[Tuple[int, int], AlibiCall]" = OrderedDict()
_SEEN_MAX = 64


def _mask_key(mask) -> Optional[Tuple[int, int]]:
    if not isinstance(mask, Tensor) or mask.device.type == "meta":
        return None
    return (mask.untyped_storage().data_ptr(), mask.device.index or 0)


def call_of(mask) -> AlibiCall:
    """The call a patched layer serves: the innermost running base-model forward's (remembered under
    ``mask``, the tensor the layer received), or, in a checkpoint replay, the one remembered under it;
    with neither (a layer called on its own), no padding and no documents."""
    key = _mask_key(mask)
    if CALLS:
        call = CALLS[-1]
        if key is not None:
            _SEEN[key] = call
            _SEEN.move_to_end(key)
            while len(_SEEN) > _SEEN_MAX:
                _SEEN.popitem(last=False)
        return call
    if key is not None and key in _SEEN:
        return _SEEN[key]
    return NO_CALL


@functools.lru_cache(maxsize=256)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _bound_arguments(module, args, kwargs) -> dict:
    """The forward's arguments by name (positional ones too), or the keyword ones when they do not bind."""
    try:
        fn = module.forward
        sig = _signature(getattr(fn, "__func__", fn))
        if hasattr(fn, "__func__"):              # a bound method: its signature without ``self``
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
        named = dict(sig.bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)
    for p in sig.parameters.values():           # the **kwargs entry, flattened
        if p.kind is p.VAR_KEYWORD:
            named.update(named.pop(p.name, {}) or {})
    return named


def push_call(module, args, kwargs) -> None:
    """The base model's forward pre-hook: push the :class:`AlibiCall` of this forward."""
    named = _bound_arguments(module, args, kwargs)
    mask = named.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask: a patched ALiBi model takes the 2-D [batch, tokens] padding mask, not "
                             f"a prepared 4-D one (got {shape}); pass the 0/1 mask the tokenizer returns")
        mask = mask.to(torch.bool)
        if bool(mask.all()):
            mask = None
    pos = named.get("position_ids")
    cache = named.get("cache", named.get("past_key_values"))
    docs = None
    if isinstance(pos, Tensor) and pos.dim() == 2 and mask is None and cache is None:
        docs = documents_from_positions(pos, pos.shape[0], pos.shape[-1])
    if docs is None and CALLS and mask is None and cache is None:
        docs = CALLS[-1].documents          # a head model passes position_ids its base model may not take
    CALLS.append(AlibiCall(mask, docs))


def pop_call(module, args, kwargs, output) -> None:
    if CALLS:
        CALLS.pop()


def placeholder_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs) -> Tensor:
    """The mask builder of ``attn_implementation="poslsh_alibi"``: a ``[1, 1, 1, 1]`` zero in the model's
    dtype. The layers read the padding from :func:`call_of`; what the model adds to this stays small."""
    dtype = kwargs.get("dtype") or torch.float32
    if not dtype.is_floating_point:
        dtype = torch.float32
    return torch.zeros(1, 1, 1, 1, dtype=dtype, device=kwargs.get("device"))


def row_runs(valid: Optional[Tensor], B: int, nk: int) -> List[Optional[Tuple[int, int]]]:
    """Each row's run of real tokens ``[start, end)`` (``(0, 0)``: none) from ``valid [B, nk]``; None for a
    row whose real tokens are not one contiguous run (a gap)."""
    if valid is None:
        return [(0, nk)] * B
    if valid.shape != (B, nk):
        raise ValueError(f"attention_mask: shape {tuple(valid.shape)} does not fit {B} rows of {nk} keys")
    idx = torch.arange(nk, device=valid.device)
    count = valid.sum(1)
    start = torch.where(valid, idx, nk).amin(1)
    end = torch.where(valid, idx + 1, 0).amax(1)
    gaps = ((count > 0) & (end - start != count)).tolist()
    return [None if g else ((s, e) if c else (0, 0))
            for s, e, c, g in zip(start.tolist(), end.tolist(), count.tolist(), gaps)]
