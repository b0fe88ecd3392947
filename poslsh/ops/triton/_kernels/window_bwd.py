"""The window op's backward: after ``delta`` (:func:`.common._bwd_pre_kernel`), dk / dv per (key
tile, batch, kv head) over each query head's window of queries, and dq per (query tile, batch,
query head) over the forward's key range; the weights recomputed from the forward's row
statistics, the scores rounded as the forward rounded them (:func:`.window_fwd.window_scores`)."""
import triton
import triton.language as tl

from .common import (head_base, load_stats, load_tile, program_tile, recomputed_p, row_stats, rows_of, store_tile,
                     stream_tile)
from .window_fwd import window_docs, window_range, window_scores


@triton.jit(do_not_specialize=["B", "Hq", "Hkv", "G", "N_KEY"])
def _win_dkdv_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, WIN, SLOPE, ORDER, START, END, DK, DVt,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, sxb,
                     n, B, Hq, Hkv, G, qk_scale, sm_scale, N_KEY,
                     CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, HAS_DOCS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch, kv head): dk, dv summed over the ``G`` query heads of the
    group, each over its own window's query range: no atomics."""
    t = program_tile(tl.program_id(0), n, B, Hkv, ORDER, Hq, P=BLOCK_N)     # keys of kv head t.h
    doc_n = window_docs(START, sxb, t.b, t.offs, n, HAS_DOCS=HAS_DOCS)
    k = load_tile(head_base(K, t.b, t.h, skb, skh), t.offs, skn, n, D, HEAD_DIM)
    v = load_tile(head_base(V, t.b, t.h, svb, svh), t.offs, svn, n, DV, HEAD_DV)
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DV], 0.0, dtype=tl.float32)
    for g in range(G):
        h = t.h * G + g
        w, qlo, qhi = window_range(WIN, START, END, sxb, t.b, h, t.p0, t.plast, n, CAUSAL=CAUSAL, TRANSPOSE=True,
                                   HAS_DOCS=HAS_DOCS)
        slope2 = tl.load(SLOPE + h)
        queries = rows_of(head_base(Q, t.b, h, sqb, sqh), sqn, n, D=D, R=BLOCK_M, HD=HEAD_DIM, USE_TMA=USE_TMA)
        grads = rows_of(head_base(DO, t.b, h, sdb, sdh), sdn, n, D=DV, R=BLOCK_M, HD=HEAD_DV, USE_TMA=USE_TMA)
        st = row_stats(LSE, LSE_LO, DELTA, t.b, h, Hq, n)
        for j in range(0, (tl.maximum(qhi - qlo, 0) + BLOCK_M - 1) // BLOCK_M):
            m0 = qlo + j * BLOCK_M
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q = stream_tile(queries, m0, n, D=D, R=BLOCK_M, HD=HEAD_DIM, USE_TMA=USE_TMA)
            do = stream_tile(grads, m0, n, D=DV, R=BLOCK_M, HD=HEAD_DV, USE_TMA=USE_TMA)
            lse, lse_lo, delta = load_stats(st, offs_m, n)
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)                      # [BLOCK_N, BLOCK_M]
            sT, keep = window_scores(qkT, t.offs, offs_m, w, slope2, qk_scale, n, doc_n,
                                     window_docs(START, sxb, t.b, offs_m, n, HAS_DOCS=HAS_DOCS),
                                     CAUSAL=CAUSAL, HAS_DOCS=HAS_DOCS, TRANSPOSE=True)
            pT = recomputed_p(sT, 1.0, keep, 1.0, lse[None, :], lse_lo[None, :])
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dsT = pT * (dpT - delta[None, :])
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    store_tile(head_base(DK, t.b, t.h, sdkb, sdkh), dk * sm_scale, t.offs, sdkn, n, D, HEAD_DIM)
    store_tile(head_base(DVt, t.b, t.h, sdvb, sdvh), dv, t.offs, sdvn, n, DV, HEAD_DV)


@triton.jit(do_not_specialize=["B", "Hq", "G", "N_KEY"])
def _win_dq_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, WIN, SLOPE, ORDER, START, END, DQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sdqb, sdqh, sdqn, sxb,
                   n, B, Hq, G, qk_scale, sm_scale, N_KEY,
                   CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, HAS_DOCS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head): dq over the forward's key range."""
    t = program_tile(tl.program_id(0), n, B, Hq, ORDER, 0, P=BLOCK_M)
    w, lo, hi = window_range(WIN, START, END, sxb, t.b, t.h, t.p0, t.plast, n, CAUSAL=CAUSAL, TRANSPOSE=False,
                             HAS_DOCS=HAS_DOCS)
    slope2 = tl.load(SLOPE + t.h)
    doc_m = window_docs(START, sxb, t.b, t.offs, n, HAS_DOCS=HAS_DOCS)
    q = load_tile(head_base(Q, t.b, t.h, sqb, sqh), t.offs, sqn, n, D, HEAD_DIM)
    do = load_tile(head_base(DO, t.b, t.h, sdb, sdh), t.offs, sdn, n, DV, HEAD_DV)
    lse, lse_lo, delta = load_stats(row_stats(LSE, LSE_LO, DELTA, t.b, t.h, Hq, n), t.offs, n)
    kvh = t.h // G
    keys = rows_of(head_base(K, t.b, kvh, skb, skh), skn, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
    values = rows_of(head_base(V, t.b, kvh, svb, svh), svn, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    for j in range(0, (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = stream_tile(keys, n0, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
        v = stream_tile(values, n0, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s2, keep = window_scores(qk, t.offs, offs_n, w, slope2, qk_scale, n, doc_m,
                                 window_docs(START, sxb, t.b, offs_n, n, HAS_DOCS=HAS_DOCS),
                                 CAUSAL=CAUSAL, HAS_DOCS=HAS_DOCS, TRANSPOSE=False)
        p = recomputed_p(s2, 1.0, keep, 1.0, lse[:, None], lse_lo[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    store_tile(head_base(DQ, t.b, t.h, sdqb, sdqh), dq * sm_scale, t.offs, sdqn, n, D, HEAD_DIM)
