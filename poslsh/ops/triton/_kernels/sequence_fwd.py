"""Positional LSH's forward (the ``"sequence"`` op): one program per (query tile, batch, query
head) streams the key tiles of its range ``[lo, hi)`` (not aligned to a grid) and accumulates one
softmax with the bias ``log count``: the weights are ``count 2^(qk log2(e) scale - m)``, a key no
sample puts in the query's block weighs 0. Scores in base 2, fp32 accumulators."""
import triton
import triton.language as tl

from .common import NO_SPEC, head_base, load_tile, program_tile, rows_of, softmax_step, store_rows, stream_tile
from .counts import class_R, count_tile, head_counts, row_plan, takes, tile_blocks


@triton.jit(do_not_specialize=NO_SPEC)
def _fwd_kernel(Q, K, V, IDS, GRAN, ORDER, LAT, KSZ, Out, LSE, LSE_LO,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, G, S, NC, qk_scale, N_KEY,
                CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``Out [B, Hq, n, dv]`` and the row statistics ``LSE``, ``LSE_LO`` (fp32 ``[B, Hq, n]``)."""
    t = program_tile(tl.program_id(0), n, B, Hq, ORDER, 0, P=BLOCK_M)
    plan = row_plan(IDS, GRAN, LAT, KSZ, t.b, n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, S, NC,
                    ROW_PLANS=ROW_PLANS)
    lo, hi, R, tr, jr = tile_blocks(plan, t.h, t.p0, t.plast, R_MAX=R_MAX, SC=SC)
    if CAUSAL:
        hi = tl.minimum(hi, t.plast + 1)
    nt = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    if takes(class_R(plan, t.h, t.p0, R, CLASS_TILE=CLASS_TILE, TILE=BLOCK_M, SC=SC, PATH=PATH),
             R_MAX=R_MAX, PATH=PATH):
        kvh = t.h // G
        keys = rows_of(head_base(K, t.b, kvh, skb, skh), skn, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
        values = rows_of(head_base(V, t.b, kvh, svb, svh), svn, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
        q = load_tile(head_base(Q, t.b, t.h, sqb, sqh), t.offs, sqn, n, D, HEAD_DIM)
        cnt = head_counts(plan, t.h, t, R, tr, jr, PATH=PATH, R_MAX=R_MAX, P=BLOCK_M)
        acc = tl.full([BLOCK_M, HEAD_DV], 0.0, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for j in range(0, nt):
            n0 = lo + j * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = stream_tile(keys, n0, n, D=D, R=BLOCK_N, HD=HEAD_DIM, USE_TMA=USE_TMA)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            w = count_tile(cnt, t.offs, offs_n, PATH=PATH, LATTICE=LATTICE)
            if CAUSAL:
                if n0 + BLOCK_N - 1 > t.p0:
                    w = tl.where(offs_n[None, :] <= t.offs[:, None], w, 0.0)
            p, acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, qk_scale, w > 0.5, w)
            v = stream_tile(values, n0, n, D=DV, R=BLOCK_N, HD=HEAD_DV, USE_TMA=USE_TMA)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        store_rows(acc, l_i, m_i, t, Out, sob, soh, son, LSE, LSE_LO, Hq, n, DV=DV, HEAD_DV=HEAD_DV)
