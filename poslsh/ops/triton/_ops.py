"""``torch.library`` custom ops around the Triton kernels.

* ``poslsh::triton_attention_fwd(q, k, v, widths, offsets, causal, scale, groups=None) -> (out, lse)``
* ``poslsh::triton_attention_bwd(dout, q, k, v, out, lse, widths, offsets, causal, scale, groups=None)
  -> (dq, dk, dv)``

Both take the partitions as their ``[H, s]`` tensors (float64 bin widths and
offsets; int64 group ids for grouped partitions, whose label-compare path then
counts a group at a time), never a Python object, and derive everything else inside: the plan
(:mod:`._plan`) is one kernel launch, cached per partitions and shared by forward
and backward; no host synchronisation. Each has a fake (meta) implementation
with the exact output shapes, dtypes and (contiguous) strides, and the forward
op has an autograd formula that calls the backward op, so ``torch.compile``
traces a model that uses them without graph breaks, and AOT autograd sees the
backward as one opaque op too.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _launch

FWD_NAME = "poslsh::triton_attention_fwd"
BWD_NAME = "poslsh::triton_attention_bwd"


def _contiguous_empty(shape, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


@torch.library.custom_op(FWD_NAME, mutates_args=())
def triton_attention_fwd(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor,
                         causal: bool, scale: float, groups: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Forward kernel: ``out [B, Hq, n, dv]`` (q.dtype) and ``lse [B, Hq, n]`` (float32,
    base 2, of the weights ``count / s``)."""
    return _launch.forward(q, k, v, widths, offsets, causal, scale, groups=groups)


@triton_attention_fwd.register_fake
def _(q, k, v, widths, offsets, causal, scale, groups=None):
    B, Hq, n, _ = q.shape
    return (_contiguous_empty((B, Hq, n, v.shape[-1]), q),
            _contiguous_empty((B, Hq, n), q, torch.float32))


@torch.library.custom_op(BWD_NAME, mutates_args=())
def triton_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         widths: Tensor, offsets: Tensor, causal: bool,
                         scale: float, groups: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels: ``dq, dk, dv`` (contiguous, in the dtypes of q, k, v)."""
    return _launch.backward(dout, q, k, v, out, lse, widths, offsets, causal, scale, groups=groups)


@triton_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, widths, offsets, causal, scale, groups=None):
    return (_contiguous_empty(q.shape, q), _contiguous_empty(k.shape, k), _contiguous_empty(v.shape, v))


def _setup_context(ctx, inputs, output):
    q, k, v, widths, offsets, causal, scale, groups = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, widths, offsets, groups)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, widths, offsets, groups = ctx.saved_tensors
    if torch.is_grad_enabled():   # create_graph=True: the kernels' gradients are not differentiable
        raise RuntimeError("poslsh_attention(backend='triton') does not support double backward "
                           "(create_graph=True, gradient penalties, Hessian-vector products); "
                           "use backend='torch' for second-order gradients")
    dq, dk, dv = triton_attention_bwd(dout, q, k, v, out, lse, widths, offsets, ctx.causal, ctx.scale, groups)
    return dq, dk, dv, None, None, None, None, None


triton_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, partitions, *, causal: bool = False,
              scale: Optional[float] = None) -> Tensor:
    """Positional-LSH attention with the Triton kernels (the ``"triton"`` backend).

    Same contract as :func:`poslsh.poslsh_attention` with ``backend="triton"``,
    but without the dispatcher's checks and without moving ``partitions``: its
    ``widths``/``offsets`` must already be on ``q.device``. Only reads tensors
    from ``partitions``, so it traces under ``torch.compile(fullgraph=True)``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, _ = triton_attention_fwd(q, k, v, partitions.widths, partitions.offsets, bool(causal), float(scale),
                                  partitions.groups)
    return out
