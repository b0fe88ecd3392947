"""Triton kernels for positional-LSH attention (forward, backward).

The estimator is one softmax with the additive bias ``log(count_ik / s)``, where
``count_ik`` is the number of samples in which positions ``i`` and ``k`` share a
block. Blocks are contiguous, so the keys that share a block with *some* row of
a query tile in *some* sample form one contiguous range ``[lo, hi)``::

    lo = min_t start_t(first row),   hi = max_t end_t(last row)

(read from the granule table of :mod:`._plan`). A program owns one query tile
and walks the key tiles of that range only, never all ``n`` keys. Key tiles
start at ``lo`` (not aligned to the tile grid) and come in three runs:

* boundary tiles on the left and right: the weight ``count`` is computed per
  element (see :func:`_count`), masked where ``count == 0`` (and causally);
* *interior* tiles in the middle, inside the block of every row in every
  sample (and fully below the diagonal when causal): ``count == s``
  everywhere, so the tile is plain flash attention, no per-element extra work.

``count`` is computed sample by sample, but a sample only costs per-element work
when it has a block boundary inside *both* the row tile and the column tile:
samples whose blocks cover the whole tile pair add 1 to a row vector, samples
with no shared block are skipped, and samples with a boundary in only one of
the two tiles add a ``[rows]`` or ``[cols]`` vector. This needs the block label
of the tile corners only (4 scalar loads per sample).

Numerics: scores in the log2 domain (``qk_scale = scale * log2(e)``), fp32
accumulators, online softmax. ``lse`` is stored in the log2 domain and
includes the ``1/s`` normalisation: ``lse_i = log2 sum_k (count_ik / s) 2^(qk_ik)``,
so on interior tiles ``p = 2^(qk - lse)`` and on boundary tiles
``p = 2^(qk - lse - log2 s) * count``.

This module is loaded twice at most by :mod:`._launch`: once compiled
(``triton.jit``), once under the interpreter (``TRITON_INTERPRET=1``).
"""
import triton
import triton.language as tl


# Only builtins and functions decorated here are used: Triton's own @jit helpers
# (tl.max, tl.sum, tl.zeros, tl.cdiv) are decorated once, when triton is imported,
# for one mode only, which would pin this module to that mode. Reductions call the
# builtin tl.reduce with Triton's combine functions (what tl.max / tl.sum do; the
# interpreter recognises them and reduces with numpy).
@triton.jit
def _count(IDS, n, r_idx, r0, rlast, c_idx, c0, clast,
           S: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """``count[r, c]`` (fp32 ``[BR, BC]``): samples in which positions ``r_idx[r]``
    and ``c_idx[c]`` share a block. Columns ``>= n`` get a large negative value.

    ``IDS`` points at ``ids[h, 0, 0]``; ``r0``/``rlast`` and ``c0``/``clast`` are
    the first/last valid positions of the row and column tiles (``< n``).
    """
    w = tl.full([BR, BC], 0.0, dtype=tl.float32)
    rc = tl.full([BR], 0.0, dtype=tl.float32)
    cmask = c_idx < n
    rmask = r_idx < n
    cc = tl.where(cmask, 0.0, -1.0e6)
    P = IDS   # labels of sample t at IDS + t * n (advanced by n per sample: 64-bit pointer math)
    for t in tl.static_range(S):
        a0 = tl.load(P + r0)
        a1 = tl.load(P + rlast)
        b0 = tl.load(P + c0)
        b1 = tl.load(P + clast)
        if (a1 >= b0) & (b1 >= a0):          # some row shares a block with some column
            if a0 == a1:                     # all rows in block a0
                if b0 == b1:                 # ... and all columns too: +1 everywhere
                    rc += 1.0
                else:
                    cid = tl.load(P + c_idx, mask=cmask, other=-1)
                    cc += tl.where(cid == a0, 1.0, 0.0)
            else:
                rid = tl.load(P + r_idx, mask=rmask, other=-1)
                if b0 == b1:                 # all columns in block b0
                    rc += tl.where(rid == b0, 1.0, 0.0)
                else:                        # boundaries in both tiles: per element
                    cid = tl.load(P + c_idx, mask=cmask, other=-2)
                    w += tl.where(rid[:, None] == cid[None, :], 1.0, 0.0)
        P += n
    return w + rc[:, None] + cc[None, :]


@triton.jit
def _ranges(GRAN, h, n, n_gran, gran_stride, first, last, S: tl.constexpr, S_PAD: tl.constexpr):
    """For the tile ``[first, last]`` of head ``h``: ``lo, hi`` (union of the blocks of
    its positions over samples) and ``inner_lo, inner_hi`` (intersection of them)."""
    ts = tl.arange(0, S_PAD)
    tm = ts < S
    base = GRAN + (h * S + ts).to(tl.int64) * n_gran
    g0 = first // 16
    g1 = last // 16
    fs = tl.load(base + g0, mask=tm, other=n)
    fe = tl.load(base + gran_stride + g0, mask=tm, other=n)
    ls = tl.load(base + 2 * gran_stride + g1, mask=tm, other=0)
    le = tl.load(base + 3 * gran_stride + g1, mask=tm, other=0)
    lo = tl.reduce(fs, 0, tl.standard._elementwise_min)
    hi = tl.reduce(le, 0, tl.standard._elementwise_max)
    inner_lo = tl.reduce(ls, 0, tl.standard._elementwise_max)
    inner_hi = tl.reduce(fe, 0, tl.standard._elementwise_min)
    return lo, hi, inner_lo, inner_hi


@triton.jit
def _split(lo, hi, inner_lo, inner_hi, BLOCK: tl.constexpr):
    """Tiles ``lo + j * BLOCK`` for ``j < nt`` cover ``[lo, hi)``; ``[ja, jb)`` are the
    ones inside ``[inner_lo, inner_hi)``."""
    nt = (tl.maximum(hi - lo, 0) + BLOCK - 1) // BLOCK
    ja = tl.minimum((tl.maximum(inner_lo - lo, 0) + BLOCK - 1) // BLOCK, nt)
    jb = tl.maximum(tl.minimum(tl.maximum(inner_hi - lo, 0) // BLOCK, nt), ja)
    return nt, ja, jb


@triton.jit
def _load_tile(base, offs_r, stride_r, offs_d, n, D: tl.constexpr, HD: tl.constexpr, MASK_ROWS: tl.constexpr):
    ptrs = base + offs_r.to(tl.int64)[:, None] * stride_r + offs_d[None, :]
    if MASK_ROWS:
        if HD != D:
            x = tl.load(ptrs, mask=(offs_r < n)[:, None] & (offs_d < D)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_r < n)[:, None], other=0.0)
    else:
        if HD != D:
            x = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _stream_tile(src, r0, offs_r, stride_r, offs_d, n, D: tl.constexpr, HD: tl.constexpr,
                 MASK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``r0 + [0, BR)`` of a ``[n, D]`` matrix, zero-padded to ``[BR, HD]``: through a
    TMA tensor descriptor (``src``) when ``USE_TMA``, else by pointers (``src`` = base)."""
    if USE_TMA:
        x = src.load([r0, 0])
    else:
        x = _load_tile(src, offs_r, stride_r, offs_d, n, D, HD, MASK_ROWS)
    return x


# --------------------------------------------------------------------------- plan
@triton.jit
def _ids_kernel(W, C, IDS, n, BLOCK: tl.constexpr):
    """``ids[h, t, u] = floor((u - c) / w) - floor((0 - c) / w)`` (``u`` itself when
    ``w <= 1``): ``_plan.block_ids`` in one pass, with the same float64 operations
    (IEEE division and floor, no fused multiply-add involved), so bit-identical."""
    pid = tl.program_id(0)
    ht = tl.program_id(1)
    w = tl.load(W + ht)
    c = tl.load(C + ht)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    u = offs.to(tl.float64)
    first = tl.floor((0.0 - c) / w)
    lab = tl.floor((u - c) / w) - first
    lab = tl.where(w <= 1.0, u, lab)
    tl.store(IDS + ht.to(tl.int64) * n + offs, lab.to(tl.int32), mask=offs < n)


# --------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDS, n, offs_m, m0, mlast, lo, j_lo, j_hi, split, skip,
               qk_scale, log2S, offs_d, offs_dv,
               S: tl.constexpr, CAUSAL: tl.constexpr, INTERIOR: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
               USE_TMA: tl.constexpr):
    for jj in range(j_lo, j_hi):
        j = jj + tl.where(jj >= split, skip, 0)
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, not INTERIOR, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if INTERIOR:
            qk = qk * qk_scale
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
            p = tl.exp2(qk - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        else:
            nlast = tl.minimum(n0 + BLOCK_N, n) - 1
            w = _count(IDS, n, offs_m, m0, mlast, offs_n, n0, nlast, S, BLOCK_M, BLOCK_N)
            if CAUSAL:
                if nlast > m0:
                    w = tl.where(offs_n[None, :] <= offs_m[:, None], w, 0.0)
            qk = tl.where(w > 0.5, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, tl.standard._elementwise_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - (m_safe + log2S)[:, None]) * w
            alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None]
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, not INTERIOR, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, IDS, GRAN, ORDER, Out, LSE,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                n, n_gran, gran_stride, Hq, G, qk_scale, log2S, N_KEY,
                S: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
                DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = tl.load(ORDER + pid_bh % Hq)
    kvh = h // G
    m0 = pid_m * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)

    lo, hi, inner_lo, inner_hi = _ranges(GRAN, h, n, n_gran, gran_stride, m0, mlast, S, S_PAD)
    if CAUSAL:
        hi = tl.minimum(hi, mlast + 1)
        inner_hi = tl.minimum(inner_hi, m0 + 1)
    nt, ja, jb = _split(lo, hi, inner_lo, inner_hi, BLOCK_N)

    b64 = b.to(tl.int64)
    Qb = Q + b64 * sqb + h.to(tl.int64) * sqh
    Kb = K + b64 * skb + kvh.to(tl.int64) * skh
    Vb = V + b64 * svb + kvh.to(tl.int64) * svh
    if USE_TMA:   # one descriptor per program for the tiles streamed in the loops
        Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
    IDSh = IDS + h.to(tl.int64) * S * n
    q = _load_tile(Qb, offs_m, sqn, offs_d, n, D, HEAD_DIM, True)

    acc = tl.full([BLOCK_M, HEAD_DV], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # boundary tiles [0, ja) and [jb, nt) in one loop, then the interior tiles [ja, jb)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDSh, n, offs_m, m0, mlast, lo,
                               0, ja + nt - jb, ja, jb - ja,
                               qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, False,
                               BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDSh, n, offs_m, m0, mlast, lo,
                               ja, jb, jb, 0,
                               qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, True,
                               BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
    rmask = offs_m < n
    l_safe = tl.where(rmask, l_i, 1.0)
    out = acc / l_safe[:, None]
    Ob = Out + b64 * sob + h.to(tl.int64) * soh
    optrs = Ob + offs_m.to(tl.int64)[:, None] * son + offs_dv[None, :]
    tl.store(optrs, out.to(Out.dtype.element_ty), mask=rmask[:, None] & (offs_dv < DV)[None, :])
    lse = m_i + tl.log2(l_safe)
    tl.store(LSE + (b64 * Hq + h) * n + offs_m, lse, mask=rmask)


# --------------------------------------------------------------------------- backward
@triton.jit
def _bwd_pre_kernel(O, DO, DELTA, sob, soh, son, sdb, sdh, sdn, n, Hq,
                    DV: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK: tl.constexpr):
    """``delta_i = sum_d out_id * dout_id`` (fp32)."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    offs_dv = tl.arange(0, HEAD_DV)
    o = _load_tile(O + b * sob + h * soh, offs, son, offs_dv, n, DV, HEAD_DV, True)
    do = _load_tile(DO + b * sdb + h * sdh, offs, sdn, offs_dv, n, DV, HEAD_DV, True)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, tl.standard._sum_combine)
    tl.store(DELTA + pid_bh.to(tl.int64) * n + offs, delta, mask=offs < n)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELb, sqn, sdn, IDS, n, offs_n, n0, nlast, qlo, j_lo, j_hi, split, skip,
                qk_scale, log2S, offs_d, offs_dv,
                S: tl.constexpr, CAUSAL: tl.constexpr, INTERIOR: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
               USE_TMA: tl.constexpr):
    for jj in range(j_lo, j_hi):
        j = jj + tl.where(jj >= split, skip, 0)
        m0 = qlo + j * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _stream_tile(Qb, m0, offs_m, sqn, offs_d, n, D, HEAD_DIM, not INTERIOR, USE_TMA)
        do = _stream_tile(DOb, m0, offs_m, sdn, offs_dv, n, DV, HEAD_DV, not INTERIOR, USE_TMA)
        if INTERIOR:
            lse = tl.load(LSEb + offs_m)
            delta = tl.load(DELb + offs_m)
        else:
            qmask = offs_m < n
            lse = tl.load(LSEb + offs_m, mask=qmask, other=0.0)
            delta = tl.load(DELb + offs_m, mask=qmask, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale          # [BLOCK_N, BLOCK_M]
        if INTERIOR:
            pT = tl.exp2(qkT - lse[None, :])
        else:
            mlast = tl.minimum(m0 + BLOCK_M, n) - 1
            w = _count(IDS, n, offs_n, n0, nlast, offs_m, m0, mlast, S, BLOCK_N, BLOCK_M)
            if CAUSAL:
                if m0 < nlast:
                    w = tl.where(offs_m[None, :] >= offs_n[:, None], w, 0.0)
            pT = tl.where(w > 0.5, tl.exp2(qkT - (lse + log2S)[None, :]) * w, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, IDS, GRAN, ORDER, DK, DVt,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                     n, n_gran, gran_stride, Hq, Hkv, G, qk_scale, sm_scale, log2S, N_KEY,
                     S: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                     D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
                     DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch, kv head): dk, dv of the tile, summed over
    the ``G`` query heads of the group (each with its own partitions)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hkv
    kvh = tl.load(ORDER + Hq + pid_bh % Hkv)
    n0 = pid_n * BLOCK_N
    nlast = tl.minimum(n0 + BLOCK_N, n) - 1
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    b64 = b.to(tl.int64)
    k = _load_tile(K + b64 * skb + kvh.to(tl.int64) * skh, offs_n, skn, offs_d, n, D, HEAD_DIM, True)
    v = _load_tile(V + b64 * svb + kvh.to(tl.int64) * svh, offs_n, svn, offs_dv, n, DV, HEAD_DV, True)
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DV], 0.0, dtype=tl.float32)
    for g in range(G):
        h = kvh * G + g
        qlo, qhi, inner_lo, inner_hi = _ranges(GRAN, h, n, n_gran, gran_stride, n0, nlast, S, S_PAD)
        if CAUSAL:
            qlo = tl.maximum(qlo, n0)
            inner_lo = tl.maximum(inner_lo, nlast)
        nt, ja, jb = _split(qlo, qhi, inner_lo, inner_hi, BLOCK_M)
        h64 = h.to(tl.int64)
        Qb = Q + b64 * sqb + h64 * sqh
        DOb = DO + b64 * sdb + h64 * sdh
        if USE_TMA:
            Qb = tl.make_tensor_descriptor(Qb, shape=[n, D], strides=[sqn, 1], block_shape=[BLOCK_M, HEAD_DIM])
            DOb = tl.make_tensor_descriptor(DOb, shape=[n, DV], strides=[sdn, 1], block_shape=[BLOCK_M, HEAD_DV])
        LSEb = LSE + (b64 * Hq + h64) * n
        DELb = DELTA + (b64 * Hq + h64) * n
        IDSh = IDS + h64 * S * n
        dk, dv = _dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELb, sqn, sdn, IDSh, n, offs_n, n0, nlast, qlo,
                             0, ja + nt - jb, ja, jb - ja,
                             qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, False,
                             BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELb, sqn, sdn, IDSh, n, offs_n, n0, nlast, qlo,
                             ja, jb, jb, 0,
                             qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, True,
                             BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
    nmask = offs_n < n
    dk = dk * sm_scale
    dkp = DK + b64 * sdkb + kvh.to(tl.int64) * sdkh + offs_n.to(tl.int64)[:, None] * sdkn + offs_d[None, :]
    tl.store(dkp, dk.to(DK.dtype.element_ty), mask=nmask[:, None] & (offs_d < D)[None, :])
    dvp = DVt + b64 * sdvb + kvh.to(tl.int64) * sdvh + offs_n.to(tl.int64)[:, None] * sdvn + offs_dv[None, :]
    tl.store(dvp, dv.to(DVt.dtype.element_ty), mask=nmask[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDS, n, offs_m, m0, mlast, lo, j_lo, j_hi, split, skip,
              qk_scale, log2S, offs_d, offs_dv,
              S: tl.constexpr, CAUSAL: tl.constexpr, INTERIOR: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
              USE_TMA: tl.constexpr):
    for jj in range(j_lo, j_hi):
        j = jj + tl.where(jj >= split, skip, 0)
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, not INTERIOR, USE_TMA)
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, not INTERIOR, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if INTERIOR:
            p = tl.exp2(qk - lse[:, None])
        else:
            nlast = tl.minimum(n0 + BLOCK_N, n) - 1
            w = _count(IDS, n, offs_m, m0, mlast, offs_n, n0, nlast, S, BLOCK_M, BLOCK_N)
            if CAUSAL:
                if nlast > m0:
                    w = tl.where(offs_n[None, :] <= offs_m[:, None], w, 0.0)
            p = tl.where(w > 0.5, tl.exp2(qk - (lse + log2S)[:, None]) * w, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, IDS, GRAN, ORDER, DQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sdqb, sdqh, sdqn,
                   n, n_gran, gran_stride, Hq, G, qk_scale, sm_scale, log2S, N_KEY,
                   S: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                   D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
                   DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head): dq, over the forward's key range."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = tl.load(ORDER + pid_bh % Hq)
    kvh = h // G
    m0 = pid_m * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)

    lo, hi, inner_lo, inner_hi = _ranges(GRAN, h, n, n_gran, gran_stride, m0, mlast, S, S_PAD)
    if CAUSAL:
        hi = tl.minimum(hi, mlast + 1)
        inner_hi = tl.minimum(inner_hi, m0 + 1)
    nt, ja, jb = _split(lo, hi, inner_lo, inner_hi, BLOCK_N)

    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q = _load_tile(Q + b64 * sqb + h64 * sqh, offs_m, sqn, offs_d, n, D, HEAD_DIM, True)
    do = _load_tile(DO + b64 * sdb + h64 * sdh, offs_m, sdn, offs_dv, n, DV, HEAD_DV, True)
    rmask = offs_m < n
    lse = tl.load(LSE + (b64 * Hq + h64) * n + offs_m, mask=rmask, other=0.0)
    delta = tl.load(DELTA + (b64 * Hq + h64) * n + offs_m, mask=rmask, other=0.0)
    Kb = K + b64 * skb + kvh.to(tl.int64) * skh
    Vb = V + b64 * svb + kvh.to(tl.int64) * svh
    if USE_TMA:
        Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
    IDSh = IDS + h64 * S * n
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    dq = _dq_inner(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDSh, n, offs_m, m0, mlast, lo,
                   0, ja + nt - jb, ja, jb - ja,
                   qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, False,
                   BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
    dq = _dq_inner(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDSh, n, offs_m, m0, mlast, lo,
                   ja, jb, jb, 0,
                   qk_scale, log2S, offs_d, offs_dv, S, CAUSAL, True,
                   BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
    dq = dq * sm_scale
    dqp = DQ + b64 * sdqb + h64 * sdqh + offs_m.to(tl.int64)[:, None] * sdqn + offs_d[None, :]
    tl.store(dqp, dq.to(DQ.dtype.element_ty), mask=rmask[:, None] & (offs_d < D)[None, :])
