"""Triton kernels for positional-LSH attention (the plan, forward, backward) and for exact
ALiBi cut at per-head windows (forward, backward).

The estimator is one softmax with the additive bias ``log(count_ik / s)``, where
``count_ik`` is the number of samples in which positions ``i`` and ``k`` share a
block. Blocks are contiguous, so the keys that share a block with *some* row of
a query tile in *some* sample form one range ``[lo, hi)``::

    lo = min_t start_t(first row),   hi = max_t end_t(last row)

(read from the granule table of the plan). A program owns one tile of ``P``
positions of one (batch, head) and streams the tiles of the other side that
start at ``lo`` (not aligned to a grid), never all ``n`` positions.

``count`` of a (program tile, streamed tile) pair comes one of two ways, chosen
per program (a uniform branch):

* **one-hot on tensor cores** when the blocks of all samples that touch the
  program tile number ``R <= R_MAX``: with ``Phi[i, r] = [i in block r]`` over
  those ``R`` (sample, block) pairs, ``count = Phi_rows @ Phi_cols^T`` exactly
  (blocks of one sample are disjoint, so each sample adds 1 iff the two
  positions share one of its blocks, and a block that misses the program tile
  cannot be shared with its rows). ``Phi_rows`` is built once per program;
  per streamed tile ``Phi_cols^T`` is ``R_MAX x T`` interval tests and the
  count is one fp16 MMA with ``K = R_MAX`` accumulated in fp32 (0/1 inputs,
  integer sums: exact). No per-element work in ``s``.
* **label compares** otherwise (heads whose blocks are much shorter than the
  tile: every sample cuts every tile): ``count += [label_t(i) == label_t(k)]``
  sample by sample, in a runtime loop (the labels of the next sample are loaded
  while the current one is compared). For grouped partitions (``LATTICE``) the
  loop runs over the ``G`` groups instead: a group of ``k`` shifted grids adds
  ``max(0, k - |index(i) - index(k)|)`` from its lattice indices (``G ~ s / 4``
  steps per score instead of ``s``).

The sample loops are runtime loops over ``S`` (chunks of ``SC`` samples for the
vector parts), so one compiled kernel serves every ``s``.

Numerics: scores in the log2 domain (``qk_scale = scale * log2(e)``), fp32
accumulators, online softmax; ``lse_i = log2 sum_k count_ik 2^(qk_ik)`` rounded to fp32 and
``lse_lo`` what that rounding lost, so the backward's ``p = 2^(fma(qk, c, -lse) - lse_lo) count``
is the forward's (docs/triton.md, "Accuracy"). Packed documents: one plan per batch row
(``ROW_PLANS``). The window op's kernels are at the end.

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
_MIN = tl.standard._elementwise_min
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
# Runtime integer arguments whose value-based specialisation (== 1, % 16 == 0) buys
# nothing: loop bounds, head counts, the autotuning key. One compile serves all values.
_NO_SPEC = ["S", "NC", "N_KEY", "G", "B", "Hq", "Hkv", "n_gran", "gran_stride", "ids_bs", "gran_bs", "lat_bs"]


# --------------------------------------------------------------------------- plan
@triton.jit
def _hash(u, w, c):
    """``floor((u - c) / w)`` in float64: :func:`poslsh.partitions.hash_positions`."""
    return tl.floor((u - c) / w)


@triton.jit
def _bin_start(label, w, c):
    """:func:`poslsh.partitions.bin_start`: the estimate ``ceil(c + label * w)`` is
    within 1 of the answer whether or not the compiler fuses the multiply-add, and
    the two hash tests (no multiply-add in them) fix it exactly."""
    u = tl.ceil(c + label * w)
    u = tl.where(_hash(u - 1.0, w, c) >= label, u - 1.0, u)
    return tl.where(_hash(u, w, c) < label, u + 1.0, u)


@triton.jit(do_not_specialize=["n", "S", "G", "n_blk", "n_gran", "H"])
def _plan_kernel(W, C, IDS, GRAN, ORDER, n, n_gran, H, S, G, n_blk,
                 BLOCK: tl.constexpr, H_PAD: tl.constexpr):
    """The whole plan in one launch, from the ``[H, s]`` float64 widths/offsets with the
    float64 expressions of :mod:`poslsh.partitions`:

    * ``ids[h, t, u]`` int32: ``block_labels`` (``hash(u) - hash(0)``; ``u`` when ``w <= 1``);
    * ``gran[0, h, t, g]`` / ``gran[1, h, t, g]`` int32: ``block_bounds`` start of granule
      ``g``'s first position ``16 g`` and end of its last ``min(16 g + 15, n - 1)``;
    * ``order`` int32 ``[H + H / G]`` (the last program): heads, then kv heads, by
      decreasing ``sum_t min(w, n)``, stable (heaviest programs are launched first).
    """
    pid = tl.program_id(0)
    if pid < H * S * n_blk:
        ht = pid // n_blk
        blk = pid % n_blk
        w = tl.load(W + ht)
        c = tl.load(C + ht)
        single = w <= 1.0
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        u = offs.to(tl.float64)
        lab = tl.where(single, u, _hash(u, w, c) - _hash(0.0 * w, w, c))
        tl.store(IDS + ht.to(tl.int64) * n + offs, lab.to(tl.int32), mask=offs < n)
        NG: tl.constexpr = BLOCK // 16
        g = blk * NG + tl.arange(0, NG)
        nf = n.to(tl.float64)
        uf = (g * 16).to(tl.float64)
        ul = tl.minimum(g * 16 + 15, n - 1).to(tl.float64)
        st = tl.minimum(tl.maximum(_bin_start(_hash(uf, w, c), w, c), 0.0), nf)
        en = tl.minimum(tl.maximum(_bin_start(_hash(ul, w, c) + 1.0, w, c), 0.0), nf)
        st = tl.where(single, uf, st)
        en = tl.where(single, ul + 1.0, en)
        gp = GRAN + ht.to(tl.int64) * n_gran + g
        tl.store(gp, st.to(tl.int32), mask=g < n_gran)
        tl.store(gp + (H * S).to(tl.int64) * n_gran, en.to(tl.int32), mask=g < n_gran)
    else:
        hs = tl.arange(0, H_PAD)
        hm = hs < H
        work = tl.full([H_PAD], 0.0, dtype=tl.float64)
        for t in range(S):
            work += tl.minimum(tl.load(W + hs * S + t, mask=hm, other=0.0), n.to(tl.float64))
        work = tl.where(hm, work, -1.0)
        before = (work[None, :] > work[:, None]) | ((work[None, :] == work[:, None]) & (hs[None, :] < hs[:, None]))
        rank = tl.reduce(tl.where(before & hm[None, :], 1, 0), 1, _SUM)
        tl.store(ORDER + rank, hs, mask=hm)
        Hkv = H // G
        km = hs < Hkv
        kvw = tl.reduce(tl.where((hs[None, :] // G == hs[:, None]) & hm[None, :], work[None, :], 0.0), 1, _SUM)
        kvw = tl.where(km, kvw, -1.0)
        before = (kvw[None, :] > kvw[:, None]) | ((kvw[None, :] == kvw[:, None]) & (hs[None, :] < hs[:, None]))
        rank = tl.reduce(tl.where(before & km[None, :], 1, 0), 1, _SUM)
        tl.store(ORDER + H + rank, hs, mask=km)


# --------------------------------------------------------------------------- counts
@triton.jit
def _tile_blocks(IDS, GRAN, h, n, n_gran, gran_stride, S, p0, plast,
                 R_MAX: tl.constexpr, SC: tl.constexpr):
    """The blocks (all samples) touching positions ``[p0, plast]`` of head ``h``.

    Returns ``lo, hi`` (their union ``[lo, hi)``), ``R`` (how many (sample, block)
    pairs) and, for the first ``R_MAX`` pairs in sample-major order, the sample ``tr``
    of lane ``r`` and the rank ``jr`` of the block among that sample's blocks in the
    tile (:func:`_block_bounds` turns them into ``[start, end)``). Only the plan's
    integers (``ids``, ``gran``) are read: no floating point here.
    """
    rr = tl.arange(0, R_MAX)
    sc = tl.arange(0, SC)
    lo = p0 * 0 + n       # (n may be specialised to a constant: make loop-carried scalars tensors)
    hi = p0 * 0
    R = p0 * 0
    tr = tl.full([R_MAX], 0, dtype=tl.int32)
    jr = tl.full([R_MAX], 0, dtype=tl.int32)
    for t0 in range(0, S, SC):
        ts = t0 + sc
        tm = ts < S
        row = (h * S + ts).to(tl.int64)
        L = tl.load(IDS + row * n + plast, mask=tm, other=-1) - tl.load(IDS + row * n + p0, mask=tm, other=0) + 1
        lo = tl.minimum(lo, tl.reduce(tl.load(GRAN + row * n_gran + p0 // 16, mask=tm, other=n), 0, _MIN))
        hi = tl.maximum(hi, tl.reduce(tl.load(GRAN + gran_stride + row * n_gran + plast // 16, mask=tm, other=0),
                                      0, _MAX))
        excl = R + tl.reduce(tl.where(sc[None, :] < sc[:, None], L[None, :], 0), 1, _SUM)
        hit = (rr[:, None] >= excl[None, :]) & (rr[:, None] < (excl + L)[None, :])     # [R_MAX, SC]
        tr += tl.reduce(tl.where(hit, ts[None, :], 0), 1, _SUM)
        jr += tl.reduce(tl.where(hit, rr[:, None] - excl[None, :], 0), 1, _SUM)
        R += tl.reduce(L, 0, _SUM)
    return lo, hi, R, tr, jr


@triton.jit
def _block_bounds(IDS, GRAN, h, n, n_gran, gran_stride, S, p0, plast, R, tr, jr,
                  R_MAX: tl.constexpr, P: tl.constexpr):
    """``[start, end)`` (int32 vectors of ``R_MAX`` lanes; unused lanes empty) of block
    ``jr`` of sample ``tr`` among the blocks touching ``[p0, plast]``: it starts at the
    first position of the tile with label ``a0 + jr`` (``p0`` + #smaller labels: labels
    are nondecreasing), the first block at ``gran[0]`` (maybe before ``p0``), and the
    last block ends at ``gran[1]`` (maybe after ``plast``)."""
    rr = tl.arange(0, R_MAX)
    valid = rr < R
    row = (h * S + tr).to(tl.int64)
    pp = p0 + tl.arange(0, P)
    labs = tl.load(IDS + row[:, None] * n + pp[None, :], mask=valid[:, None] & (pp <= plast)[None, :],
                   other=2147483647) - jr[:, None]
    a0 = tl.load(IDS + row * n + p0, mask=valid, other=0)
    nb = tl.reduce(tl.where(labs < a0[:, None], 1, 0), 1, _SUM)
    ne = tl.reduce(tl.where(labs <= a0[:, None], 1, 0), 1, _SUM)
    fs = tl.load(GRAN + row * n_gran + p0 // 16, mask=valid & (jr == 0), other=0)
    le = tl.load(GRAN + gran_stride + row * n_gran + plast // 16, mask=valid & (ne > plast - p0), other=0)
    bs = tl.where(valid, tl.where(jr == 0, fs, p0 + nb), 0)
    be = tl.where(valid, tl.where(ne > plast - p0, le, p0 + ne), 0)
    return bs, be


@triton.jit
def _tile_R(IDS, h, n, S, p0, plast, SC: tl.constexpr):
    """How many (sample, block) pairs touch ``[p0, plast]`` (the ``R`` of :func:`_tile_blocks`)."""
    R = p0 * 0
    for t0 in range(0, S, SC):
        ts = t0 + tl.arange(0, SC)
        tm = ts < S
        row = (h * S + ts).to(tl.int64)
        L = tl.load(IDS + row * n + plast, mask=tm, other=-1) - tl.load(IDS + row * n + p0, mask=tm, other=0) + 1
        R += tl.reduce(L, 0, _SUM)
    return R


@triton.jit
def _class_R(IDS, h, n, S, p0, R, CLASS_TILE: tl.constexpr, TILE: tl.constexpr, SC: tl.constexpr,
             PATH: tl.constexpr):
    """The ``R`` that decides which launch runs a program (``PATH`` 1 / 2): that of the
    ``CLASS_TILE`` positions holding its tile of ``TILE`` (the launches may tile differently: the
    one-hot launch and the compare launch are tuned apart), so that every tile is run by exactly
    one launch (the program's own ``R`` is ``<=``). Its own ``R`` when the tiles are the class
    tiles (the default configurations: an extra sample loop costs ~250 B of spills) or with ``PATH`` 0."""
    if PATH != 0:
        if TILE != CLASS_TILE:
            c0 = p0 // CLASS_TILE * CLASS_TILE
            R = _tile_R(IDS, h, n, S, c0, tl.minimum(c0 + CLASS_TILE, n) - 1, SC)
    return R


@triton.jit
def _takes(R, R_MAX: tl.constexpr, PATH: tl.constexpr):
    """Whether a program whose tile has ``R`` blocks runs in a launch of kind ``PATH``:
    0 both (the count is chosen inside), 1 one-hot only (``R <= R_MAX``), 2 compares only."""
    if PATH == 1:
        ok = R <= R_MAX
    elif PATH == 2:
        ok = R > R_MAX
    else:
        ok = R >= 0
    return ok


@triton.jit
def _onehot(pos, bs, be, ROWS: tl.constexpr):
    """fp16 ``[len(pos), R]`` (``ROWS``) or ``[R, len(pos)]``: ``[bs_r <= pos < be_r]``."""
    if ROWS:
        x = (pos[:, None] >= bs[None, :]) & (pos[:, None] < be[None, :])
    else:
        x = (pos[None, :] >= bs[:, None]) & (pos[None, :] < be[:, None])
    return x.to(tl.float16)


@triton.jit
def _count_cmp(LAT, KS, n, NC, r_idx, c_idx, LATTICE: tl.constexpr):
    """``count[r, c]`` (fp32) from ``NC`` rows of labels ``LAT [NC, n]``, one row at a
    time (runtime loop; the next row is loaded before the current one is used).

    * i.i.d. partitions (``LATTICE`` False): ``LAT`` holds each sample's block labels,
      ``count += [label(r) == label(c)]``. Rows and columns ``>= n`` get labels -1 / -2:
      never equal, count 0.
    * grouped partitions (``LATTICE``): ``LAT`` holds each *group's* lattice index
      ``floor((u - origin) / (b / k))``, ``KS`` its size ``k``; a group of ``k`` shifted
      grids puts both positions in one block in ``max(0, k - |index(r) - index(c)|)`` of
      its masks (:func:`poslsh.partitions.group_count`), so a score costs ``G`` steps
      instead of ``s``. Rows and columns ``>= n`` are masked at the end."""
    rmask = r_idx < n
    cmask = c_idx < n
    if LATTICE:
        rid = tl.load(LAT + r_idx, mask=rmask, other=0)
        cid = tl.load(LAT + c_idx, mask=cmask, other=0)
        w = tl.maximum(tl.load(KS) - tl.abs(rid[:, None] - cid[None, :]), 0).to(tl.float32)
        P = LAT
        for t in range(1, NC):
            P += n
            rid = tl.load(P + r_idx, mask=rmask, other=0)
            cid = tl.load(P + c_idx, mask=cmask, other=0)
            w += tl.maximum(tl.load(KS + t) - tl.abs(rid[:, None] - cid[None, :]), 0).to(tl.float32)
        w = tl.where(rmask[:, None] & cmask[None, :], w, 0.0)
    else:
        rid = tl.load(LAT + r_idx, mask=rmask, other=-1)
        cid = tl.load(LAT + c_idx, mask=cmask, other=-2)
        w = tl.where(rid[:, None] == cid[None, :], 1.0, 0.0)
        P = LAT
        for t in range(1, NC):
            P += n
            rid = tl.load(P + r_idx, mask=rmask, other=-1)
            cid = tl.load(P + c_idx, mask=cmask, other=-2)
            w += tl.where(rid[:, None] == cid[None, :], 1.0, 0.0)
    return w


@triton.jit(do_not_specialize=["S", "n_gran", "gran_stride", "n_tiles"])
def _tile_blocks_kernel(IDS, GRAN, LOHI, BLOCKS, n, n_gran, gran_stride, S, n_tiles,
                        R_MAX: tl.constexpr, P: tl.constexpr, SC: tl.constexpr):
    """Writes what :func:`_tile_blocks` finds for tile ``pid % n_tiles`` of head
    ``pid // n_tiles``: ``lohi = (lo, hi, R)`` int32 ``[3]`` and the blocks ``[2, R_MAX]``.
    For tests and the static checks; the attention kernels call ``_tile_blocks`` inline."""
    pid = tl.program_id(0)
    h = pid // n_tiles
    p0 = (pid % n_tiles) * P
    plast = tl.minimum(p0 + P, n) - 1
    lo, hi, R, tr, jr = _tile_blocks(IDS, GRAN, h, n, n_gran, gran_stride, S, p0, plast, R_MAX, SC)
    bs, be = _block_bounds(IDS, GRAN, h, n, n_gran, gran_stride, S, p0, plast, tl.where(R <= R_MAX, R, 0), tr, jr,
                           R_MAX, P)
    tl.store(LOHI + pid * 3, lo)
    tl.store(LOHI + pid * 3 + 1, hi)
    tl.store(LOHI + pid * 3 + 2, R)
    rr = tl.arange(0, R_MAX)
    tl.store(BLOCKS + pid * 2 * R_MAX + rr, bs)
    tl.store(BLOCKS + pid * 2 * R_MAX + R_MAX + rr, be)


# --------------------------------------------------------------------------- loads
@triton.jit
def _load_tile(base, offs_r, stride_r, offs_d, n, D: tl.constexpr, HD: tl.constexpr):
    ptrs = base + offs_r.to(tl.int64)[:, None] * stride_r + offs_d[None, :]
    if HD != D:
        x = tl.load(ptrs, mask=(offs_r < n)[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=(offs_r < n)[:, None], other=0.0)
    return x


@triton.jit
def _stream_tile(src, r0, offs_r, stride_r, offs_d, n, D: tl.constexpr, HD: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``r0 + [0, BR)`` of a ``[n, D]`` matrix, zero-padded to ``[BR, HD]``: through a
    TMA tensor descriptor (``src``) when ``USE_TMA``, else by pointers (``src`` = base)."""
    if USE_TMA:
        x = src.load([r0, 0])
    else:
        x = _load_tile(src, offs_r, stride_r, offs_d, n, D, HD)
    return x


@triton.jit
def _program(pid, n_tiles, B, H, ORDER, ORDER_OFF):
    """1-D grid: program ``pid`` -> (tile, batch, head), heads in ``ORDER`` (heaviest first)."""
    tile = pid % n_tiles
    rest = pid // n_tiles
    b = rest % B
    h = tl.load(ORDER + ORDER_OFF + rest // B)
    return tile, b, h


@triton.jit
def _row_plan(IDS, GRAN, LAT, b, ids_bs, gran_bs, lat_bs):
    """The plan of batch row ``b``: packed documents give every row its own (strides 0: one
    plan for all rows)."""
    b64 = b.to(tl.int64)
    return IDS + b64 * ids_bs, GRAN + b64 * gran_bs, LAT + b64 * lat_bs


# --------------------------------------------------------------------------- forward
@triton.jit
def _fwd_loop(acc, l_i, m_i, q, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, phi_q, bs, be,
              qk_scale, offs_d, offs_dv,
              CAUSAL: tl.constexpr, ONEHOT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
              USE_TMA: tl.constexpr, LATTICE: tl.constexpr):
    for j in range(0, nt):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if ONEHOT:
            w = tl.dot(phi_q, _onehot(offs_n, bs, be, False))
        else:
            w = _count_cmp(CMPh, KSh, n, NC, offs_m, offs_n, LATTICE)
        if CAUSAL:
            if n0 + BLOCK_N - 1 > m0:
                w = tl.where(offs_n[None, :] <= offs_m[:, None], w, 0.0)
        m_new = tl.maximum(m_i, tl.reduce(tl.where(w > 0.5, qk * qk_scale, float("-inf")), 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # one rounding (the fma's), of a small number: the exponent loses nothing to the
        # magnitude of the logits, and the backward recomputes it the same way
        p = tl.where(w > 0.5, tl.exp2(tl.fma(qk, qk_scale, -m_safe[:, None])) * w, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None]
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_onehot(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran, gran_stride, IDSh, S, offs_m, m0,
                mlast, lo, nt, R, tr, jr, qk_scale, offs_d, offs_dv,
                CAUSAL: tl.constexpr, R_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
                DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr):
    bs, be = _block_bounds(IDS, GRAN, h, n, n_gran, gran_stride, S, m0, mlast, R, tr, jr, R_MAX, BLOCK_M)
    phi_q = _onehot(offs_m, bs, be, True)
    return _fwd_loop(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDSh, IDSh, n, S, offs_m, m0, lo, nt, phi_q, bs, be,
                     qk_scale, offs_d, offs_dv, CAUSAL, True, BLOCK_N, D, DV,
                     HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, False)


@triton.jit(do_not_specialize=_NO_SPEC)
def _fwd_kernel(Q, K, V, IDS, GRAN, ORDER, LAT, KSZ, Out, LSE, LSE_LO,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, G, S, NC, qk_scale, N_KEY,
                CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, b, h = _program(tl.program_id(0), (n + BLOCK_M - 1) // BLOCK_M, B, Hq, ORDER, 0)
    if ROW_PLANS:     # constexpr: derived pointers take registers that kernel arguments do not
        IDS, GRAN, LAT = _row_plan(IDS, GRAN, LAT, b, ids_bs, gran_bs, lat_bs)
    kvh = h // G
    m0 = tile * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    lo, hi, R, tr, jr = _tile_blocks(IDS, GRAN, h, n, n_gran, gran_stride, S, m0, mlast, R_MAX, SC)
    if CAUSAL:
        hi = tl.minimum(hi, mlast + 1)
    nt = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N

    if _takes(_class_R(IDS, h, n, S, m0, R, CLASS_TILE, BLOCK_M, SC, PATH), R_MAX, PATH):
        b64 = b.to(tl.int64)
        Qb = Q + b64 * sqb + h.to(tl.int64) * sqh
        Kb = K + b64 * skb + kvh.to(tl.int64) * skh
        Vb = V + b64 * svb + kvh.to(tl.int64) * svh
        if USE_TMA:   # one descriptor per program for the tiles streamed in the loop
            Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
            Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
        IDSh = IDS + h.to(tl.int64) * S * n
        CMPh = LAT + h.to(tl.int64) * NC * n
        KSh = KSZ + h.to(tl.int64) * NC
        q = _load_tile(Qb, offs_m, sqn, offs_d, n, D, HEAD_DIM)
        acc = tl.full([BLOCK_M, HEAD_DV], 0.0, dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        if PATH == 1:
            acc, l_i, m_i = _fwd_onehot(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran, gran_stride,
                                        IDSh, S, offs_m, m0, mlast, lo, nt, R, tr, jr, qk_scale, offs_d, offs_dv,
                                        CAUSAL, R_MAX, BLOCK_M, BLOCK_N, D, DV, HEAD_DIM,
                                        HEAD_DV, DOT_PREC, USE_TMA)
        elif PATH == 2:
            acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, tr, tr, jr,
                                      qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_N, D, DV,
                                      HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, LATTICE)
        else:
            if R <= R_MAX:
                acc, l_i, m_i = _fwd_onehot(acc, l_i, m_i, q, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran,
                                            gran_stride, IDSh, S, offs_m, m0, mlast, lo, nt, R, tr, jr, qk_scale,
                                            offs_d, offs_dv, CAUSAL, R_MAX, BLOCK_M, BLOCK_N, D, DV,
                                            HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
            else:
                acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, tr, tr,
                                          jr, qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_N, D, DV,
                                          HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, LATTICE)
        rmask = offs_m < n
        l_safe = tl.where(rmask, l_i, 1.0)
        out = acc / l_safe[:, None]
        Ob = Out + b64 * sob + h.to(tl.int64) * soh
        optrs = Ob + offs_m.to(tl.int64)[:, None] * son + offs_dv[None, :]
        tl.store(optrs, out.to(Out.dtype.element_ty), mask=rmask[:, None] & (offs_dv < DV)[None, :])
        # lse = m + log2 l rounded to float32, and what that rounding lost (m - lse is exact):
        # the backward recomputes p from both, as the forward normalised it (docs/triton.md)
        l2 = tl.log2(l_safe)
        m_i = tl.where(rmask, m_i, 0.0)
        lse = m_i + l2
        tl.store(LSE + (b64 * Hq + h) * n + offs_m, lse, mask=rmask)
        tl.store(LSE_LO + (b64 * Hq + h) * n + offs_m, (m_i - lse) + l2, mask=rmask)


# --------------------------------------------------------------------------- backward
@triton.jit(do_not_specialize=["n_tiles", "B", "Hq"])
def _bwd_pre_kernel(O, DO, DLSE, DELTA, sob, soh, son, sdb, sdh, sdn, n, n_tiles, B, Hq, dlse_scale,
                    DV: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``delta_i = sum_d out_id * dout_id - dlse_scale * dlse_i`` (fp32; the ``dlse`` term only
    with ``HAS_DLSE``): ``ds = p (dp - delta)`` then includes the gradient through the lse
    (``d lse_i / d s_ij = p_ij``, ``dlse_scale`` converts the lse's base). 1-D grid over
    (tile, batch x head)."""
    pid = tl.program_id(0)
    tile = pid % n_tiles
    bh = pid // n_tiles
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    offs_dv = tl.arange(0, HEAD_DV)
    o = _load_tile(O + b * sob + h * soh, offs, son, offs_dv, n, DV, HEAD_DV)
    do = _load_tile(DO + b * sdb + h * sdh, offs, sdn, offs_dv, n, DV, HEAD_DV)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _SUM)
    if HAS_DLSE:
        delta -= dlse_scale * tl.load(DLSE + bh.to(tl.int64) * n + offs, mask=offs < n, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * n + offs, delta, mask=offs < n)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, CMPh, KSh, n, NC, offs_n, n0, nlast, qlo, nt,
               phi_k, bs, be,
               qk_scale, offs_d, offs_dv,
               CAUSAL: tl.constexpr, ONEHOT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
               DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
               USE_TMA: tl.constexpr, LATTICE: tl.constexpr):
    for j in range(0, nt):
        m0 = qlo + j * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        q = _stream_tile(Qb, m0, offs_m, sqn, offs_d, n, D, HEAD_DIM, USE_TMA)
        do = _stream_tile(DOb, m0, offs_m, sdn, offs_dv, n, DV, HEAD_DV, USE_TMA)
        qmask = offs_m < n
        lse = tl.load(LSEb + offs_m, mask=qmask, other=0.0)
        lse_lo = tl.load(LOb + offs_m, mask=qmask, other=0.0)
        delta = tl.load(DELb + offs_m, mask=qmask, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)                     # [BLOCK_N, BLOCK_M]
        if ONEHOT:
            w = tl.dot(phi_k, _onehot(offs_m, bs, be, False))
        else:
            w = _count_cmp(CMPh, KSh, n, NC, offs_n, offs_m, LATTICE)
        if CAUSAL:
            if m0 < nlast:
                w = tl.where(offs_m[None, :] >= offs_n[:, None], w, 0.0)
        pT = tl.where(w > 0.5, tl.exp2(tl.fma(qkT, qk_scale, -lse[None, :]) - lse_lo[None, :]) * w, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_onehot(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, IDS, GRAN, h, n, n_gran, gran_stride, IDSh, S,
                 offs_n,
                 n0, nlast, qlo, nt, R, tr, jr, qk_scale, offs_d, offs_dv,
                 CAUSAL: tl.constexpr, R_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
                 DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr):
    bs, be = _block_bounds(IDS, GRAN, h, n, n_gran, gran_stride, S, n0, nlast, R, tr, jr, R_MAX, BLOCK_N)
    phi_k = _onehot(offs_n, bs, be, True)
    return _dkdv_loop(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, IDSh, IDSh, n, S, offs_n, n0, nlast, qlo, nt,
                      phi_k, bs, be, qk_scale, offs_d, offs_dv, CAUSAL, True, BLOCK_M, D, DV,
                      HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, False)


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, IDS, GRAN, ORDER, LAT, KSZ, DK, DVt,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
                     sdkb, sdkh, sdkn, sdvb, sdvh, sdvn,
                     n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, Hkv, G, S, NC, qk_scale, sm_scale, N_KEY,
                     CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                     R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                     CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch, kv head): dk, dv of the tile, summed over
    the ``G`` query heads of the group (each with its own partitions): no atomics.
    With ``PATH`` 1 / 2 a program runs when all / not all of its heads take the one-hot count."""
    tile, b, kvh = _program(tl.program_id(0), (n + BLOCK_N - 1) // BLOCK_N, B, Hkv, ORDER, Hq)
    if ROW_PLANS:     # constexpr: derived pointers take registers that kernel arguments do not
        IDS, GRAN, LAT = _row_plan(IDS, GRAN, LAT, b, ids_bs, gran_bs, lat_bs)
    n0 = tile * BLOCK_N
    nlast = tl.minimum(n0 + BLOCK_N, n) - 1
    Rm = n0 * 0
    if PATH != 0:
        c0 = n0 // CLASS_TILE * CLASS_TILE      # the class tile (== the program's with the default tiles)
        for g in range(G):
            Rm = tl.maximum(Rm, _tile_R(IDS, kvh * G + g, n, S, c0, tl.minimum(c0 + CLASS_TILE, n) - 1, SC))
    if _takes(Rm, R_MAX, PATH):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_dv = tl.arange(0, HEAD_DV)
        b64 = b.to(tl.int64)
        k = _load_tile(K + b64 * skb + kvh.to(tl.int64) * skh, offs_n, skn, offs_d, n, D, HEAD_DIM)
        v = _load_tile(V + b64 * svb + kvh.to(tl.int64) * svh, offs_n, svn, offs_dv, n, DV, HEAD_DV)
        dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
        dv = tl.full([BLOCK_N, HEAD_DV], 0.0, dtype=tl.float32)
        for g in range(G):
            h = kvh * G + g
            qlo, qhi, R, tr, jr = _tile_blocks(IDS, GRAN, h, n, n_gran, gran_stride, S, n0, nlast, R_MAX, SC)
            if CAUSAL:
                qlo = tl.maximum(qlo, n0)
            nt = (tl.maximum(qhi - qlo, 0) + BLOCK_M - 1) // BLOCK_M
            h64 = h.to(tl.int64)
            Qb = Q + b64 * sqb + h64 * sqh
            DOb = DO + b64 * sdb + h64 * sdh
            if USE_TMA:
                Qb = tl.make_tensor_descriptor(Qb, shape=[n, D], strides=[sqn, 1], block_shape=[BLOCK_M, HEAD_DIM])
                DOb = tl.make_tensor_descriptor(DOb, shape=[n, DV], strides=[sdn, 1], block_shape=[BLOCK_M, HEAD_DV])
            LSEb = LSE + (b64 * Hq + h64) * n
            LOb = LSE_LO + (b64 * Hq + h64) * n
            DELb = DELTA + (b64 * Hq + h64) * n
            IDSh = IDS + h64 * S * n
            CMPh = LAT + h64 * NC * n
            KSh = KSZ + h64 * NC
            if PATH == 1:
                dk, dv = _dkdv_onehot(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, IDS, GRAN, h, n, n_gran,
                                      gran_stride, IDSh, S, offs_n, n0, nlast, qlo, nt, R, tr, jr, qk_scale, offs_d,
                                      offs_dv, CAUSAL, R_MAX, BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV,
                                      DOT_PREC, USE_TMA)
            elif PATH == 2:
                dk, dv = _dkdv_loop(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, CMPh, KSh, n, NC, offs_n, n0, nlast, qlo,
                                    nt, tr, tr, jr, qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_M, D, DV,
                                    HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, LATTICE)
            else:
                if R <= R_MAX:
                    dk, dv = _dkdv_onehot(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, IDS, GRAN, h, n, n_gran,
                                          gran_stride, IDSh, S, offs_n, n0, nlast, qlo, nt, R, tr, jr, qk_scale,
                                          offs_d, offs_dv, CAUSAL, R_MAX, BLOCK_M, BLOCK_N, D, DV, HEAD_DIM,
                                          HEAD_DV, DOT_PREC, USE_TMA)
                else:
                    dk, dv = _dkdv_loop(dk, dv, k, v, Qb, DOb, LSEb, LOb, DELb, sqn, sdn, CMPh, KSh, n, NC, offs_n, n0, nlast,
                                        qlo, nt, tr, tr, jr, qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_M,
                                        D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA, LATTICE)
        nmask = offs_n < n
        dk = dk * sm_scale
        dkp = DK + b64 * sdkb + kvh.to(tl.int64) * sdkh + offs_n.to(tl.int64)[:, None] * sdkn + offs_d[None, :]
        tl.store(dkp, dk.to(DK.dtype.element_ty), mask=nmask[:, None] & (offs_d < D)[None, :])
        dvp = DVt + b64 * sdvb + kvh.to(tl.int64) * sdvh + offs_n.to(tl.int64)[:, None] * sdvn + offs_dv[None, :]
        tl.store(dvp, dv.to(DVt.dtype.element_ty), mask=nmask[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _dq_loop(dq, q, do, lse, delta, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, phi_q, bs, be,
             qk_scale, offs_d, offs_dv,
             CAUSAL: tl.constexpr, ONEHOT: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
             DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr,
             USE_TMA: tl.constexpr, LATTICE: tl.constexpr):
    for j in range(0, nt):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, USE_TMA)
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if ONEHOT:
            w = tl.dot(phi_q, _onehot(offs_n, bs, be, False))
        else:
            w = _count_cmp(CMPh, KSh, n, NC, offs_m, offs_n, LATTICE)
        if CAUSAL:
            if n0 + BLOCK_N - 1 > m0:
                w = tl.where(offs_n[None, :] <= offs_m[:, None], w, 0.0)
        p = tl.where(w > 0.5, tl.exp2(tl.fma(qk, qk_scale, -lse[:, None])) * w, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_onehot(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran, gran_stride, IDSh, S, offs_m, m0,
               mlast, lo, nt, R, tr, jr, qk_scale, offs_d, offs_dv,
               CAUSAL: tl.constexpr, R_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr,
               DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr):
    bs, be = _block_bounds(IDS, GRAN, h, n, n_gran, gran_stride, S, m0, mlast, R, tr, jr, R_MAX, BLOCK_M)
    phi_q = _onehot(offs_m, bs, be, True)
    return _dq_loop(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDSh, IDSh, n, S, offs_m, m0, lo, nt, phi_q, bs, be,
                    qk_scale, offs_d, offs_dv, CAUSAL, True, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV,
                    DOT_PREC, USE_TMA, False)


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dq_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, IDS, GRAN, ORDER, LAT, KSZ, DQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sdqb, sdqh, sdqn,
                   n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, B, Hq, G, S, NC, qk_scale, sm_scale, N_KEY,
                   CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr,
                   R_MAX: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr, LATTICE: tl.constexpr,
                   CLASS_TILE: tl.constexpr, ROW_PLANS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head): dq, over the forward's key range."""
    tile, b, h = _program(tl.program_id(0), (n + BLOCK_M - 1) // BLOCK_M, B, Hq, ORDER, 0)
    if ROW_PLANS:     # constexpr: derived pointers take registers that kernel arguments do not
        IDS, GRAN, LAT = _row_plan(IDS, GRAN, LAT, b, ids_bs, gran_bs, lat_bs)
    kvh = h // G
    m0 = tile * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    lo, hi, R, tr, jr = _tile_blocks(IDS, GRAN, h, n, n_gran, gran_stride, S, m0, mlast, R_MAX, SC)
    if CAUSAL:
        hi = tl.minimum(hi, mlast + 1)
    nt = (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N

    if _takes(_class_R(IDS, h, n, S, m0, R, CLASS_TILE, BLOCK_M, SC, PATH), R_MAX, PATH):
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        q = _load_tile(Q + b64 * sqb + h64 * sqh, offs_m, sqn, offs_d, n, D, HEAD_DIM)
        do = _load_tile(DO + b64 * sdb + h64 * sdh, offs_m, sdn, offs_dv, n, DV, HEAD_DV)
        rmask = offs_m < n
        lse = tl.load(LSE + (b64 * Hq + h64) * n + offs_m, mask=rmask, other=0.0)
        delta = tl.load(DELTA + (b64 * Hq + h64) * n + offs_m, mask=rmask, other=0.0)
        Kb = K + b64 * skb + kvh.to(tl.int64) * skh
        Vb = V + b64 * svb + kvh.to(tl.int64) * svh
        if USE_TMA:
            Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
            Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
        IDSh = IDS + h64 * S * n
        CMPh = LAT + h64 * NC * n
        KSh = KSZ + h64 * NC
        dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
        if PATH == 1:
            dq = _dq_onehot(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran, gran_stride, IDSh, S,
                            offs_m, m0, mlast, lo, nt, R, tr, jr, qk_scale, offs_d, offs_dv, CAUSAL, R_MAX,
                            BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
        elif PATH == 2:
            dq = _dq_loop(dq, q, do, lse, delta, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, tr, tr, jr,
                          qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV,
                          DOT_PREC, USE_TMA, LATTICE)
        else:
            if R <= R_MAX:
                dq = _dq_onehot(dq, q, do, lse, delta, Kb, Vb, skn, svn, IDS, GRAN, h, n, n_gran, gran_stride, IDSh,
                                S, offs_m, m0, mlast, lo, nt, R, tr, jr, qk_scale, offs_d, offs_dv, CAUSAL,
                                R_MAX, BLOCK_M, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV, DOT_PREC, USE_TMA)
            else:
                dq = _dq_loop(dq, q, do, lse, delta, Kb, Vb, skn, svn, CMPh, KSh, n, NC, offs_m, m0, lo, nt, tr, tr, jr,
                              qk_scale, offs_d, offs_dv, CAUSAL, False, BLOCK_N, D, DV, HEAD_DIM, HEAD_DV,
                              DOT_PREC, USE_TMA, LATTICE)
        # p = 2^(fma(qk, c, -lse) - lse_lo) count: the row factor 2^-lse_lo applied once, here
        lse_lo = tl.load(LSE_LO + (b64 * Hq + h64) * n + offs_m, mask=rmask, other=0.0)   # loaded late: registers
        dq = dq * (sm_scale * tl.exp2(-lse_lo))[:, None]
        dqp = DQ + b64 * sdqb + h64 * sdqh + offs_m.to(tl.int64)[:, None] * sdqn + offs_d[None, :]
        tl.store(dqp, dq.to(DQ.dtype.element_ty), mask=rmask[:, None] & (offs_d < D)[None, :])


# --------------------------------------------------------------------------- windowed ALiBi
# Exact ALiBi cut at a window per head: head h keeps the keys with |i - j| <= w_h (and j <= i when
# causal; the query's own document with packed documents) and adds -m_h |i - j| to their logits.
# One range per tile: a query tile [m0, mlast] attends to keys [m0 - w_h, mlast + w_h] (clipped to
# the sequence, the causal diagonal and the tile's documents), the bias comes from positions and the
# slope in the kernel: no plan, no count. Numerics as above (base 2, fp32, lse + lse_lo).
@triton.jit
def _win_range(WIN, START, END, sdb, b, h, p0, plast, n, CAUSAL: tl.constexpr, TRANSPOSE: tl.constexpr,
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
def _win_scores(qk, rows, cols, w, slope2, qk_scale, n, DOCr, DOCc, CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
                TRANSPOSE: tl.constexpr):
    """Base-2 biased logits of a ``[rows, cols]`` tile, rows queries and columns keys (``TRANSPOSE``:
    the other way round): ``qk * qk_scale - slope2 |i - j|`` where the key counts, ``-inf``
    elsewhere. ``DOCr``/``DOCc``: the document starts of rows and columns (``HAS_DOCS``)."""
    dist = tl.abs(rows[:, None] - cols[None, :])
    keep = (dist <= w) & (cols < n)[None, :] & (rows < n)[:, None]
    if CAUSAL:
        if TRANSPOSE:
            keep = keep & (rows[:, None] <= cols[None, :])
        else:
            keep = keep & (cols[None, :] <= rows[:, None])
    if HAS_DOCS:
        keep = keep & (DOCr[:, None] == DOCc[None, :])
    return tl.where(keep, qk * qk_scale - slope2 * dist.to(tl.float32), float("-inf"))


@triton.jit
def _win_docs(START, sdb, b, offs, n, HAS_DOCS: tl.constexpr):
    if HAS_DOCS:
        d = tl.load(START + b.to(tl.int64) * sdb + offs, mask=offs < n, other=-1)
    else:
        d = offs
    return d


@triton.jit(do_not_specialize=["B", "Hq", "G", "N_KEY"])
def _win_fwd_kernel(Q, K, V, WIN, SLOPE, ORDER, START, END, Out, LSE, LSE_LO,
                    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sxb,
                    n, B, Hq, G, qk_scale, N_KEY,
                    CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, HAS_DOCS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, b, h = _program(tl.program_id(0), (n + BLOCK_M - 1) // BLOCK_M, B, Hq, ORDER, 0)
    kvh = h // G
    m0 = tile * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    w, lo, hi = _win_range(WIN, START, END, sxb, b, h, m0, mlast, n, CAUSAL, False, HAS_DOCS)
    slope2 = tl.load(SLOPE + h)
    doc_m = _win_docs(START, sxb, b, offs_m, n, HAS_DOCS)
    b64 = b.to(tl.int64)
    Kb = K + b64 * skb + kvh.to(tl.int64) * skh
    Vb = V + b64 * svb + kvh.to(tl.int64) * svh
    if USE_TMA:
        Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
    q = _load_tile(Q + b64 * sqb + h.to(tl.int64) * sqh, offs_m, sqn, offs_d, n, D, HEAD_DIM)
    acc = tl.full([BLOCK_M, HEAD_DV], 0.0, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for j in range(0, (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s2 = _win_scores(qk, offs_m, offs_n, w, slope2, qk_scale, n, doc_m,
                         _win_docs(START, sxb, b, offs_n, n, HAS_DOCS),
                         CAUSAL, HAS_DOCS, False)
        m_new = tl.maximum(m_i, tl.reduce(s2, 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s2 - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None]
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    rmask = offs_m < n
    l_safe = tl.where(rmask, l_i, 1.0)
    out = acc / l_safe[:, None]
    optrs = Out + b64 * sob + h.to(tl.int64) * soh + offs_m.to(tl.int64)[:, None] * son + offs_dv[None, :]
    tl.store(optrs, out.to(Out.dtype.element_ty), mask=rmask[:, None] & (offs_dv < DV)[None, :])
    l2 = tl.log2(l_safe)
    m_i = tl.where(rmask, m_i, 0.0)
    lse = m_i + l2
    tl.store(LSE + (b64 * Hq + h) * n + offs_m, lse, mask=rmask)
    tl.store(LSE_LO + (b64 * Hq + h) * n + offs_m, (m_i - lse) + l2, mask=rmask)


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
    tile, b, kvh = _program(tl.program_id(0), (n + BLOCK_N - 1) // BLOCK_N, B, Hkv, ORDER, Hq)
    n0 = tile * BLOCK_N
    nlast = tl.minimum(n0 + BLOCK_N, n) - 1
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    b64 = b.to(tl.int64)
    doc_n = _win_docs(START, sxb, b, offs_n, n, HAS_DOCS)
    k = _load_tile(K + b64 * skb + kvh.to(tl.int64) * skh, offs_n, skn, offs_d, n, D, HEAD_DIM)
    v = _load_tile(V + b64 * svb + kvh.to(tl.int64) * svh, offs_n, svn, offs_dv, n, DV, HEAD_DV)
    dk = tl.full([BLOCK_N, HEAD_DIM], 0.0, dtype=tl.float32)
    dv = tl.full([BLOCK_N, HEAD_DV], 0.0, dtype=tl.float32)
    for g in range(G):
        h = kvh * G + g
        w, qlo, qhi = _win_range(WIN, START, END, sxb, b, h, n0, nlast, n, CAUSAL, True, HAS_DOCS)
        slope2 = tl.load(SLOPE + h)
        h64 = h.to(tl.int64)
        Qb = Q + b64 * sqb + h64 * sqh
        DOb = DO + b64 * sdb + h64 * sdh
        if USE_TMA:
            Qb = tl.make_tensor_descriptor(Qb, shape=[n, D], strides=[sqn, 1], block_shape=[BLOCK_M, HEAD_DIM])
            DOb = tl.make_tensor_descriptor(DOb, shape=[n, DV], strides=[sdn, 1], block_shape=[BLOCK_M, HEAD_DV])
        row = (b64 * Hq + h64) * n
        for j in range(0, (tl.maximum(qhi - qlo, 0) + BLOCK_M - 1) // BLOCK_M):
            m0 = qlo + j * BLOCK_M
            offs_m = m0 + tl.arange(0, BLOCK_M)
            qmask = offs_m < n
            q = _stream_tile(Qb, m0, offs_m, sqn, offs_d, n, D, HEAD_DIM, USE_TMA)
            do = _stream_tile(DOb, m0, offs_m, sdn, offs_dv, n, DV, HEAD_DV, USE_TMA)
            lse = tl.load(LSE + row + offs_m, mask=qmask, other=0.0)
            lse_lo = tl.load(LSE_LO + row + offs_m, mask=qmask, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=qmask, other=0.0)
            qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)                      # [BLOCK_N, BLOCK_M]
            sT = _win_scores(qkT, offs_n, offs_m, w, slope2, qk_scale, n, doc_n,
                             _win_docs(START, sxb, b, offs_m, n, HAS_DOCS), CAUSAL, HAS_DOCS, True)
            pT = tl.exp2((sT - lse[None, :]) - lse_lo[None, :])
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            dsT = pT * (dpT - delta[None, :])
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    nmask = offs_n < n
    dk = dk * sm_scale
    dkp = DK + b64 * sdkb + kvh.to(tl.int64) * sdkh + offs_n.to(tl.int64)[:, None] * sdkn + offs_d[None, :]
    tl.store(dkp, dk.to(DK.dtype.element_ty), mask=nmask[:, None] & (offs_d < D)[None, :])
    dvp = DVt + b64 * sdvb + kvh.to(tl.int64) * sdvh + offs_n.to(tl.int64)[:, None] * sdvn + offs_dv[None, :]
    tl.store(dvp, dv.to(DVt.dtype.element_ty), mask=nmask[:, None] & (offs_dv < DV)[None, :])


@triton.jit(do_not_specialize=["B", "Hq", "G", "N_KEY"])
def _win_dq_kernel(Q, K, V, DO, LSE, LSE_LO, DELTA, WIN, SLOPE, ORDER, START, END, DQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, sdqb, sdqh, sdqn, sxb,
                   n, B, Hq, G, qk_scale, sm_scale, N_KEY,
                   CAUSAL: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DV: tl.constexpr, DOT_PREC: tl.constexpr, USE_TMA: tl.constexpr, HAS_DOCS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch, query head): dq over the forward's key range."""
    tile, b, h = _program(tl.program_id(0), (n + BLOCK_M - 1) // BLOCK_M, B, Hq, ORDER, 0)
    kvh = h // G
    m0 = tile * BLOCK_M
    mlast = tl.minimum(m0 + BLOCK_M, n) - 1
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DV)
    w, lo, hi = _win_range(WIN, START, END, sxb, b, h, m0, mlast, n, CAUSAL, False, HAS_DOCS)
    slope2 = tl.load(SLOPE + h)
    doc_m = _win_docs(START, sxb, b, offs_m, n, HAS_DOCS)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q = _load_tile(Q + b64 * sqb + h64 * sqh, offs_m, sqn, offs_d, n, D, HEAD_DIM)
    do = _load_tile(DO + b64 * sdb + h64 * sdh, offs_m, sdn, offs_dv, n, DV, HEAD_DV)
    rmask = offs_m < n
    row = (b64 * Hq + h64) * n
    lse = tl.load(LSE + row + offs_m, mask=rmask, other=0.0)
    lse_lo = tl.load(LSE_LO + row + offs_m, mask=rmask, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=rmask, other=0.0)
    Kb = K + b64 * skb + kvh.to(tl.int64) * skh
    Vb = V + b64 * svb + kvh.to(tl.int64) * svh
    if USE_TMA:
        Kb = tl.make_tensor_descriptor(Kb, shape=[n, D], strides=[skn, 1], block_shape=[BLOCK_N, HEAD_DIM])
        Vb = tl.make_tensor_descriptor(Vb, shape=[n, DV], strides=[svn, 1], block_shape=[BLOCK_N, HEAD_DV])
    dq = tl.full([BLOCK_M, HEAD_DIM], 0.0, dtype=tl.float32)
    for j in range(0, (tl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N):
        n0 = lo + j * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _stream_tile(Kb, n0, offs_n, skn, offs_d, n, D, HEAD_DIM, USE_TMA)
        v = _stream_tile(Vb, n0, offs_n, svn, offs_dv, n, DV, HEAD_DV, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s2 = _win_scores(qk, offs_m, offs_n, w, slope2, qk_scale, n, doc_m,
                         _win_docs(START, sxb, b, offs_n, n, HAS_DOCS),
                         CAUSAL, HAS_DOCS, False)
        p = tl.exp2((s2 - lse[:, None]) - lse_lo[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    dq = dq * sm_scale
    dqp = DQ + b64 * sdqb + h64 * sdqh + offs_m.to(tl.int64)[:, None] * sdqn + offs_d[None, :]
    tl.store(dqp, dq.to(DQ.dtype.element_ty), mask=rmask[:, None] & (offs_d < D)[None, :])
