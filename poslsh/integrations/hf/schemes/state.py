"""What one attention layer of a converted transformers model keeps between calls.

Every attention module gets one :class:`LayerState` (an attribute outside the module's
parameters and buffers, so it is never saved): its :class:`poslsh.PartitionSchedule` (the one
rule for training and evaluation partitions, see :mod:`poslsh.modules`), the fixed-blocks
partition, the ALiBi window and the dense ALiBi bias of the last shape, each already on the
device of the last call and rebuilt when the model's ``config.poslsh`` changes.

Partitions are per query head, ``sigma_h = 1 / alibi_slope_h`` for the model's number of query
heads (GQA: key/value heads are shared). The schedule's seeds use the default tag ``""``:
``stable_seed("train", seed, step, layer, H, s)`` in training and
``stable_seed("eval", eval_seed, layer, H, s)`` in evaluation (``(sampler, group_size)``
appended for samplers other than i.i.d.), the rule since the integration's first release.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from ....alibi import alibi_bias, alibi_sigmas, alibi_slopes
from ....modules import PartitionSchedule
from ....partitions import Partitions
from ....positional import Positional
from ....window.kind import NO_WINDOW, AlibiWindow, make_window
from ..config import positional_config

__all__ = ["LayerState", "layer_state", "layer_positional", "layer_partitions", "layer_window", "layer_alibi_bias",
           "training_step"]


@dataclass
class LayerState:
    """What one attention layer keeps between calls (one attribute on the module)."""

    schedule: Optional[Tuple[tuple, PartitionSchedule]] = None   # (config key, schedule)
    fixed: Optional[Tuple[tuple, Partitions]] = None             # (key incl. device, fixed blocks)
    window: Optional[Tuple[tuple, AlibiWindow]] = None           # (key incl. device, alibi-window)
    alibi: Optional[Tuple[tuple, Tensor]] = None                 # (shape key, bias [H, nq, nk])


def layer_state(module: nn.Module) -> LayerState:
    state = module.__dict__.get("_poslsh_state")
    if state is None:
        state = LayerState()
        module.__dict__["_poslsh_state"] = state
    return state


def training_step(step) -> Optional[int]:
    """``poslsh_step`` as an int (any integer scalar: int, numpy or 0-d tensor), or None."""
    if step is None:
        return None
    if isinstance(step, bool):
        raise ValueError(f"poslsh_step must be an int >= 0 (the training step), got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise ValueError(f"poslsh_step must be an int >= 0 (the training step), got {type(step).__name__}") from None


def _device(device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def layer_partitions(module: nn.Module, num_heads: int, scheme: str = "poslsh", *, step=None,
                     device=None) -> Partitions:
    """The partitions an attention layer uses now, on ``device`` (default CPU): fresh per
    ``(seed, step, layer)`` in training mode (without ``step``, the layer's own count of training
    calls), fixed per ``(eval_seed, layer)`` in eval mode; ``"fixed_blocks"``: one fixed partition."""
    pc = positional_config(module.config)
    state = layer_state(module)
    device = _device(device)
    if scheme == "fixed_blocks":
        key = (num_heads, pc.block_size, device)
        if state.fixed is None or state.fixed[0] != key:
            state.fixed = (key, Partitions.fixed_blocks(num_heads, pc.block_size).to(device))
        return state.fixed[1]
    layer = int(getattr(module, "layer_idx", 0) or 0)
    key = (num_heads, pc.num_samples, layer, pc.seed, pc.eval_seed, pc.sampler, pc.group_size)
    if state.schedule is None or state.schedule[0] != key:
        schedule = PartitionSchedule(alibi_sigmas(num_heads), pc.num_samples, layer=layer, seed=pc.seed,
                                     eval_seed=pc.eval_seed, sampler=pc.sampler, group_size=pc.group_size)
        if state.schedule is not None:    # a changed config keeps counting the layer's training calls
            schedule.auto_step = state.schedule[1].auto_step
        state.schedule = (key, schedule)
    return state.schedule[1].partitions(module.training, training_step(step), device)


def layer_window(module: nn.Module, num_heads: int, device=None, *, exact: bool = False) -> AlibiWindow:
    """The :class:`~poslsh.AlibiWindow` of an alibi-window layer (``exact``: of an alibi layer, exact
    ALiBi with no window), on ``device``."""
    pc = positional_config(module.config)
    state = layer_state(module)
    device = _device(device)
    key = (exact, num_heads, pc.window_sigmas, pc.window_cost_samples, device)
    if state.window is None or state.window[0] != key:
        win = make_window(alibi_slopes(num_heads), NO_WINDOW) if exact else pc.alibi_window(num_heads)
        state.window = (key, win.to(device))
    return state.window[1]


# What a layer of each scheme attends with (one entry per scheme of SCHEME_RULES; the key is the scheme's
# attn_implementation name, the one word a user gives): partitions, fixed blocks, or the ALiBi window.
_POSITIONAL_OF = {
    "alibi": lambda module, H, step, device: layer_window(module, H, device, exact=True),
    "poslsh": lambda module, H, step, device: layer_partitions(module, H, "poslsh", step=step, device=device),
    "fixed_blocks": lambda module, H, step, device: layer_partitions(module, H, "fixed_blocks", device=device),
    "alibi-window": lambda module, H, step, device: layer_window(module, H, device),
}


def layer_positional(module: nn.Module, scheme: str, num_heads: int, *, step=None, device=None) -> Positional:
    """The positional object a layer of ``scheme`` attends with now: its partitions (``"poslsh"``,
    ``"fixed_blocks"``) or its window (``"alibi-window"``; ``"alibi"``: exact, no window)."""
    return _POSITIONAL_OF[scheme](module, num_heads, step, device)


def layer_alibi_bias(module: nn.Module, num_heads: int, nq: int, nk: int, device,
                     dtype: torch.dtype = torch.float32) -> Tensor:
    """The dense ALiBi bias ``[H, nq, nk]`` of the queries at positions ``[nk - nq, nk)`` (the last ``nq`` of
    ``nk`` keys, a full cache's) against the keys ``[0, nk)``."""
    state = layer_state(module)
    key = (num_heads, nq, nk, str(device), dtype)
    if state.alibi is None or state.alibi[0] != key:
        state.alibi = (key, alibi_bias(nk, alibi_slopes(num_heads), dtype=dtype, device=device, num_queries=nq,
                                       q_start=nk - nq))
    return state.alibi[1]
