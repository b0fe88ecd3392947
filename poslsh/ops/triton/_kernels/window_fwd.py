"""Exact ALiBi cut at a window per head (the ``"window"`` op): what a tile sees, its biased scores,
and the forward.

Head ``h`` keeps the keys with ``|i - j| <= w_h`` (and ``j <= i`` when causal; the query's own
document with packed documents) and adds ``-m_h |i - j|`` to their logits. One range per tile: a
query tile ``[p0, plast]`` attends to keys ``[p0 - w_h, plast + w_h]`` (clipped to the sequence,
the causal diagonal and the tile's documents); the bias comes from positions and the slope in the
kernel: no plan, no count. Numerics as the sequence op's (base 2, fp32, ``lse`` + ``lse_lo``)."""
import triton
import triton.language as tl

from .common import head_base, load_tile, program_tile, rows_of, softmax_step, store_rows, stream_tile


@triton.jit
def window_range(WIN, START, END, sdb, b, h, p0, plast, n, CAUSAL: tl.constexpr, TRANSPOSE: tl.constexpr,
                 HAS_DOCS: tl.constexpr):
    """``w_h`` and the range ``[lo, hi)`` of the other side's positions that tile ``[p0, plast]``
    can meet (query tiles: keys; ``TRANSPOSE``: key tiles, queries)."""
    w = tl.load(WIN + h)
    lo = tl.maximum(p0 - w, 0)
    hi = tl.minimum(plast + w + 1, n)
    if CAUSAL:
        if TRANSPOSE:
            lo = tl.maximum(lo, p0)
        else:
            hi = tl.minimum(hi, plast + 1)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(START + b.to(tl.int64) * sdb + p0))
        hi = tl.minimum(hi, tl.load(END + b.to(tl.int64) * sdb + plast))
    return w, lo, hi


@triton.jit
def window_docs(START, sdb, b, offs, n, HAS_DOCS: tl.constexpr):
    """The document (its start) of positions ``offs``; the positions themselves without documents."""
    if HAS_DOCS:
        d = tl.load(START + b.to(tl.int64) * sdb + offs, mask=offs < n, other=-1)
    else:
        d = offs
    return d


@triton.jit
def window_scores(qk, rows, cols, w, slope2, qk_scale, n, doc_r, doc_c, CAUSAL: tl.constexpr,
                  HAS_DOCS: tl.constexpr, TRANSPOSE: tl.constexpr):
    """Base-2 biased logits of a ``[rows, cols]`` tile, rows queries and columns keys (``TRANSPOSE``:
    the other way round): ``s = qk * qk_scale - slope2 |i - j|`` where the key counts (``keep``),
    ``-inf`` elsewhere; ``doc_r`` / ``doc_c`` the documents of rows and columns. Rounded once here,
    the same way forward and backward, so the backward's weights are the forward's."""
    dist = tl.abs(rows[:, None] - cols[None, :])
    keep = (dist <= w) & (cols < n)[None, :] & (rows < n)[:, None]
    if CAUSAL:
        if TRANSPOSE:
            keep = keep & (rows[:, None] <= cols[None, :])
        else:
            keep = keep & (cols[None, :] <= rows[:, None])
    if HAS_DOCS:
        keep = keep & (doc_r[:, None] == doc_c[None, :])
    return tl.where(keep, qk * qk_scale - slope2 * dist.to(tl.float32), float("-inf")), keep


@triton.jit(do_not_specialize=["B", "Hq", "G", "N_KEY"])
def _win_fwd_kernel(Q, K, V, WIN, SLOPE, ORDER, START, END, Out, LSE, LSE_LO,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sxb,
                    n, B, Hq, G, qk_scale, N_KEY,
                    CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, HAS_DOCS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Out [B, Hq, n, dv]``, ``LSE``, ``LSE_LO``: one program per (query tile, batch, query head)."""
    t = program_tile(tl.program_id(0), n, B, Hq, ORDER, 0, P=BLOCK_M)
    w, lo, hi = window_range(WIN, START, END, sxb, t.b, t.h, t.p0, t.plast, n, CAUSAL=CAUSAL, TRANSPOSE=False,
                             HAS_DOCS=HAS_DOCS)
    slope2 = tl.load(SLOPE + t.h)
    doc_m = window_docs(START, sxb, t.b, t.offs, n, HAS_DOCS=HAS_DOCS)
    kvh = t.h // G
    keys = rows_of(head_base(K, t.b, kvh, skb, skh), skn, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
    values = rows_of(head_base(V, t.b, kvh, svb, svh), svn, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
    q = load_tile(head_base(Q, t.b, t.h, sqb, sqh), t.offs, sqn, n, D, HEAD_DIM)
    acc = tl.full([BLOCK_M, HEAD_DV], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for j in range(0, (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = stream_tile(keys, n0, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s2, keep = window_scores(qk, t.offs, offs_n, w, slope2, qk_scale, n, doc_m,
                                 window_docs(START, sxb, t.b, offs_n, n, HAS_DOCS=HAS_DOCS),
                                 CAUSAL=CAUSAL, HAS_DOCS=HAS_DOCS, TRANSPOSE=False)
        p, acc, l_i, m_i = softmax_step(acc, l_i, m_i, s2, 1.0, keep, 1.0)
        v = stream_tile(values, n0, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    store_rows(acc, l_i, m_i, t, Out, sob, soh, son, LSE, LSE_LO, Hq, n, DV=DV, HEAD_DV=HEAD_DV)
