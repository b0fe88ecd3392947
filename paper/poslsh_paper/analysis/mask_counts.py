"""Mask counts of nested partition samples, the norms of ``L* - M~`` and the
exact / approximate causal attention outputs computed from them (no model, CLI
or file I/O). Used by ``poslsh convergence`` and ``poslsh audit``.

Why not :mod:`poslsh.theory`: the experiments measure *nested* samples. For each
(input, head) they draw ``s_max`` partitions once, and the sample of size ``s``
is the first ``s`` of them, so :func:`nested_counts` yields the count matrix of
every requested ``s`` from one pass over the draw (``O(n s_max + n b_max)`` per
snapshot set), in a banded layout (:class:`CountSnapshot`) that the norm and
output routines below consume directly. Theory computes the same quantities
(``||L* - M~||``, ``||L* - M~||_max``, ``beta*``, ``||P||_{2,inf}``) for one
:class:`~poslsh.partitions.Partitions` object, re-enumerating its blocks per call;
the two agree to rounding (``poslsh_paper.analysis.records.cross_check`` on every
convergence run, and the tests). The blocks themselves always come from the core
geometry of :mod:`poslsh.partitions`.
"""
from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from poslsh.partitions import Partitions, block_labels

__all__ = [
    "CountSnapshot", "nested_counts", "dense_from_band", "mask_max_error", "mask_spectral_error",
    "causal_weights", "ExactOutput", "exact_output", "approx_output",
]


# ============================================================ mask counts
class CountSnapshot(NamedTuple):
    """The mean mask of the first ``s`` partitions, as integer counts.

    ``band[i, k] = count[i, i - k]`` for ``0 <= k <= i`` (zero for ``k > i``), int32
    ``[n, width]``: the number of those partitions in which positions ``i`` and
    ``i - k`` share a block (``M~ = count / s``); ``count[i, j] = 0`` for
    ``|i - j| >= width``, the largest block size ``b_max``.
    """

    s: int
    band: np.ndarray
    width: int


def _blocks(w: Tensor, c: Tensor, n: int, by_positions: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(start, length), int64 ``[#blocks]``, of every block on ``[0, n)`` of the
    partitions ``(w, c)`` (1-D float64), by the core geometry of :mod:`poslsh.partitions`.

    ``by_positions``: label every position (:func:`~poslsh.partitions.block_labels`,
    ``O(n)`` per partition, cheap for narrow blocks); else enumerate the bins
    (:meth:`~poslsh.partitions.Partitions.blocks`, ``O(n / b)``, cheap for wide ones)."""
    if not by_positions:
        blk = Partitions(w[None], c[None]).blocks(n)
        return blk.start.numpy(), blk.length.numpy()
    labels = block_labels(w[None], c[None], torch.arange(n, dtype=torch.float64))[0].numpy()    # [k, n]
    new = np.empty(labels.shape, dtype=bool)
    new[:, 0] = True
    np.not_equal(labels[:, 1:], labels[:, :-1], out=new[:, 1:])
    # flat starts: every row opens with a block at 0, so a row's last block ends where the next row starts
    flat = np.flatnonzero(new)
    return flat % n, np.diff(flat, append=new.size)


def nested_counts(widths, offsets, n: int, samples: Sequence[int], *,
                  chunk_elems: int = 1 << 20) -> Iterator[CountSnapshot]:
    """Count snapshots of one head for the nested prefixes ``s in samples``.

    Args:
        widths, offsets: the head's partitions, 1-D ``[s_max]`` (tensor or array,
            float64); the sample of size ``s`` is the first ``s`` of them.
        n: sequence length.
        samples: sample sizes, each in ``[1, s_max]`` (yielded in increasing order).
        chunk_elems: positions (or blocks) enumerated per batch. It bounds the memory,
            and 2^20 float64 (8 MB) arrays stay below glibc's mmap threshold, so they
            are reused instead of page-faulted in afresh (2^22 was ~1.5x slower).

    Method: a histogram ``G[a, L]`` of the blocks (start ``a``, length ``L``) of all
    partitions so far; then ``count[i, i-k] = sum_{m >= k} R[i-m, m]`` with
    ``R[a, m] = #{blocks starting at a longer than m}``: two reverse cumulative
    sums and a skew, ``O(n * b_max)`` per snapshot. Blocks come from the core
    geometry (:func:`_blocks`), by positions (``O(n)`` per partition) or by bins
    (``O(n / b)``), whichever is cheaper for the widths drawn. Total
    ``O(n s_max + n b_max)`` per snapshot set, never ``O(s n^2)``.
    """
    w = torch.as_tensor(widths, dtype=torch.float64).cpu().reshape(-1)
    c = torch.as_tensor(offsets, dtype=torch.float64).cpu().reshape(-1)
    samples = sorted(int(s) for s in samples)
    if not samples or samples[0] < 1 or samples[-1] > w.shape[0]:
        raise ValueError(f"sample sizes {samples} must lie in [1, {w.shape[0]}]")
    # blocks a partition of width b has on [0, n): about n / b + 1 (every position when b <= 1)
    nblocks = torch.where(w <= 1.0, float(n), n / w + 2.0).numpy()
    G = np.zeros((n, 2), dtype=np.int64)       # G[a, L], columns grown on demand
    prev = 0
    for s in samples:
        idx = np.arange(prev, s)
        by_pos = nblocks[idx] > 0.25 * n
        for positions, sel in ((True, idx[by_pos]), (False, idx[~by_pos])):
            if sel.size == 0:
                continue
            cost = np.cumsum(np.full(sel.size, float(n)) if positions else nblocks[sel])
            # chunks of about chunk_elems positions / blocks of work each
            cuts = np.searchsorted(cost, np.arange(chunk_elems, cost[-1], chunk_elems), side="right")
            for part in np.split(sel, np.unique(np.clip(cuts, 1, sel.size - 1)) if sel.size > 1 else []):
                part = torch.from_numpy(part)
                start, length = _blocks(w[part], c[part], n, positions)
                L = int(length.max())
                if L + 1 > G.shape[1]:
                    G = np.pad(G, ((0, 0), (0, L + 1 - G.shape[1])))
                cols = G.shape[1]
                G += np.bincount(start * cols + length, minlength=n * cols).reshape(n, cols)
        prev = s
        yield CountSnapshot(s, _band_from_hist(G), _width(G))


def _width(G: np.ndarray) -> int:
    nz = np.nonzero(G.any(axis=0))[0]
    return int(nz[-1]) if nz.size else 0


def _band_from_hist(G: np.ndarray) -> np.ndarray:
    """``band[i, k] = sum_{m >= k} R[i - m, m]``, ``R[a, m] = sum_{L > m} G[a, L]``."""
    n = G.shape[0]
    W = max(1, _width(G))
    R = np.cumsum(G[:, :0:-1], axis=1)[:, ::-1][:, :W]      # R[a, m] = sum_{L >= m + 1} G[a, L]
    # skew[i, m] = R[i - m, m] (0 for i < m): a strided view of R below W zero rows
    P = np.zeros((W + n, W), dtype=np.int64)
    P[W:] = R
    rs, es = P.strides
    skew = np.lib.stride_tricks.as_strided(P[W:], shape=(n, W), strides=(rs, es - rs), writeable=False)
    band = np.cumsum(skew[:, ::-1], axis=1)[:, ::-1]
    return np.ascontiguousarray(band, dtype=np.int32)


def dense_from_band(band: np.ndarray, width: Optional[int] = None, *, symmetric: bool = False) -> np.ndarray:
    """The lower triangle ``lower[i, j] = count[i, j]`` (``j <= i``) from the band
    layout, or the full symmetric count with ``symmetric=True``. ``O(n * width)``
    besides the allocation."""
    n = band.shape[0]
    width = band.shape[1] if width is None else min(band.shape[1], int(width))
    buf = np.zeros(n + n * n, dtype=band.dtype)
    out = buf[n:].reshape(n, n)
    es = buf.strides[0]
    # view[i, k] -> out[i, i - k]; for k > i it lands in the padding or above the
    # diagonal, where band is 0 by construction, so nothing is overwritten.
    view = np.lib.stride_tricks.as_strided(buf[n:], shape=(n, width), strides=((n + 1) * es, -es))
    view[...] = band[:, :width]
    if symmetric:
        out = out + np.tril(out, -1).T
    return out


def mask_max_error(snap: CountSnapshot, sigma: float) -> float:
    """``||L* - M~||_max`` from a snapshot, ``O(n * width)``.

    Same quantity as :func:`poslsh.theory.max_norm_error`, which is not a drop-in:
    it takes a Partitions object and rebuilds the counts in ``O(n^2)`` per call,
    whereas this reads the banded nested counts (every ``s`` from one pass)."""
    n = snap.band.shape[0]
    W = min(n, snap.width)
    k = np.arange(W, dtype=np.float64)
    diff = np.abs(np.exp(-k / sigma)[None, :] - snap.band[:, :W] / snap.s)
    diff = np.tril(diff)                 # only k <= i is a matrix entry
    best = float(diff.max())
    if W < n:                            # entries beyond the widest block: M~ = 0, L* = exp(-k/sigma)
        best = max(best, math.exp(-W / sigma))
    return best


# Not theory._toeplitz_exp_matvec: that one (private) rebuilds and transforms the
# Toeplitz column on every call; Lanczos calls the mat-vec hundreds of times per
# snapshot, so the column's FFT is computed once here and reused (same math).
def _toeplitz_rfft(n: int, sigma: float) -> np.ndarray:
    col = np.exp(-np.arange(n) / sigma)
    return np.fft.rfft(np.concatenate([col, [0.0], col[:0:-1]]))


def mask_spectral_error(snap: CountSnapshot, sigma: float, *, tol: float = 1e-5,
                        dense_fraction: float = 0.125) -> float:
    """``||L* - M~||`` from a snapshot: Lanczos on ``x -> L* x - count x / s``.

    ``L* x`` by FFT; ``count x`` banded (DIA) when ``width <= dense_fraction * n``,
    else ``lower x + lower^T x - s x`` with the dense lower triangle (float32).

    Same quantity as :func:`poslsh.theory.spectral_norm_error`, which is not a
    drop-in: it needs a Partitions prefix and enumerates its blocks per call
    (``O(n s / sigma)`` per mat-vec); this uses the snapshot's counts.
    """
    import scipy.sparse as sp
    from scipy.sparse.linalg import LinearOperator, eigsh

    n = snap.band.shape[0]
    s = snap.s
    fl = _toeplitz_rfft(n, sigma)

    def lstar(x):
        return np.fft.irfft(fl * np.fft.rfft(x, n=2 * n), n=2 * n)[:n]

    if n <= 256:
        dense = dense_from_band(snap.band, snap.width, symmetric=True) / s
        pos = np.arange(n)
        err = np.exp(-np.abs(pos[:, None] - pos[None, :]) / sigma) - dense
        return float(np.abs(np.linalg.eigvalsh(err)).max())
    W = min(n, snap.width)
    if W <= dense_fraction * n:
        b = snap.band[:, :W].astype(np.float64) / s
        data = np.zeros((2 * W - 1, n))
        offs = np.zeros(2 * W - 1, dtype=np.int64)
        data[0] = b[:, 0]
        for k in range(1, W):
            data[2 * k - 1] = b[:, k]                 # offset +k: A[j-k, j] = count[j, j-k]
            offs[2 * k - 1] = k
            data[2 * k, : n - k] = b[k:, k]            # offset -k: A[j+k, j] = count[j+k, j]
            offs[2 * k] = -k
        m = sp.dia_matrix((data, offs), shape=(n, n)).tocsr()

        def mv(x):
            x = np.asarray(x, dtype=np.float64).ravel()
            return lstar(x) - m @ x
    else:
        lower = torch.from_numpy(dense_from_band(snap.band, W)).to(torch.float32)

        def mv(x):
            x = np.asarray(x, dtype=np.float64).ravel()
            x32 = torch.from_numpy(x.astype(np.float32))
            cx = (torch.mv(lower, x32) + torch.mv(lower.T, x32)).numpy().astype(np.float64) - s * x
            return lstar(x) - cx / s

    op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
    v0 = np.random.default_rng(0).standard_normal(n)
    vals = eigsh(op, k=1, which="LM", tol=tol, v0=v0, return_eigenvectors=False, maxiter=50 * n)
    return float(np.abs(vals).max())


# ============================================================ attention
def causal_weights(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None, *,
                   chunk: int = 512) -> torch.Tensor:
    """``A'`` for one head: ``q, k [n, d]`` -> float64 ``[n, n]`` lower triangular."""
    n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    out = torch.zeros(n, n, dtype=torch.float64)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        sc = (q64[r0:r1] @ k64[:r1].T) * scale
        rows = torch.arange(r0, r1)[:, None]
        sc = sc.masked_fill(torch.arange(r1)[None, :] > rows, float("-inf"))
        out[r0:r1, :r1] = torch.exp(sc - sc.amax(1, keepdim=True))
    return out


class ExactOutput(NamedTuple):
    t: torch.Tensor          # [n, dv] exact causal ALiBi output T*
    beta_star: float         # min_i sum_j P_ij L*_ij
    p_2inf: float            # ||P||_{2,inf}
    v_max: float             # ||V||_max


def exact_output(a: torch.Tensor, v: torch.Tensor, sigma: float, *, chunk: int = 512) -> ExactOutput:
    """``T*`` (exact causal ALiBi) from ``A'`` and the instance statistics of
    Theorem 2.2 (``P = A' / rowsum A'``).

    ``beta*`` and ``||P||_{2,inf}`` are what :func:`poslsh.theory.instance_stats`
    computes; it is not called because it recomputes the softmax from ``q, k``
    (``[H, n, d]``), while here they fall out of the ``A'`` already built for
    ``T*`` in the same row pass."""
    n = a.shape[0]
    v64 = v.to(torch.float64)
    t = torch.empty(n, v.shape[1], dtype=torch.float64)
    beta, p2 = float("inf"), 0.0
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        blk = a[r0:r1, :r1]
        dist = (torch.arange(r0, r1, dtype=torch.float64)[:, None] - torch.arange(r1, dtype=torch.float64)[None, :])
        lst = torch.exp(-dist.clamp_min(0) / sigma)
        w = blk * lst
        den = w.sum(1)
        t[r0:r1] = (w @ v64[:r1]) / den[:, None]
        z = blk.sum(1)
        beta = min(beta, float((den / z).min()))
        p2 = max(p2, float((blk.pow(2).sum(1).sqrt() / z).max()))
    return ExactOutput(t, beta, p2, float(v.abs().max()))


def approx_output(a: torch.Tensor, v: torch.Tensor, lower: np.ndarray, width: int, *,
                  chunk: int = 512) -> torch.Tensor:
    """``T~ = (A' * count) V / rowsum(A' * count)`` (causal), in row chunks over the
    band ``i - width < j <= i`` where ``count`` can be nonzero."""
    n = a.shape[0]
    v64 = v.to(torch.float64)
    cnt = torch.from_numpy(lower)
    t = torch.empty(n, v.shape[1], dtype=torch.float64)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        c0 = max(0, r0 - int(width) + 1)
        w = a[r0:r1, c0:r1] * cnt[r0:r1, c0:r1].to(torch.float64)
        t[r0:r1] = (w @ v64[c0:r1]) / w.sum(1, keepdim=True)
    return t
