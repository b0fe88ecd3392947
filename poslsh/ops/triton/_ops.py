"""``torch.library`` custom ops around the Triton kernels.

Positional LSH (the ``"sequence"`` op):

* ``poslsh::triton_attention_fwd(q, k, v, widths, offsets, causal, scale, groups=None,
  doc_start=None, doc_end=None) -> (out, lse, lse_lo)``
* ``poslsh::triton_attention_bwd(dout, q, k, v, out, lse, lse_lo, widths, offsets, causal, scale,
  groups=None, dlse=None, doc_start=None, doc_end=None) -> (dq, dk, dv)``

Exact ALiBi cut at per-head windows (the ``"window"`` op):

* ``poslsh::triton_window_fwd(q, k, v, slopes, window, causal, scale, doc_start=None,
  doc_end=None) -> (out, lse, lse_lo)``
* ``poslsh::triton_window_bwd(dout, q, k, v, out, lse, lse_lo, slopes, window, causal, scale,
  dlse=None, doc_start=None, doc_end=None) -> (dq, dk, dv)``

``lse`` is float32 ``[B, Hq, n]`` in base 2 (``log2 sum_j weight_ij 2^(log2(e) s_ij)``, the
weight ``count_ij``, or ``2^(-log2(e) m_h |i - j|)`` inside the window) and differentiable;
``lse_lo`` (float32, not differentiable) is what rounding ``lse`` to float32 lost: the backward
recomputes the probabilities from both, exactly as the forward normalised them (docs/triton.md,
"Accuracy"). ``doc_start`` / ``doc_end``: packed documents (:class:`poslsh.documents.Documents`).

The ops take the positional objects as tensors (the partitions' float64 widths and offsets,
int64 group ids for grouped partitions; the window's float64 slopes and int64 windows), never a
Python object, and derive everything else inside: the plan (:mod:`._plan`) is one kernel launch,
cached per partitions and shared by forward and backward; no host synchronisation. Each op has a
fake (meta) implementation with the exact output shapes, dtypes and (contiguous) strides, and the
forward ops have autograd formulas that call the backward ops, so ``torch.compile`` traces a model
that uses them without graph breaks, and AOT autograd sees each backward as one opaque op too.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _launch, _window

FWD_NAME = "poslsh::triton_attention_fwd"
BWD_NAME = "poslsh::triton_attention_bwd"
WIN_FWD_NAME = "poslsh::triton_window_fwd"
WIN_BWD_NAME = "poslsh::triton_window_bwd"
LN2 = math.log(2.0)


def _empty(shape, like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _fake_fwd(q, v):
    B, Hq, n, _ = q.shape
    return (_empty((B, Hq, n, v.shape[-1]), q), _empty((B, Hq, n), q, torch.float32),
            _empty((B, Hq, n), q, torch.float32))


def _fake_bwd(q, k, v):
    return _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)


# ---------------------------------------------------------------- positional LSH
@torch.library.custom_op(FWD_NAME, mutates_args=())
def triton_attention_fwd(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, causal: bool,
                         scale: float, groups: Optional[Tensor] = None, doc_start: Optional[Tensor] = None,
                         doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward kernel: ``out [B, Hq, n, dv]`` (q.dtype), ``lse`` and ``lse_lo`` (float32 ``[B, Hq, n]``,
    base 2, of the weights ``count``)."""
    return _launch.forward(q, k, v, widths, offsets, causal, scale, groups=groups, doc_start=doc_start,
                           doc_end=doc_end)


@triton_attention_fwd.register_fake
def _(q, k, v, widths, offsets, causal, scale, groups=None, doc_start=None, doc_end=None):
    return _fake_fwd(q, v)


@torch.library.custom_op(BWD_NAME, mutates_args=())
def triton_attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_lo: Tensor,
                         widths: Tensor, offsets: Tensor, causal: bool, scale: float, groups: Optional[Tensor] = None,
                         dlse: Optional[Tensor] = None, doc_start: Optional[Tensor] = None,
                         doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels: ``dq, dk, dv`` (contiguous, in the dtypes of q, k, v); ``dlse`` the
    gradient of the (base-2) ``lse``, or None."""
    return _launch.backward(dout, q, k, v, out, lse, lse_lo, widths, offsets, causal, scale, groups=groups,
                            dlse=dlse, doc_start=doc_start, doc_end=doc_end)


@triton_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, lse_lo, widths, offsets, causal, scale, groups=None, dlse=None, doc_start=None,
      doc_end=None):
    return _fake_bwd(q, k, v)


# ---------------------------------------------------------------- windowed ALiBi
@torch.library.custom_op(WIN_FWD_NAME, mutates_args=())
def triton_window_fwd(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, window: Tensor, causal: bool, scale: float,
                      doc_start: Optional[Tensor] = None,
                      doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward kernel of exact ALiBi in per-head windows: ``out``, ``lse``, ``lse_lo`` as above."""
    return _window.forward(q, k, v, slopes, window, causal, scale, doc_start=doc_start, doc_end=doc_end)


@triton_window_fwd.register_fake
def _(q, k, v, slopes, window, causal, scale, doc_start=None, doc_end=None):
    return _fake_fwd(q, v)


@torch.library.custom_op(WIN_BWD_NAME, mutates_args=())
def triton_window_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_lo: Tensor,
                      slopes: Tensor, window: Tensor, causal: bool, scale: float, dlse: Optional[Tensor] = None,
                      doc_start: Optional[Tensor] = None,
                      doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward kernels of the window op: ``dq, dk, dv``."""
    return _window.backward(dout, q, k, v, out, lse, lse_lo, slopes, window, causal, scale, dlse=dlse,
                            doc_start=doc_start, doc_end=doc_end)


@triton_window_bwd.register_fake
def _(dout, q, k, v, out, lse, lse_lo, slopes, window, causal, scale, dlse=None, doc_start=None, doc_end=None):
    return _fake_bwd(q, k, v)


# ---------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    q, k, v, pos_a, pos_b, causal, scale, *rest = inputs
    out, lse, lse_lo = output
    ctx.save_for_backward(q, k, v, out, lse, lse_lo, pos_a, pos_b, *rest)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse_lo)
    ctx.set_materialize_grads(False)          # an unused output's gradient stays None


def _grads(ctx, dout, dlse, bwd):
    if torch.is_grad_enabled():   # create_graph=True: the kernels' gradients are not differentiable
        raise RuntimeError("backend='triton' does not support double backward (create_graph=True, gradient "
                           "penalties, Hessian-vector products); use backend='torch' for second-order gradients")
    q, k, v, out, lse, lse_lo, *rest = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return bwd(dout, q, k, v, out, lse, lse_lo, *rest, dlse)


def _backward(ctx, dout, dlse, _dlse_lo):
    def bwd(dout, q, k, v, out, lse, lse_lo, widths, offsets, groups, doc_start, doc_end, dlse):
        return triton_attention_bwd(dout, q, k, v, out, lse, lse_lo, widths, offsets, ctx.causal, ctx.scale, groups,
                                    dlse, doc_start, doc_end)
    return (*_grads(ctx, dout, dlse, bwd), None, None, None, None, None, None, None)


def _window_backward(ctx, dout, dlse, _dlse_lo):
    def bwd(dout, q, k, v, out, lse, lse_lo, slopes, window, doc_start, doc_end, dlse):
        return triton_window_bwd(dout, q, k, v, out, lse, lse_lo, slopes, window, ctx.causal, ctx.scale, dlse,
                                 doc_start, doc_end)
    return (*_grads(ctx, dout, dlse, bwd), None, None, None, None, None, None)


triton_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
triton_window_fwd.register_autograd(_window_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- entry points
def _docs(documents) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    return (None, None) if documents is None else (documents.start, documents.end)


def attention(q: Tensor, k: Tensor, v: Tensor, partitions, *, causal: bool = False, scale: Optional[float] = None,
              return_lse: bool = False, documents=None):
    """Positional-LSH attention with the Triton kernels (the ``"triton"`` backend).

    Same contract as :func:`poslsh.poslsh_attention` with ``backend="triton"``, but without the
    dispatcher's checks and without moving ``partitions``: its ``widths``/``offsets`` must already be
    on ``q.device``. ``documents``: a :class:`poslsh.documents.Documents` (packed rows). Returns ``out``,
    or ``(out, lse)`` with ``return_lse`` (float32 ``[B, Hq, n]``, natural log of
    ``sum_k count_ik e^{s_ik}``, differentiable). Only reads tensors from its arguments, so it traces
    under ``torch.compile(fullgraph=True)``.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, lse, _ = triton_attention_fwd(q, k, v, partitions.widths, partitions.offsets, bool(causal), float(scale),
                                       partitions.groups, *_docs(documents))
    return (out, lse * LN2) if return_lse else out


def window_attention(q: Tensor, k: Tensor, v: Tensor, window, *, causal: bool = False, scale: Optional[float] = None,
                     return_lse: bool = False, documents=None):
    """Exact ALiBi attention cut at per-head windows with the Triton kernels: the contract of
    :func:`poslsh.windowed_alibi_attention` with ``backend="triton"``, ``window`` an
    :class:`poslsh.alibi.AlibiWindow` on ``q.device``. ``lse``: natural log of
    ``sum_{|i-j| <= w_h} e^{s_ij - m_h |i - j|}``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out, lse, _ = triton_window_fwd(q, k, v, window.slopes, window.window, bool(causal), float(scale),
                                    *_docs(documents))
    return (out, lse * LN2) if return_lse else out
