"""Positional LSH's backward (FlashAttention-2 style, no atomics, deterministic): after
``delta = rowsum(dO * O)`` (:func:`.common._bwd_pre_kernel`), one program per (key tile, batch, kv
head) accumulates dk, dv over the query ranges of the group's heads, and one per (query tile,
batch, query head) accumulates dq over the forward's key range. Both recompute the weights
``p = 2^(fma(qk, c, -lse) - lse_lo) count`` from the forward's row statistics (docs/triton.md,
"Accuracy": why from ``lse_lo`` and ``delta``, and why rows are not renormalised here)."""
import triton
import triton.language as tl

from .common import (NO_SPEC, head_base, load_stats, load_tile, program_tile, recomputed_p, row_stats, rows_of,
                     store_tile, stream_tile)
from .counts import class_R, count_tile, head_counts, row_plan, takes, tile_blocks, tile_R


@triton.jit(do_not_specialize=NO_SPEC)
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, IDS, GRAN, ORDER, LAT, KSZ, DK, DVt,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                     n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, Hkv, G, S, NC, qk_scale, sm_scale, N_KEY,
                     CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                     R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                     CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch, kv head): dk, dv of the tile, summed over the ``G``
    query heads of the group (each with its own partitions): no atomics. With ``PATH`` 1 / 2 a
    program runs when all / not all of its heads take the one-hot count."""
    t = program_tile(tl.program_id(0), n, B, Hkv, ORDER, Hq, P=BLOCK_N)     # keys of kv head t.h
    plan = row_plan(IDS, GRAN, LAT, KSZ, t.b, n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, S, NC,
                    ROW_PLANS=ROW_PLANS)
    Rm = t.p0 * 0
    if PATH != 0:
        c0 = t.p0 // CLASS_TILE * CLASS_TILE      # the class tile (== the program's with the default tiles)
        for g in range(G):
            Rm = tl.maximum(Rm, tile_R(plan, t.h * G + g, c0, tl.minimum(c0 + CLASS_TILE, n) - 1, SC=SC))
    if takes(Rm, R_MAX=R_MAX, PATH=PATH):
        k = load_tile(head_base(K, t.b, t.h, skb, skh), t.offs, skn, n, D, HEAD_DIM)
        v = load_tile(head_base(V, t.b, t.h, svb, svh), t.offs, svn, n, DV, HEAD_DV)
        dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
        dv = tl.full([BLOCK_N, HEAD_DV], 0.0, dtype=tl.float32)
        for g in range(G):
            h = t.h * G + g
            qlo, qhi, R, tr, jr = tile_blocks(plan, h, t.p0, t.plast, R_MAX=R_MAX, SC=SC)
            if CAUSAL:
                qlo = tl.maximum(qlo, t.p0)
            nt = (tl.maximum(qhi - qlo, 0) + BLOCK_M - 1) // BLOCK_M
            queries = rows_of(head_base(Q, t.b, h, sqb, sqh), sqn, n, D=D, R=BLOCK_M, HD=HEAD_DIM, USE_TMA=USE_TMA)
            grads = rows_of(head_base(DO, t.b, h, sdb, sdh), sdn, n, D=DV, R=BLOCK_M, HD=HEAD_DV, USE_TMA=USE_TMA)
            st = row_stats(LSE, LSE_LO, DELTA, t.b, h, Hq, n)
            cnt = head_counts(plan, h, t, R, tr, jr, PATH=PATH, R_MAX=R_MAX, P=BLOCK_N)
            for j in range(0, nt):
                m0 = qlo + j * BLOCK_M
                offs_m = m0 + tl.arange(0, BLOCK_M)
                q = stream_tile(queries, m0, n, D=D, R=BLOCK_M, HD=HEAD_DIM, USE_TMA=USE_TMA)
                do = stream_tile(grads, m0, n, D=DV, R=BLOCK_M, HD=HEAD_DV, USE_TMA=USE_TMA)
                lse, lse_lo, delta = load_stats(st, offs_m, n)
                qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)                     # [BLOCK_N, BLOCK_M]
                w = count_tile(cnt, t.offs, offs_m, PATH=PATH, LATTICE=LATTICE)
                if CAUSAL:
                    if m0 < t.plast:
                        w = tl.where(offs_m[None, :] >= t.offs[:, None], w, 0.0)
                pT = recomputed_p(qkT, qk_scale, w > 0.5, w, lse[None, :], lse_lo[None, :])
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
                dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
                dsT = pT * (dpT - delta[None, :])
                dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
        store_tile(head_base(DK, t.b, t.h, sdkb, sdkh), dk * sm_scale, t.offs, sdkn, n, D, HEAD_DIM)
        store_tile(head_base(DVt, t.b, t.h, sdvb, sdvh), dv, t.offs, sdvn, n, DV, HEAD_DV)


@triton.jit(do_not_specialize=NO_SPEC)
def _bwd_dq_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, IDS, GRAN, ORDER, LAT, KSZ, DQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sdqb, sdqh, sdqn,
                   n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, G, S, NC, qk_scale, sm_scale, N_KEY,
                   CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                   R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                   CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head): dq, over the forward's key range."""
    t = program_tile(tl.program_id(0), n, B, Hq, ORDER, 0, P=BLOCK_M)
    plan = row_plan(IDS, GRAN, LAT, KSZ, t.b, n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, S, NC,
                    ROW_PLANS=ROW_PLANS)
    lo, hi, R, tr, jr = tile_blocks(plan, t.h, t.p0, t.plast, R_MAX=R_MAX, SC=SC)
    if CAUSAL:
        hi = tl.minimum(hi, t.plast + 1)
    nt = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    if takes(class_R(plan, t.h, t.p0, R, CLASS_TILE=CLASS_TILE, TILE=BLOCK_M, SC=SC, PATH=PATH),
             R_MAX=R_MAX, PATH=PATH):
        q = load_tile(head_base(Q, t.b, t.h, sqb, sqh), t.offs, sqn, n, D, HEAD_DIM)
        do = load_tile(head_base(DO, t.b, t.h, sdb, sdh), t.offs, sdn, n, DV, HEAD_DV)
        st = row_stats(LSE, LSE_LO, DELTA, t.b, t.h, Hq, n)
        rmask = t.offs < n
        lse = tl.load(st.lse + t.offs, mask=rmask, other=0.0)
        delta = tl.load(st.delta + t.offs, mask=rmask, other=0.0)
        kvh = t.h // G
        keys = rows_of(head_base(K, t.b, kvh, skb, skh), skn, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
        values = rows_of(head_base(V, t.b, kvh, svb, svh), svn, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
        cnt = head_counts(plan, t.h, t, R, tr, jr, PATH=PATH, R_MAX=R_MAX, P=BLOCK_M)
        dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        for j in range(0, nt):
            n0 = lo + j * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = stream_tile(keys, n0, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
            v = stream_tile(values, n0, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            w = count_tile(cnt, t.offs, offs_n, PATH=PATH, LATTICE=LATTICE)
            if CAUSAL:
                if n0 + BLOCK_N - 1 > t.p0:
                    w = tl.where(offs_n[None, :] <= t.offs[:, None], w, 0.0)
            p = recomputed_p(qk, qk_scale, w > 0.5, w, lse[:, None], 0.0)       # 2^-lse_lo: once, below
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        lse_lo = tl.load(st.lse_lo + t.offs, mask=rmask, other=0.0)          # loaded late: registers
        dq = dq * (sm_scale * tl.exp2(-lse_lo))[:, None]
        store_tile(head_base(DQ, t.b, t.h, sdqb, sdqh), dq, t.offs, sdqn, n, D, HEAD_DIM)
