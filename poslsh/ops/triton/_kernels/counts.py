"""The count of positional LSH: in how many of the ``s`` samples a program's positions and a
streamed tile's share a block, from the plan (:mod:`.._plan`; only its integers are read here).

Blocks are contiguous, so the keys that share a block with *some* row of a tile in *some* sample
form one range ``[lo, hi)`` (:func:`tile_blocks`), the tiles a program streams. The count of a
(program tile, streamed tile) pair comes one of two ways (:func:`count_tile`, the one dispatcher):

* **one-hot on tensor cores** when the blocks of all samples that touch the program tile number
  ``R <= R_MAX``: with ``Phi[i, r] = [i in block r]`` over those ``R`` (sample, block) pairs,
  ``count = Phi_rows @ Phi_cols^T`` exactly (blocks of one sample are disjoint, so each sample adds
  1 iff the two positions share one of its blocks, and a block that misses the program tile cannot
  be shared with its rows). ``Phi_rows`` is built once per program (:func:`head_counts`); per
  streamed tile ``Phi_cols^T`` is ``R_MAX x T`` interval tests and the count is one fp16 MMA with
  ``K = R_MAX`` accumulated in fp32 (0/1 inputs, integer sums: exact).
* **label compares** otherwise (heads whose blocks are much shorter than the tile):
  ``count += [label_t(i) == label_t(k)]`` sample by sample, in a runtime loop; for grouped
  partitions (``LATTICE``) over the ``G`` groups instead, from their lattice indices.

``PATH`` (constexpr) says which a launch holds: 1 one-hot only, 2 compares only (two launches, each
with one method compiled: fewer registers), 0 both, chosen per program (one launch).
"""
from typing import NamedTuple

import triton
import triton.language as tl

from .common import MAX, MIN, SUM


class Plan(NamedTuple):
    """The plan of one batch row: block labels ``ids [H, S, n]``, granule bounds ``gran`` (row 0
    at ``gran``, row 1 at ``gran + gran_stride``; ``n_gran`` per (head, sample)), the compare
    count's label rows ``lat [H, NC, n]`` (lattice indices of the groups, or ``ids``) and the
    group sizes ``ksz [H, NC]``."""
    ids: object
    gran: object
    lat: object
    ksz: object
    n: object
    n_gran: object
    gran_stride: object
    S: object
    NC: object


class Counts(NamedTuple):
    """What a program needs to count against streamed tiles of one head (:func:`head_counts`):
    the compare count's label rows ``lat`` and group sizes ``ksz`` of the head (``nc`` rows), the
    one-hot ``phi [P, R_MAX]`` of the program tile's blocks ``[bs, be)`` and whether this program
    counts by one-hot (``PATH`` 0)."""
    lat: object
    ksz: object
    nc: object
    n: object
    phi: object
    bs: object
    be: object
    onehot: object


@triton.jit
def row_plan(IDS, GRAN, LAT, KSZ, b, n, n_gran, gran_stride, ids_bs, gran_bs, lat_bs, S, NC,
             ROW_PLANS: tl.constexpr):
    """The :class:`Plan` of batch row ``b``: packed documents give every row its own (strides 0:
    one plan for all rows; constexpr, because derived pointers take registers that kernel
    arguments do not)."""
    if ROW_PLANS:
        b64 = b.to(tl.int64)
        IDS += b64 * ids_bs
        GRAN += b64 * gran_bs
        LAT += b64 * lat_bs
    return Plan(IDS, GRAN, LAT, KSZ, n, n_gran, gran_stride, S, NC)


@triton.jit
def tile_blocks(plan, h, p0, plast, R_MAX: tl.constexpr, SC: tl.constexpr):
    """The blocks (all samples) touching positions ``[p0, plast]`` of head ``h``.

    Returns ``lo, hi`` (their union ``[lo, hi)``), ``R`` (how many (sample, block) pairs) and, for
    the first ``R_MAX`` pairs in sample-major order, the sample ``tr`` of lane ``r`` and the rank
    ``jr`` of the block among that sample's blocks in the tile (:func:`block_bounds` turns them
    into ``[start, end)``). ``SC`` samples per vector step."""
    rr = tl.arange(0, R_MAX)
    sc = tl.arange(0, SC)
    n = plan.n
    lo = p0 * 0 + n       # (n may be specialised to a constant: make loop-carried scalars tensors)
    hi = p0 * 0
    R = p0 * 0
    tr = tl.full([R_MAX], 0, dtype=tl.int32)
    jr = tl.full([R_MAX], 0, dtype=tl.int32)
    for t0 in range(0, plan.S, SC):
        ts = t0 + sc
        tm = ts < plan.S
        row = (h * plan.S + ts).to(tl.int64)
        L = tl.load(plan.ids + row * n + plast, mask=tm, other=-1) - tl.load(plan.ids + row * n + p0, mask=tm,
                                                                             other=0) + 1
        first = tl.load(plan.gran + row * plan.n_gran + p0 // 16, mask=tm, other=n)
        last = tl.load(plan.gran + plan.gran_stride + row * plan.n_gran + plast // 16, mask=tm, other=0)
        lo = tl.minimum(lo, tl.reduce(first, 0, MIN))
        hi = tl.maximum(hi, tl.reduce(last, 0, MAX))
        excl = R + tl.reduce(tl.where(sc[None, :] < sc[:, None], L[None, :], 0), 1, SUM)
        hit = (rr[:, None] >= excl[None, :]) & (rr[:, None] < (excl + L)[None, :])     # [R_MAX, SC]
        tr += tl.reduce(tl.where(hit, ts[None, :], 0), 1, SUM)
        jr += tl.reduce(tl.where(hit, rr[:, None] - excl[None, :], 0), 1, SUM)
        R += tl.reduce(L, 0, SUM)
    return lo, hi, R, tr, jr


@triton.jit
def block_bounds(plan, h, p0, plast, R, tr, jr, R_MAX: tl.constexpr, P: tl.constexpr):
    """``[start, end)`` (int32 vectors of ``R_MAX`` lanes; lanes ``>= R`` empty) of block ``jr`` of
    sample ``tr`` among the blocks touching ``[p0, plast]``: it starts at the first position of the
    tile with label ``a0 + jr`` (``p0`` + #smaller labels: labels are nondecreasing), the first
    block at ``gran[0]`` (maybe before ``p0``), and the last block ends at ``gran[1]`` (maybe
    after ``plast``)."""
    n = plan.n
    valid = tl.arange(0, R_MAX) < R
    row = (h * plan.S + tr).to(tl.int64)
    pp = p0 + tl.arange(0, P)
    labs = tl.load(plan.ids + row[:, None] * n + pp[None, :], mask=valid[:, None] & (pp <= plast)[None, :],
                   other=2147483647) - jr[:, None]
    a0 = tl.load(plan.ids + row * n + p0, mask=valid, other=0)
    nb = tl.reduce(tl.where(labs < a0[:, None], 1, 0), 1, SUM)
    ne = tl.reduce(tl.where(labs <= a0[:, None], 1, 0), 1, SUM)
    fs = tl.load(plan.gran + row * plan.n_gran + p0 // 16, mask=valid & (jr == 0), other=0)
    le = tl.load(plan.gran + plan.gran_stride + row * plan.n_gran + plast // 16, mask=valid & (ne > plast - p0),
                 other=0)
    bs = tl.where(valid, tl.where(jr == 0, fs, p0 + nb), 0)
    be = tl.where(valid, tl.where(ne > plast - p0, le, p0 + ne), 0)
    return bs, be


@triton.jit
def tile_R(plan, h, p0, plast, SC: tl.constexpr):
    """How many (sample, block) pairs touch ``[p0, plast]`` (the ``R`` of :func:`tile_blocks`)."""
    R = p0 * 0
    for t0 in range(0, plan.S, SC):
        ts = t0 + tl.arange(0, SC)
        tm = ts < plan.S
        row = (h * plan.S + ts).to(tl.int64)
        L = (tl.load(plan.ids + row * plan.n + plast, mask=tm, other=-1)
             - tl.load(plan.ids + row * plan.n + p0, mask=tm, other=0) + 1)
        R += tl.reduce(L, 0, SUM)
    return R


@triton.jit
def class_R(plan, h, p0, R, CLASS_TILE: tl.constexpr, TILE: tl.constexpr, SC: tl.constexpr, PATH: tl.constexpr):
    """The ``R`` that decides which launch runs a program (``PATH`` 1 / 2): that of the
    ``CLASS_TILE`` positions holding its tile of ``TILE`` (the launches may tile differently: the
    one-hot launch and the compare launch are tuned apart), so that every tile is run by exactly
    one launch (the program's own ``R`` is ``<=``). Its own ``R`` when the tiles are the class
    tiles (the default configurations: an extra sample loop costs ~250 B of spills) or with ``PATH`` 0."""
    if PATH != 0:
        if TILE != CLASS_TILE:
            c0 = p0 // CLASS_TILE * CLASS_TILE
            R = tile_R(plan, h, c0, tl.minimum(c0 + CLASS_TILE, plan.n) - 1, SC)
    return R


@triton.jit
def takes(R, R_MAX: tl.constexpr, PATH: tl.constexpr):
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
def onehot_matrix(pos, bs, be, ROWS: tl.constexpr):
    """fp16 ``[len(pos), R]`` (``ROWS``) or ``[R, len(pos)]``: ``[bs_r <= pos < be_r]``."""
    if ROWS:
        x = (pos[:, None] >= bs[None, :]) & (pos[:, None] < be[None, :])
    else:
        x = (pos[None, :] >= bs[:, None]) & (pos[None, :] < be[:, None])
    return x.to(tl.float16)


@triton.jit
def head_counts(plan, h, t, R, tr, jr, PATH: tl.constexpr, R_MAX: tl.constexpr, P: tl.constexpr):
    """The :class:`Counts` of head ``h`` for the program tile ``t`` (a :class:`..common.Tile` of
    ``P`` rows) with the blocks ``R, tr, jr`` of :func:`tile_blocks`: the one-hot of the tile's
    blocks built once (not for compare-only launches)."""
    lat = plan.lat + h.to(tl.int64) * plan.NC * plan.n
    ksz = plan.ksz + h.to(tl.int64) * plan.NC
    onehot = R <= R_MAX
    if PATH == 2:
        phi = 0.0
        bs = 0
        be = 0
    elif PATH == 1:        # (a PATH 1 launch runs only programs with R <= R_MAX)
        bs, be = block_bounds(plan, h, t.p0, t.plast, R, tr, jr, R_MAX, P)
        phi = onehot_matrix(t.offs, bs, be, True)
    else:
        bs = tl.full([R_MAX], 0, dtype=tl.int32)
        be = bs
        if onehot:
            bs, be = block_bounds(plan, h, t.p0, t.plast, R, tr, jr, R_MAX, P)
        phi = onehot_matrix(t.offs, bs, be, True)
    return Counts(lat, ksz, plan.NC, plan.n, phi, bs, be, onehot)


@triton.jit
def count_cmp(c, r_idx, c_idx, LATTICE: tl.constexpr):
    """``count[r, c]`` (fp32) from the ``c.nc`` label rows ``c.lat [nc, n]``, one row at a time
    (runtime loop; the next row is loaded before the current one is used).

    * i.i.d. partitions (``LATTICE`` False): the rows hold each sample's block labels,
      ``count += [label(r) == label(c)]``. Rows and columns ``>= n`` get labels -1 / -2: never
      equal, count 0.
    * grouped partitions (``LATTICE``): the rows hold each *group's* lattice index
      ``floor((u - origin) / (b / k))``, ``c.ksz`` its size ``k``; a group of ``k`` shifted grids
      puts both positions in one block in ``max(0, k - |index(r) - index(c)|)`` of its masks
      (:func:`poslsh.partitions.group_count`), so a score costs ``G`` steps instead of ``s``.
      Rows and columns ``>= n`` are masked at the end."""
    n = c.n
    rmask = r_idx < n
    cmask = c_idx < n
    ptr = c.lat
    if LATTICE:
        rid = tl.load(ptr + r_idx, mask=rmask, other=0)
        cid = tl.load(ptr + c_idx, mask=cmask, other=0)
        w = tl.maximum(tl.load(c.ksz) - tl.abs(rid[:, None] - cid[None, :]), 0).to(tl.float32)
        for t in range(1, c.nc):
            ptr += n
            rid = tl.load(ptr + r_idx, mask=rmask, other=0)
            cid = tl.load(ptr + c_idx, mask=cmask, other=0)
            w += tl.maximum(tl.load(c.ksz + t) - tl.abs(rid[:, None] - cid[None, :]), 0).to(tl.float32)
        w = tl.where(rmask[:, None] & cmask[None, :], w, 0.0)
    else:
        rid = tl.load(ptr + r_idx, mask=rmask, other=-1)
        cid = tl.load(ptr + c_idx, mask=cmask, other=-2)
        w = tl.where(rid[:, None] == cid[None, :], 1.0, 0.0)
        for t in range(1, c.nc):
            ptr += n
            rid = tl.load(ptr + r_idx, mask=rmask, other=-1)
            cid = tl.load(ptr + c_idx, mask=cmask, other=-2)
            w += tl.where(rid[:, None] == cid[None, :], 1.0, 0.0)
    return w


@triton.jit
def count_tile(c, own, other, PATH: tl.constexpr, LATTICE: tl.constexpr):
    """``count [len(own), len(other)]`` (fp32, exact integers) between the program tile's
    positions ``own`` and a streamed tile's ``other``, by the method of ``PATH`` (0: the
    program's, ``c.onehot``, a branch uniform over the program)."""
    if PATH == 1:
        w = tl.dot(c.phi, onehot_matrix(other, c.bs, c.be, False))
    elif PATH == 2:
        w = count_cmp(c, own, other, LATTICE)
    else:
        if c.onehot:
            w = tl.dot(c.phi, onehot_matrix(other, c.bs, c.be, False))
        else:
            w = count_cmp(c, own, other, LATTICE)
    return w


@triton.jit(do_not_specialize=["S", "n_gran", "gran_stride", "n_tiles"])
def _tile_blocks_kernel(IDS, GRAN, LOHI, BLOCKS, n, n_gran, gran_stride, S, n_tiles,
                        R_MAX: tl.constexpr, P: tl.constexpr, SC: tl.constexpr):
    """Writes what :func:`tile_blocks` finds for tile ``pid % n_tiles`` of head
    ``pid // n_tiles``: ``lohi = (lo, hi, R)`` int32 ``[3]`` and the blocks ``[2, R_MAX]``.
    For tests and the static checks; the attention kernels call ``tile_blocks`` inline."""
    pid = tl.program_id(0)
    h = pid // n_tiles
    p0 = (pid % n_tiles) * P
    plast = tl.minimum(p0 + P, n) - 1
    plan = Plan(IDS, GRAN, IDS, IDS, n, n_gran, gran_stride, S, S)
    lo, hi, R, tr, jr = tile_blocks(plan, h, p0, plast, R_MAX, SC)
    bs, be = block_bounds(plan, h, p0, plast, tl.where(R <= R_MAX, R, 0), tr, jr, R_MAX, P)
    tl.store(LOHI + pid * 3, lo)
    tl.store(LOHI + pid * 3 + 1, hi)
    tl.store(LOHI + pid * 3 + 2, R)
    rr = tl.arange(0, R_MAX)
    tl.store(BLOCKS + pid * 2 * R_MAX + rr, bs)
    tl.store(BLOCKS + pid * 2 * R_MAX + R_MAX + rr, be)
