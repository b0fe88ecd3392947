"""The fast nested-count routes of :mod:`poslsh_paper.analysis` agree with the library's
definitions (Partitions.dense_count, poslsh.theory, alibi_attention_reference, poslsh_attention)."""
import numpy as np
import pytest
import torch

from poslsh import alibi_sigmas, poslsh_attention, theory
from poslsh.reference import alibi_attention_reference
from poslsh_paper.analysis import (approx_output, causal_weights, default_heads, dense_from_band, exact_output, fit_slope,
                             mask_max_error, mask_spectral_error, nested_counts)
from poslsh.partitions import Partitions, sample_partitions


def _prefix(p, hi, s):
    return Partitions(p.widths[hi:hi + 1, :s], p.offsets[hi:hi + 1, :s], p.sigma[hi:hi + 1])


@pytest.mark.parametrize("n", [1, 2, 97, 301])
def test_nested_counts_equal_dense_count(n):
    # sigma 0.3 and 0.7: many widths <= 1 (one block per position); 64: wide blocks
    sig = torch.tensor([0.3, 0.7, 1.41, 8.0, 64.0, 1e4], dtype=torch.float64)
    p = sample_partitions(sig, 120, seed=n)
    for hi in range(sig.numel()):
        # a tiny chunk size forces many chunks and both enumeration routes
        for snap in nested_counts(p.widths[hi], p.offsets[hi], n, [1, 5, 120], chunk_elems=64):
            ref = _prefix(p, hi, snap.s).dense_count(n)[0].numpy()
            assert (dense_from_band(snap.band, snap.width, symmetric=True) == ref).all()
            assert (dense_from_band(snap.band) == np.tril(ref)).all()
            assert snap.width == _prefix(p, hi, snap.s).max_block_size(n)
            assert snap.band.shape == (n, snap.width)


def test_nested_counts_take_arrays_and_any_order():
    p = sample_partitions(torch.tensor([3.0]), 40, seed=4)
    a = [x.band for x in nested_counts(p.widths[0], p.offsets[0], 64, [40, 7])]
    b = [x.band for x in nested_counts(p.widths[0].numpy(), p.offsets[0].numpy(), 64, [7, 40])]
    assert all((x == y).all() for x, y in zip(a, b))


def test_nested_counts_rejects_bad_sizes():
    p = sample_partitions(torch.tensor([2.0]), 10, seed=0)
    with pytest.raises(ValueError):
        next(nested_counts(p.widths[0], p.offsets[0], 16, [0, 5]))
    with pytest.raises(ValueError):
        next(nested_counts(p.widths[0], p.offsets[0], 16, [11]))


@pytest.mark.parametrize("n", [200, 520])
def test_mask_norms_match_theory(n):
    # n=200: dense eigenvalues; n=520: Lanczos with the banded (small sigma) and dense (large sigma) routes
    sig = torch.tensor([1.41, 8.0, 256.0], dtype=torch.float64)
    p = sample_partitions(sig, 300, seed=1)
    for hi in range(3):
        for snap in nested_counts(p.widths[hi], p.offsets[hi], n, [1, 30, 300]):
            pre = _prefix(p, hi, snap.s)
            assert mask_max_error(snap, float(sig[hi])) == pytest.approx(float(theory.max_norm_error(pre, n)[0]),
                                                                         abs=1e-12)
            ref = float(theory.spectral_norm_error(pre, n, tol=1e-7)[0])
            assert mask_spectral_error(snap, float(sig[hi]), tol=1e-7) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("sigma", [1.41, 16.0, 500.0])
def test_outputs_match_library(sigma):
    n, d = 257, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, d, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    p = sample_partitions(torch.tensor([sigma], dtype=torch.float64), 40, seed=2)
    a = causal_weights(q, k, chunk=64)
    ex = exact_output(a, v, sigma, chunk=64)
    ref = alibi_attention_reference(q[None, None], k[None, None], v[None, None],
                          torch.tensor([1.0 / sigma], dtype=torch.float64), causal=True)[0, 0]
    torch.testing.assert_close(ex.t, ref, atol=1e-12, rtol=1e-10)
    st = theory.instance_stats(q[None], k[None], torch.tensor([sigma]), causal=True)
    assert ex.beta_star == pytest.approx(float(st.beta_star[0]), rel=1e-10)
    assert ex.p_2inf == pytest.approx(float(st.p_2inf[0]), rel=1e-10)
    assert ex.v_max == float(v.abs().max())
    snap = next(nested_counts(p.widths[0], p.offsets[0], n, [40]))
    tt = approx_output(a, v, dense_from_band(snap.band, snap.width), snap.width, chunk=64)
    want = poslsh_attention(q[None, None], k[None, None], v[None, None], p, causal=True, backend="torch")[0, 0]
    torch.testing.assert_close(tt, want, atol=1e-12, rtol=1e-10)


def test_default_heads_span_sigma():
    assert default_heads(9) == [8, 2, 4, 7]
    for H in (4, 6, 8, 12, 32):
        hs = default_heads(H)
        sig = alibi_sigmas(H)[hs]
        assert len(hs) == 4 and (sig[1:] > sig[:-1]).all()
        assert float(sig[0]) == float(alibi_sigmas(H).min()) and float(sig[-1]) == float(alibi_sigmas(H).max())


def test_fit_slope():
    s = [1, 10, 100, 1000, 10000]
    assert fit_slope(s, [3 * x ** -0.5 for x in s]) == pytest.approx(-0.5)
    assert fit_slope(s, [3 * x ** -0.5 for x in s], min_s=100) == pytest.approx(-0.5)
    assert fit_slope([1, 10], [1, 2], min_s=100) is None
