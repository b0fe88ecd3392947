"""The plan kernel: every block label and granule bound of the partitions, and the head order,
in one launch from the float64 widths and offsets (:mod:`.._plan` is its torch reference)."""
import triton
import triton.language as tl

from .common import SUM


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
        rank = tl.reduce(tl.where(before & hm[None, :], 1, 0), 1, SUM)
        tl.store(ORDER + rank, hs, mask=hm)
        Hkv = H // G
        km = hs < Hkv
        kvw = tl.reduce(tl.where((hs[None, :] // G == hs[:, None]) & hm[None, :], work[None, :], 0.0), 1, SUM)
        kvw = tl.where(km, kvw, -1.0)
        before = (kvw[None, :] > kvw[:, None]) | ((kvw[None, :] == kvw[:, None]) & (hs[None, :] < hs[:, None]))
        rank = tl.reduce(tl.where(before & km[None, :], 1, 0), 1, SUM)
        tl.store(ORDER + H + rank, hs, mask=km)
