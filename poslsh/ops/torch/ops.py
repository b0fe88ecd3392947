"""Portable near-linear attention in plain PyTorch (CPU and CUDA): the ``"torch"`` backend of
both 1-D ops, positional LSH (``"sequence"``) and exact ALiBi cut at a window (``"window"``).

The positional-LSH estimator (paper section 4) is
``T~_i = sum_t sum_{k in block_t(i)} e^{s_ik} v_k / sum_t sum_{k in block_t(i)} e^{s_ik}``
= ``sum_k count_ik e^{s_ik} v_k / sum_k count_ik e^{s_ik}``, where ``count_ik`` is
the number of samples in which ``i`` and ``k`` share a block: one softmax with
weights multiplied by ``count`` (bias ``log count``), so every score is computed
once, not once per sample. The window op is the same machinery with one "sample" whose
block for query ``i`` is ``[i - w_h, i + w_h + 1)`` and the bias ``-m_h |i - j|`` inside.

Work is cut into *query tiles* of ``T`` rows of one head (:mod:`.tiles`). The blocks
containing a row are contiguous and their starts/ends are non-decreasing along the
sequence (:mod:`.plan`), so the union of all samples' blocks touching a tile is one
key range ``[lo, hi)``; tiles are grouped by padded range width and each group is a single
batched matmul over all heads and tiles (:mod:`.kernels`). ``count`` for a tile is
built with a difference array: +1 at each row's block start and -1 at its end, then a
cumulative sum, i.e. ``O(s)`` scatters per row plus one pass; rows whose blocks agree in
every sample share one count row, and the causal mask is applied separately. Rows are
owned by exactly one tile, so outputs are written once. Cost: ``O(n d s b)`` time for
positional LSH (``O(n d w)`` for a window ``w``), ``O(n (d + s))`` memory, no ``n x n``.

Queries and keys need not be the same positions (:class:`Span`): query row ``i``
sits at position ``q_start + i`` and key row ``j`` at ``k_start + j`` of a
sequence of ``seq_len`` tokens (decoding against a KV cache, context parallelism);
the keys must cover every key the queries can see, the op checks it. Packed documents
(:mod:`poslsh.documents`): batch rows are grouped by packing, each packing gets its own
row bounds (positions restart per document) and tiles that restart at every document.

Backward is flash-attention 2's with the weighted probabilities, recomputed tile by tile
from the saved ``lse``, through the ``lse`` too (it is a differentiable output). The tiles run
on threads with one intra-op thread each, the key gradients added in one fixed order
(:mod:`.workers`), and so do the few-queries path's groups of heads: identical calls give
bitwise-identical outputs and gradients whatever the thread count. Both
directions of both ops are ``torch.library`` custom ops (below).
"""
from __future__ import annotations

import os
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..._validation import AttnShape, compute_dtype
from ...partitions import Partitions
from ...threads import intra_op_threads
from ..registry import register_backend
from . import band, decode
from .kernels import backward, few_queries_forward, forward
from .plan import Layout, RowBounds, Span, document_row_bounds, row_bounds, \
    window_block_widths, window_row_bounds
from .tiles import TileGroup, choose_tiles, plan_tiles

# Query rows per head up to which one dense pass over each head's key range beats the tile
# plan (decoding steps: the plan's per-group launches cost ~0.5 ms per layer per token).
FEW_QUERIES = 16


class Plan(NamedTuple):
    """What one packing of the batch rows needs: the row bounds, the tiles (None on the
    few-queries path) and the window op's slopes (None for positional LSH)."""

    bounds: RowBounds
    groups: Optional[List[TileGroup]]
    slopes: Optional[Tensor]


def _partition_rows(a: Tensor, b: Tensor, span: Span, layout: Optional[Layout], causal: bool, device):
    """Positional LSH: ``a, b`` = partition widths, offsets ``[H, s]`` (float64)."""
    parts = Partitions(a, b)
    bounds = row_bounds(parts, span, causal, device) if layout is None else \
        document_row_bounds(parts, layout, causal, device)
    return bounds, a, None


def _window_rows(a: Tensor, b: Tensor, span: Span, layout: Optional[Layout], causal: bool, device):
    """The window: ``a, b`` = slopes ``[H]`` (float64), windows ``[H]`` (int64)."""
    return window_row_bounds(b, span, causal, device, layout), window_block_widths(b), a


class OpKernels(NamedTuple):
    """How this backend serves one op, its positional object given as the two tensors ``a, b`` of
    ``positional.tensors()`` (only tensors cross the custom-op boundary)."""

    rows: Callable[..., Tuple[RowBounds, Tensor, Optional[Tensor]]]
    """``(a, b, span, layout, causal, device) -> (row bounds, the widths the tiles are sized by, slopes or
    None)``"""
    band: bool
    """the band kernels serve its calls without packed documents and with more than ``FEW_QUERIES`` queries"""
    few: Optional[Callable[..., Tuple[Tensor, Tensor]]] = None
    """its forward for ``FEW_QUERIES`` queries or fewer without packed documents (None: the general few-queries
    path of :mod:`.kernels`)"""


# Keyed by the positional object's own answer, ``positional.op``.
KERNELS = {"sequence": OpKernels(_partition_rows, band=False),
           "window": OpKernels(_window_rows, band=True, few=decode.forward)}


def make_plan(op: str, a: Tensor, b: Tensor, span: Span, layout: Optional[Layout], causal: bool, device,
              tiles: bool = True) -> Plan:
    """The plan of op ``op`` (``"sequence"`` or ``"window"``; ``a, b`` as :class:`OpKernels` reads them)."""
    bounds, widest, slopes = KERNELS[op].rows(a, b, span, layout, causal, device)
    if not tiles:
        return Plan(bounds, None, slopes)
    n = span.n_q
    segments = None if layout is None else layout.segments()
    return Plan(bounds, plan_tiles(bounds, n, choose_tiles(widest, n), segments), slopes)


def _shape(q: Tensor, k: Tensor, v: Tensor) -> AttnShape:
    B, Hq, n, d = q.shape
    return AttnShape(B, Hq, k.shape[1], n, d, v.shape[-1], k.shape[2])


def _span(q: Tensor, k: Tensor, positions: List[int]) -> Span:
    q_start, k_start, seq_len = positions
    return Span(q_start, k_start, q.shape[2], k.shape[2], seq_len)


def _packings(doc_start: Optional[Tensor], doc_end: Optional[Tensor]) -> List[Tuple[Optional[Tensor], Optional[Layout]]]:
    """Batch rows grouped by how they pack documents: ``[(rows or None = all, layout or None)]``."""
    if doc_start is None:
        return [(None, None)]
    if bool((doc_start == doc_start[:1]).all()):
        return [(None, Layout(doc_start[0], doc_end[0]))]
    distinct, which = torch.unique(doc_start, dim=0, return_inverse=True)
    out = []
    for g in range(distinct.shape[0]):
        rows = torch.nonzero(which == g).flatten()
        out.append((rows, Layout(doc_start[rows[0]], doc_end[rows[0]])))
    return out


def _rows(x: Optional[Tensor], rows: Optional[Tensor]) -> Optional[Tensor]:
    return x if rows is None or x is None else x.index_select(0, rows)


def _unpack(parts: List[Tensor], order: List[Optional[Tensor]]) -> Tensor:
    """Per-packing results back in batch order (differentiable: a concatenation and a gather)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts).index_select(0, torch.argsort(torch.cat(order)))


def _on_band(op: str, doc_start: Optional[Tensor], n: int) -> bool:
    """The band kernels serve this call (an op that has them; no packed documents; more than a few queries)."""
    return KERNELS[op].band and doc_start is None and n > FEW_QUERIES


def run_forward(op: str, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, doc_start: Optional[Tensor],
                doc_end: Optional[Tensor], causal: bool, scale: float, need_lse: bool, positions: List[int],
                few: bool = True) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` and ``lse [B, Hq, n]`` of either op (``few``: allow the few-queries path and
    the band kernels; the tiles alone can be traced by autograd, for double backward)."""
    span = _span(q, k, positions)
    if few and _on_band(op, doc_start, span.n_q):
        return band.forward(q, k, v, a, b, _shape(q, k, v), scale, causal, span.delta, need_lse)
    if few and KERNELS[op].few is not None and doc_start is None and span.n_q <= FEW_QUERIES:
        return KERNELS[op].few(q, k, v, a, b, _shape(q, k, v), scale, causal, span.delta, need_lse)
    outs, lses, order = [], [], []
    for rows, layout in _packings(doc_start, doc_end):
        qs, ks, vs = (_rows(x, rows) for x in (q, k, v))
        shape = _shape(qs, ks, vs)
        dense = few and shape.seqlen <= FEW_QUERIES
        plan = make_plan(op, a, b, span, layout, causal, q.device, tiles=not dense)
        if dense:
            out, lse = few_queries_forward(qs, ks, vs, plan.bounds, shape, scale, plan.slopes)
        else:
            out, lse = forward(qs, ks, vs, plan.groups, plan.bounds, shape, scale, need_lse, plan.slopes)
        outs.append(out), lses.append(lse), order.append(rows)
    return _unpack(outs, order), _unpack(lses, order)


def run_backward(op: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dlse: Optional[Tensor],
                 a: Tensor, b: Tensor, doc_start: Optional[Tensor], doc_end: Optional[Tensor], causal: bool,
                 scale: float, positions: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of either op, by tile-wise recomputation (shapes and dtypes of ``q, k, v``)."""
    span = _span(q, k, positions)
    if _on_band(op, doc_start, span.n_q):
        return band.backward(dout, q, k, v, dlse, a, b, _shape(q, k, v), scale, causal, span.delta)
    grads, order = [], []
    for rows, layout in _packings(doc_start, doc_end):
        qs, ks, vs, dos, ls, dls = (_rows(x, rows) for x in (q, k, v, dout, lse, dlse))
        plan = make_plan(op, a, b, span, layout, causal, q.device)
        grads.append(backward(dos, qs, ks, vs, ls, plan.groups, plan.bounds, _shape(qs, ks, vs), scale, dls,
                              plan.slopes))
        order.append(rows)
    return tuple(_unpack([g[i] for g in grads], order) for i in range(3))


# ------------------------------------------------------------------ custom ops
# Each op is a pair of torch.library custom ops, like the Triton kernels: the positional
# object travels as two tensors (partition widths and offsets, or window slopes and
# sizes), packed documents as their start/end tensors; everything derived from them is
# built inside, so torch.compile(fullgraph=True) sees one opaque op per direction (the
# plan has data-dependent shapes) and autograd saves only tensors.
FWD_NAME = "poslsh::torch_attention_fwd"
BWD_NAME = "poslsh::torch_attention_bwd"
WINDOW_FWD_NAME = "poslsh::torch_window_fwd"
WINDOW_BWD_NAME = "poslsh::torch_window_bwd"


def _define_ops(op: str, fwd_name: str, bwd_name: str):
    """The forward custom op of ``op`` with its backward op and autograd registered."""
    @torch.library.custom_op(fwd_name, mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, doc_start: Optional[Tensor],
            doc_end: Optional[Tensor], causal: bool, scale: float, need_lse: bool,
            positions: List[int]) -> Tuple[Tensor, Tensor]:
        # The kernel picks its own precision (float32/64 accumulation); autocast
        # would turn its matmuls into bf16 and break the float32 buffers.
        with torch.autocast(q.device.type, enabled=False):
            out, lse = run_forward(op, q, k, v, a, b, doc_start, doc_end, causal, scale, need_lse, positions)
        return out.contiguous(), lse.contiguous()

    @fwd.register_fake
    def _(q, k, v, a, b, doc_start, doc_end, causal, scale, need_lse, positions):
        B, Hq, n, _ = q.shape
        return q.new_empty(B, Hq, n, v.shape[-1]), q.new_empty(B, Hq, n, dtype=compute_dtype(q.dtype))

    @torch.library.custom_op(bwd_name, mutates_args=())
    def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dlse: Optional[Tensor], a: Tensor,
            b: Tensor, doc_start: Optional[Tensor], doc_end: Optional[Tensor], causal: bool, scale: float,
            positions: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = run_backward(op, dout.contiguous(), q, k, v, lse, dlse, a, b, doc_start, doc_end,
                                      causal, scale, positions)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @bwd.register_fake
    def _(dout, q, k, v, lse, dlse, a, b, doc_start, doc_end, causal, scale, positions):
        # contiguous, as the real op returns them, whatever the inputs' strides (transposed views)
        return tuple(x.new_empty(x.shape) for x in (q, k, v))

    def setup_context(ctx, inputs, output):
        q, k, v, a, b, doc_start, doc_end, causal, scale, _, positions = inputs
        ctx.save_for_backward(q, k, v, output[1], a, b, doc_start, doc_end)
        ctx.causal, ctx.scale, ctx.positions = causal, scale, list(positions)
        ctx.set_materialize_grads(False)      # an unused output's gradient arrives as None

    def backward_fn(ctx, dout, dlse):
        q, k, v, lse, a, b, doc_start, doc_end = ctx.saved_tensors
        if dout is None:                      # only the lse was used
            dout = q.new_zeros(*q.shape[:-1], v.shape[-1])
        if torch.is_grad_enabled():
            # create_graph=True (gradient penalties, Hessian-vector products): differentiate a
            # recomputation traced by autograd, so the gradients are differentiable in turn.
            # Same tiles, no n x n tensor, but autograd keeps every chunk's scores alive.
            with torch.autocast(q.device.type, enabled=False):
                out, lse_again = run_forward(op, q, k, v, a, b, doc_start, doc_end, ctx.causal, ctx.scale, True,
                                             ctx.positions, few=False)
            outputs, seeds = [out], [dout]
            if dlse is not None:
                outputs.append(lse_again), seeds.append(dlse)
            wanted = [x for x in (q, k, v) if x.requires_grad]
            got = iter(torch.autograd.grad(outputs, wanted, seeds, create_graph=True, allow_unused=True))
            grads = [next(got) if x.requires_grad else None for x in (q, k, v)]
        else:
            args = (dout, q, k, v, lse, dlse, a, b, doc_start, doc_end, ctx.causal, ctx.scale, ctx.positions)
            grads = _maybe_single_thread(bwd, q, args)
        return (*grads, None, None, None, None, None, None, None, None)

    fwd.register_autograd(backward_fn, setup_context=setup_context)
    return fwd, bwd


torch_attention_fwd, torch_attention_bwd = _define_ops("sequence", FWD_NAME, BWD_NAME)
torch_window_fwd, torch_window_bwd = _define_ops("window", WINDOW_FWD_NAME, WINDOW_BWD_NAME)
FORWARD = {"sequence": torch_attention_fwd, "window": torch_window_fwd}     # by ``positional.op``


# On a CPU shared with other work, one intra-op thread for the call. A call is hundreds of
# parallel regions; when the cores are oversubscribed each region's barrier waits for a
# descheduled thread. Measured at n = 16384 (H = 4, s = 10) under 2 x 2 matmul threads on 2
# cores: 1 thread 0.67 s, 2 threads 1.2-1.7 s (quiet: 0.27 s and 0.14 s). Set to False to keep
# torch's thread count always.
SINGLE_THREAD_WHEN_BUSY = True


def cpu_oversubscribed() -> bool:
    """Other work wants the cores: more runnable threads right now than cores plus our own
    (``/proc/loadavg``'s runnable count; the caller and one spinning worker allowed). Off
    Linux, a one-minute load average above the core count."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return int(fields[3].split("/")[0]) > cores + 1
    except (OSError, ValueError, IndexError):     # not Linux: the load average alone
        try:
            return os.getloadavg()[0] > cores + 0.5
        except OSError:
            return False


def _single_thread(q: Tensor) -> bool:
    return (SINGLE_THREAD_WHEN_BUSY and q.device.type == "cpu" and torch.get_num_threads() > 1
            and cpu_oversubscribed())


def _maybe_single_thread(op, q: Tensor, args):
    if not torch.compiler.is_compiling() and _single_thread(q):
        with intra_op_threads(1):
            return op(*args)
    return op(*args)


def attention(q: Tensor, k: Tensor, v: Tensor, positional, shape: AttnShape, causal: bool, scale: float,
              span: Optional[Span] = None, documents=None, return_lse: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Either op on the torch backend: ``(out [B, Hq, n, dv], lse [B, Hq, n] or None)``; the op is the
    one ``positional`` names (``positional.op``: :class:`~poslsh.partitions.Partitions` ``"sequence"``,
    :class:`~poslsh.AlibiWindow` ``"window"``). ``span`` places the queries and keys (default:
    self-attention); ``documents``: :class:`~poslsh.documents.Documents` or None."""
    op = FORWARD.get(positional.op)
    if op is None:
        raise ValueError(f"the torch backend of these ops serves {sorted(FORWARD)}, not op {positional.op!r}")
    span = span or Span.self_attention(shape.seqlen)
    need_lse = return_lse or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    a, b = positional.tensors()       # partition widths, offsets / window slopes, sizes
    doc_start, doc_end = (None, None) if documents is None else (documents.start, documents.end)
    args = (q, k, v, a, b, doc_start, doc_end, bool(causal), float(scale), need_lse,
            [span.q_start, span.k_start, span.seq_len])
    out, lse = _maybe_single_thread(op, q, args)
    return out, (lse if return_lse else None)


def _entry(call):
    """The registry's entry (``backend="torch"``, ops ``"sequence"`` and ``"window"``)."""
    return attention(call.q, call.k, call.v, call.positional, call.shape, call.causal, call.scale, call.span,
                     call.documents, call.return_lse)


FEATURES = ("spans", "documents", "lse")
register_backend("torch", _entry, op="sequence", features=FEATURES, preferred=lambda q: True, priority=0)
register_backend("torch", _entry, op="window", features=FEATURES)
