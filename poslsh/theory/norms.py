"""The norms of ``L* - M~`` that Theorem 2.1 bounds, computed exactly without ``O(s n^2)`` work:
the max norm by row-chunked difference arrays, the spectral norm by Lanczos on an ``O(n log n)``
matrix-vector product (numpy and scipy, imported there)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..partitions import Partitions
from ..widths import GammaWidths

__all__ = ["MaskErrors", "max_norm_error", "spectral_norm_error", "mask_error_matvec", "mask_error_norms"]


# ------------------------------------------------- norms of L* - M~ (exact)
class MaskErrors(NamedTuple):
    spectral: Tensor   # [H] ||L* - M~||
    max: Tensor        # [H] ||L* - M~||_max


def _row_chunk_counts(start: Tensor, end: Tensor, n: int, r0: int, r1: int) -> Tensor:
    """``count[i, j]`` for rows ``i in [r0, r1)`` from the blocks ``[start, end)`` of
    one head (all samples): a 2-D difference array restricted to the row chunk."""
    hit = (start < r1) & (end > r0)
    a, e = start[hit], end[hit]
    top, bot = a.clamp(min=r0) - r0, e.clamp(max=r1) - r0
    diff = torch.zeros(r1 - r0 + 1, n + 1, dtype=torch.int32)
    ones = torch.ones_like(a, dtype=torch.int32)
    for rows, cols, sign in ((top, a, 1), (top, e, -1), (bot, a, -1), (bot, e, 1)):
        diff.index_put_((rows, cols), sign * ones, accumulate=True)
    return diff.cumsum(0).cumsum(1)[: r1 - r0, :n]


def max_norm_error(partitions: Partitions, n: int, *, row_chunk: int = 1024) -> Tensor:
    """``||L* - M~||_max`` per head, float64 ``[H]``: ``O(n^2 + #blocks)`` time
    per head (row-chunked difference arrays), ``O(row_chunk * n)`` memory."""
    if partitions.sigma is None:
        raise ValueError("partitions have no sigma (fixed blocks): L* is undefined")
    if partitions.distribution != GammaWidths():
        raise ValueError(f"L* is ALiBi's kernel (Gamma(2) widths) but these widths are {partitions.distribution.name}: "
                         "compare dense_mean(n) with expected_mean(n)")
    p = partitions.to("cpu")
    blk = p.blocks(n)
    s = p.num_samples
    pos = torch.arange(n, dtype=torch.float64)
    out = torch.zeros(p.num_heads, dtype=torch.float64)
    for h in range(p.num_heads):
        sel = blk.head == h
        start, end = blk.start[sel], blk.start[sel] + blk.length[sel]
        sigma = float(p.sigma[h])
        best = 0.0
        for r0 in range(0, n, row_chunk):
            r1 = min(n, r0 + row_chunk)
            m = _row_chunk_counts(start, end, n, r0, r1).to(torch.float64) / s
            lstar = torch.exp(-(pos[r0:r1, None] - pos[None, :]).abs() / sigma)
            best = max(best, float((lstar - m).abs().max()))
        out[h] = best
    return out


def _numpy():
    """numpy and scipy are needed only for the spectral norm (Lanczos): imported there."""
    try:
        import numpy
        import scipy.sparse.linalg  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the spectral norm needs numpy and scipy ({e.name} is missing): "
                          "pip install numpy scipy (or poslsh[theory])") from None
    return numpy


def _toeplitz_exp_matvec(x, sigma: float):
    """``L* x`` for ``L*_ij = exp(-|i-j|/sigma)`` via circulant embedding and FFT, ``O(n log n)``."""
    np = _numpy()
    n = x.shape[0]
    col = np.exp(-np.arange(n) / sigma)
    circ = np.concatenate([col, [0.0], col[:0:-1]])
    fx = np.fft.rfft(np.concatenate([x, np.zeros(n)]), n=2 * n)
    return np.fft.irfft(np.fft.rfft(circ) * fx, n=2 * n)[:n]


def mask_error_matvec(start, end, *, n: int, num_samples: int, sigma: float):
    """``x -> (L* - M~) x`` for one head in ``O(n log n + #blocks)`` (numpy arrays); ``M~ x`` is a
    sum of per-block sums computed with prefix sums (no matrix). Keyword-only after ``end`` (the order
    of 0.2 was ``(start, end, s, sigma, n)``)."""
    s = num_samples
    np = _numpy()

    def matvec(x):
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        prefix = np.concatenate([[0.0], np.cumsum(x)])
        sums = prefix[end] - prefix[start]
        spread = np.bincount(start, sums, minlength=n + 1) - np.bincount(end, sums, minlength=n + 1)
        return _toeplitz_exp_matvec(x, sigma) - np.cumsum(spread)[:n] / s

    return matvec


def spectral_norm_error(partitions: Partitions, n: int, *, tol: float = 1e-6,
                        dense_below: int = 384) -> Tensor:
    """``||L* - M~||`` per head, float64 ``[H]``. Small ``n``: dense eigenvalues.
    Otherwise Lanczos (``scipy.sparse.linalg.eigsh``) on the symmetric matrix,
    using :func:`mask_error_matvec`: ``O(n log n + #blocks)`` per iteration. Needs numpy and scipy."""
    np = _numpy()
    from scipy.sparse.linalg import LinearOperator, eigsh

    if partitions.sigma is None:
        raise ValueError("partitions have no sigma (fixed blocks): L* is undefined")
    if partitions.distribution != GammaWidths():
        raise ValueError(f"L* is ALiBi's kernel (Gamma(2) widths) but these widths are {partitions.distribution.name}: "
                         "compare dense_mean(n) with expected_mean(n)")
    p = partitions.to("cpu")
    blk = p.blocks(n)
    out = torch.zeros(p.num_heads, dtype=torch.float64)
    for h in range(p.num_heads):
        sel = blk.head == h
        start = blk.start[sel].numpy()
        end = (blk.start[sel] + blk.length[sel]).numpy()
        mv = mask_error_matvec(start, end, n=n, num_samples=p.num_samples, sigma=float(p.sigma[h]))
        if n <= dense_below:
            dense = np.stack([mv(col) for col in np.eye(n)], axis=1)
            out[h] = float(np.abs(np.linalg.eigvalsh((dense + dense.T) / 2)).max())
            continue
        op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
        v0 = np.random.default_rng(0).standard_normal(n)
        vals = eigsh(op, k=1, which="LM", tol=tol, v0=v0, return_eigenvectors=False,
                     maxiter=max(1000, 20 * n))
        out[h] = float(np.abs(vals).max())
    return out


def mask_error_norms(partitions: Partitions, n: int) -> MaskErrors:
    """Both norms of ``L* - M~`` per head (see the two functions above)."""
    return MaskErrors(spectral_norm_error(partitions, n), max_norm_error(partitions, n))
