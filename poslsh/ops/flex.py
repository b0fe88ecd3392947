"""The ``"flex"`` backend: positional LSH and windowed ALiBi through PyTorch's FlexAttention
(:func:`torch.nn.attention.flex_attention.flex_attention`, maintained by PyTorch; on CUDA,
inductor turns it into fused Triton kernels, forward and backward).

* op ``"sequence"``: a ``score_mod`` adds ``log count_ij`` to every score, ``count_ij`` the
  number of samples whose block labels of ``i`` and ``j`` agree (``O(s)`` label loads and
  compares per score; ``log 0 = -inf`` drops the pairs that share no block);
* op ``"window"``: a ``score_mod`` adds ``-m_h |i - j|``, the ``mask_mod`` keeps
  ``|i - j| <= w_h`` (with ``w_h >= n``: exact ALiBi);
* both: a ``BlockMask`` built directly from the geometry. A query tile of
  :data:`BLOCK` rows lists the key blocks meeting the union of its rows' key ranges (the
  rows' blocks, or windows), so no ``n x n`` mask is ever formed and ``create_block_mask``
  is not called; key blocks that every row of the tile attends wholly (below the diagonal,
  inside the window and the document) are *full*: the ``mask_mod`` is skipped there. The
  ``mask_mod`` alone (causal, window, documents) plus the ``-inf`` of the ``score_mod``
  define the result, so flex's unfused eager path (which ignores the block lists) agrees.

The block lists and labels are cached per (partitions, n, device, causal) for the sequence
op and per (slopes, windows, n, device, causal) for the window op (:data:`CACHE`); packed
documents build them on every call. The lse is flex's own (natural log of the sum of
``exp`` of its modified scores), i.e. ``log sum_j count_ij e^{s_ij}`` and
``log sum_{|i-j|<=w} e^{s_ij - m_h |i-j|}``: the library's convention, differentiable.

On CUDA the call runs a ``torch.compile``-d function (compiled once per shape and
configuration; the ``score_mod``, ``mask_mod`` and ``BlockMask`` are built inside it, so new
partitions of the same shape reuse the compiled kernels). Inside a caller's
``torch.compile`` flex is traced by the caller's compile. On CPU the call is compiled too, once
per shape (inductor's CPU kernels, within a few percent of a direct compiled flex call; up to
one block of 128 queries flex's eager path, which does the same work uncompiled), but forward only: FlexAttention has no CPU backward, and a backward through this backend on CPU
raises, naming backend='torch'; with ``return_lse`` it runs flex's eager implementation (dense
scores), since the compiled CPU kernels return no lse. On CPU ``backend="torch"`` is faster and
differentiable; ``"auto"`` picks it.
"""
from __future__ import annotations

import importlib.util
import warnings
import weakref
from collections import OrderedDict
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..partitions import block_bounds, block_labels
from .registry import register_backend

__all__ = ["AVAILABLE", "BLOCK", "CACHE", "why_not", "CPU_NO_BACKWARD"]
# Found without importing it: importing FlexAttention imports torch._dynamo (seconds), paid on
# the first call of this backend only, not by every user of the library.
AVAILABLE = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
flex_attention = BlockMask = noop_mask = AuxRequest = None     # set by _load()
BLOCK = 128                      # FlexAttention's default sparse block (query and key tiles)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Bound on the float64 temporaries of the labels: H * s * chunk elements.
_LABEL_CHUNK_ELEMENTS = 1 << 23
CPU_NO_BACKWARD = (f"backend='flex' has no backward on CPU (FlexAttention's CPU kernels are inference-only in "
                   f"torch {torch.__version__}): train on CPU with backend='torch', or call it under torch.no_grad()")


def _load() -> None:
    """Imports FlexAttention into this module's globals, outside any compiled region (the
    compiled functions read them as globals). ``AuxRequest``: torch >= 2.9 (``return_lse`` is
    deprecated there), None before."""
    global flex_attention, BlockMask, noop_mask, AuxRequest
    if flex_attention is None:
        from torch.nn.attention import flex_attention as fa
        flex_attention, BlockMask, noop_mask = fa.flex_attention, fa.BlockMask, fa.noop_mask
        AuxRequest = getattr(fa, "AuxRequest", None)


class Plan(NamedTuple):
    blocks: Tuple[Optional[Tensor], ...]  # the 8 block-list tensors of a BlockMask, [B|1, H, ...] int32
    data: Optional[Tensor]                # sequence op: block labels int32 [H, s, n] (or [B, H, s, n] with documents)
    doc: Optional[Tensor]                 # int32 [B, n] first token of each token's document, or None


# ------------------------------------------------------------------ block lists
def _block_lists(lo: Tensor, hi: Tensor, flo: Tensor, fhi: Tensor, n: int) -> Tuple[Optional[Tensor], ...]:
    """The BlockMask tensors of a self-attention of ``n`` tokens from, per query tile ``[..., QB]``
    (int64), the key range ``[lo, hi)`` its rows may attend and the range ``[flo, fhi)`` that all
    its rows attend with the ``mask_mod`` true everywhere (both ranges contiguous)."""
    KB = -(-n // BLOCK)
    b_lo, b_hi = lo // BLOCK, -(-hi // BLOCK)
    f_lo = torch.maximum(-(-flo // BLOCK), b_lo)                      # first block starting at or after flo
    f_hi = torch.minimum(torch.where(fhi >= n, torch.full_like(fhi, KB), fhi // BLOCK), b_hi)
    empty = f_lo >= f_hi
    f_lo, f_hi = torch.where(empty, b_hi, f_lo), torch.where(empty, b_hi, f_hi)
    n_a = f_lo - b_lo                                                 # partial blocks before, after the full ones
    j = torch.arange(KB, device=lo.device)
    part = torch.where(j < n_a[..., None], b_lo[..., None] + j, f_hi[..., None] + j - n_a[..., None])
    full = f_lo[..., None] + j
    as_i32 = lambda x: x.clamp(0, KB - 1).to(torch.int32).contiguous()  # noqa: E731  (unused slots: any block)
    _load()
    bm = BlockMask.from_kv_blocks((n_a + b_hi - f_hi).to(torch.int32).contiguous(), as_i32(part),
                                  (f_hi - f_lo).to(torch.int32).contiguous(), as_i32(full),
                                  BLOCK_SIZE=BLOCK, seq_lengths=(n, n))
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, bm.q_num_blocks,
            bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)


def _tile_rows(n: int, device) -> Tuple[Tensor, Tensor]:
    """First and last row of every query tile, int64 ``[QB]``."""
    r0 = torch.arange(0, n, BLOCK, device=device)
    return r0, torch.clamp(r0 + BLOCK - 1, max=n - 1)


def _documents(doc, n: int, device):
    """Per batch row and tile: document start/end at the tile's first and last rows, and whether
    the tile lies in one document (``a0, e0, a1, e1, one`` ``[B, 1, QB]``), or None."""
    if doc is None:
        return None
    r0, r1 = _tile_rows(n, device)
    a0, e0, a1, e1 = (x[:, None, :] for x in (doc.start[:, r0], doc.end[:, r0], doc.start[:, r1], doc.end[:, r1]))
    return a0, e0, a1, e1, a0 == a1


def _full_range(r0, r1, causal, docs, n, lo=None, hi=None):
    """``[flo, fhi)`` (int64) where the ``mask_mod`` holds for every row of each tile."""
    flo = torch.zeros_like(r0) if lo is None else lo
    fhi = torch.full_like(r0, n) if hi is None else hi
    if causal:
        fhi = torch.minimum(fhi, r0 + 1)
    if docs is not None:
        a0, e0, _, _, one = docs
        flo, fhi = torch.maximum(flo, a0), torch.where(one, torch.minimum(fhi, e0), torch.zeros_like(fhi))
    return flo, fhi


def _sequence_plan(parts, n: int, causal: bool, doc, device) -> Plan:
    """Labels and block lists of positional LSH on ``n`` tokens (positions restart in documents)."""
    w, c = parts.widths.to(device), parts.offsets.to(device)
    H, S = w.shape
    r0, r1 = _tile_rows(n, device)
    docs = _documents(doc, n, device)
    if doc is None:
        positions = torch.arange(n, dtype=torch.float64, device=device)[None]                   # [1, n]
        lo = block_bounds(w, c, n, r0)[0].amin(1)[None]                                           # [1, H, QB]
        hi = block_bounds(w, c, n, r1)[1].amax(1)[None]
    else:                              # the tile's first and last rows at their positions in their documents
        positions = doc.positions().to(torch.float64)                                             # [B, n]
        a0, _, a1, e1, _ = docs                                                                   # [B, 1, QB]
        local = lambda r, a: (r - a[:, 0])[:, None, None, :]  # noqa: E731                        [B, 1, 1, QB]
        lo = block_bounds(w, c, n, local(r0, a0))[0].amin(2) + a0                                 # [B, H, QB]
        hi = torch.minimum(block_bounds(w, c, n, local(r1, a1))[1].amax(2), e1 - a1) + a1
    if causal:
        hi = torch.minimum(hi, r1 + 1)
    lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, *_full_range(r0, r1, causal, docs, n))
    labels = torch.empty(positions.shape[0], H, S, n, dtype=torch.int32, device=device)
    chunk = max(1, _LABEL_CHUNK_ELEMENTS // (H * S))
    for row, u in enumerate(positions):
        for a in range(0, n, chunk):
            labels[row, :, :, a:a + chunk] = block_labels(w, c, u[a:a + chunk]).to(torch.int32)
    blocks = _block_lists(lo, hi, flo, fhi, n)
    return Plan(blocks, labels[0] if doc is None else labels, None if doc is None else doc.start.to(torch.int32))


def _window_plan(win, n: int, causal: bool, doc, device) -> Plan:
    """Block lists of ALiBi cut at per-head windows ``|i - j| <= w_h`` on ``n`` tokens."""
    r0, r1 = _tile_rows(n, device)
    w = win.window.to(device).clamp(max=n)[None, :, None]                                         # [1, H, 1]
    docs = _documents(doc, n, device)
    lo, hi = (r0 - w).clamp(min=0), (r1 + w + 1).clamp(max=n)                                     # [1, H, QB]
    if docs is not None:
        lo, hi = torch.maximum(lo, docs[0]), torch.minimum(hi, docs[3])
    if causal:
        hi = torch.minimum(hi, r1 + 1)
    lo, hi, flo, fhi = torch.broadcast_tensors(lo, hi, *_full_range(r0, r1, causal, docs, n, r1 - w, r0 + w + 1))
    return Plan(_block_lists(lo, hi, flo, fhi, n), None, None if doc is None else doc.start.to(torch.int32))


class _PlanCache:
    """At most ``size`` plans, least recently used dropped first; a sequence plan keyed by its
    partitions' tensor objects (and their versions: an in-place change builds a new plan)."""

    def __init__(self, size: int = 4):
        self.size, self._plans = size, OrderedDict()

    def get(self, key, build, owners=()):
        hit = self._plans.get(key)
        if hit is not None and all(ref() is obj for ref, obj in zip(hit[0], owners)):
            self._plans.move_to_end(key)
            return hit[1]
        plan = build()
        self._plans[key] = ([weakref.ref(o) for o in owners], plan)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan

    def clear(self):
        self._plans.clear()


CACHE = _PlanCache()


def _plan_for(call, sequence: bool) -> Plan:
    """The plan of a call of the sequence op (``sequence``) or of the window op."""
    _load()
    n, causal, dev = call.shape.seqlen, call.causal, call.q.device
    if call.documents is not None:     # new tensors every call: nothing to key a cache on
        return (_sequence_plan if sequence else _window_plan)(call.positional, n, causal, call.documents, dev)
    if sequence:
        w, c = call.positional.widths, call.positional.offsets
        key = ("sequence", id(w), w._version, id(c), c._version, n, str(dev), causal)
        return CACHE.get(key, lambda: _sequence_plan(call.positional, n, causal, None, dev), owners=(w, c))
    win = call.positional
    values = tuple(torch.cat([win.slopes.double(), win.window.clamp(max=n).double()]).tolist())
    key = ("window", values, n, str(dev), causal)
    return CACHE.get(key, lambda: _window_plan(win, n, causal, None, dev))


# ------------------------------------------------------------------ the flex calls
def _flex(q, k, v, score_mod, mask_mod, blocks, n, scale, want_lse):
    bm = BlockMask((n, n), *blocks, BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod)
    gqa = q.shape[1] != k.shape[1]
    if not want_lse:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa), None
    if AuxRequest is not None:
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True)


def _mask(causal: bool, doc: Optional[Tensor], window: Optional[Tensor] = None):
    if not causal and doc is None and window is None:
        return noop_mask

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx if causal else q_idx >= 0
        if window is not None:
            keep = keep & ((q_idx - kv_idx).abs() <= window[h])
        if doc is not None:
            keep = keep & (doc[b, q_idx] == doc[b, kv_idx])
        return keep
    return mask_mod


def _poslsh(q, k, v, labels, doc, blocks, n: int, causal: bool, scale: float, want_lse: bool):
    S, batched = labels.shape[-2], labels.dim() == 4

    def score_mod(score, b, h, q_idx, kv_idx):
        count = None
        for t in range(S):                 # unrolled: 2 label loads and a compare per sample
            same = labels[b, h, t, q_idx] == labels[b, h, t, kv_idx] if batched else \
                labels[h, t, q_idx] == labels[h, t, kv_idx]
            count = same.to(score.dtype) if count is None else count + same.to(score.dtype)
        return score + torch.log(count)
    return _flex(q, k, v, score_mod, _mask(causal, doc), blocks, n, scale, want_lse)


def _alibi_window(q, k, v, slopes, window, doc, blocks, n: int, causal: bool, scale: float, want_lse: bool):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs().to(score.dtype)
    return _flex(q, k, v, score_mod, _mask(causal, doc, window), blocks, n, scale, want_lse)


_COMPILED = {}


def _compiled(fn, cpu: bool = False):
    """``fn`` compiled once per shape (on CPU: no dynamic shapes, which flex's CPU kernels run slower)."""
    if (fn, cpu) not in _COMPILED:
        _COMPILED[fn, cpu] = torch.compile(fn, dynamic=False) if cpu else torch.compile(fn)
    return _COMPILED[fn, cpu]


class _NoCpuBackward(torch.autograd.Function):
    """Passes a CPU forward through and raises if anything tries to differentiate it."""

    @staticmethod
    def forward(ctx, x, *inputs):
        return x.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(CPU_NO_BACKWARD)


_EAGER_PLAN = []    # [_plan_for wrapped by torch.compiler.disable], made by the first call (it imports dynamo)


def _run(call, fn, extra, sequence: bool):
    q, k, v = call.q, call.k, call.v
    if not _EAGER_PLAN:
        _EAGER_PLAN.append(torch.compiler.disable(_plan_for))
    # inside a caller's compile the plan is built eagerly: tensor ids, versions and a cache are no graph ops
    plan = _EAGER_PLAN[0](call, sequence) if torch.compiler.is_compiling() else _plan_for(call, sequence)
    args = (*extra(plan), plan.doc, plan.blocks, call.shape.seqlen, call.causal, call.scale, call.return_lse)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if torch.compiler.is_compiling():  # the caller's compile traces flex
        if q.is_cuda:
            return fn(q, k, v, *args)
        if needs_grad:
            raise RuntimeError(CPU_NO_BACKWARD)
        return fn(q.detach(), k.detach(), v.detach(), *args)
    if q.is_cuda:
        return _compiled(fn)(q, k, v, *args)
    # On CPU inductor compiles flex for inference without the lse: with return_lse, flex's eager
    # path (dense scores) gives it. Up to one block of queries the eager path does the compiled
    # kernel's work (one block of scores) without its compilation.
    run = fn if call.return_lse or call.shape.seqlen <= BLOCK else _compiled(fn, cpu=True)
    with warnings.catch_warnings(), torch.no_grad():   # (flex refuses CPU inputs that require grad, even under no_grad)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        out, lse = run(q.detach(), k.detach(), v.detach(), *args)
    if not needs_grad:
        return out, lse
    refuse = lambda x: None if x is None else _NoCpuBackward.apply(x, q, k, v)  # noqa: E731
    return refuse(out), refuse(lse)


def _sequence(call):
    """The registry's entry (``backend="flex"``, op ``"sequence"``)."""
    return _run(call, _poslsh, lambda plan: (plan.data,), sequence=True)


def _window(call):
    """The registry's entry (``backend="flex"``, op ``"window"``)."""
    win = call.positional
    dev = call.q.device
    slopes = win.slopes.to(device=dev, dtype=torch.float32)
    return _run(call, _alibi_window, lambda plan: (slopes, win.window.to(dev)), sequence=False)


def why_not(q: Tensor) -> Optional[str]:
    """None for float16 / bfloat16 / float32 tensors on CUDA (with triton, which inductor
    generates the kernels with) or CPU; otherwise the reason."""
    if q.dtype not in DTYPES:
        return f"it runs float16, bfloat16 and float32 only, not {str(q.dtype).replace('torch.', '')}"
    if q.is_cuda:
        try:
            from torch.utils._triton import has_triton
        except ImportError:            # pragma: no cover
            return None
        return None if has_triton() else "FlexAttention on CUDA needs triton (inductor generates its kernels)"
    if q.device.type == "cpu":
        return None
    return f"FlexAttention runs on CUDA and CPU tensors here, got {q.device}"


if AVAILABLE:
    # Below the fused kernel (priority 10), above the torch backend (0), and for CUDA tensors only:
    # "auto" takes it where the Triton backend cannot serve the call; on CPU "auto" keeps "torch".
    register_backend("flex", _sequence, op="sequence", features=("documents", "lse"), why_not=why_not,
                     preferred=lambda q: q.is_cuda, priority=5)
    register_backend("flex", _window, op="window", features=("documents", "lse"))
