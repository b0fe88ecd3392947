import math

import pytest
import torch

import poslsh
from poslsh import theory


def test_psi_and_alibi_norm_bound():
    assert theory.psi(1.0) == pytest.approx(2.0 + (math.e + 1) / (math.e - 1))
    for sigma in (0.5, 4.0, 256.0):
        n = 600
        L = poslsh.alibi.alibi_matrix(n, torch.tensor([sigma]))[0]
        assert torch.linalg.eigvalsh(L).abs().max().item() <= theory.alibi_norm_bound(sigma) + 1e-9
        assert 2 < theory.psi(sigma) < 3 * sigma + 2 or sigma < 1


def test_deviation_bounds_invert_tail_probabilities():
    n, s, delta = 4096, 100, 0.01
    eps = theory.max_norm_deviation_bound(n, s, delta)
    assert theory.max_norm_tail_probability(eps, n, s) == pytest.approx(delta)
    s_needed = theory.samples_for_max_norm(eps, n, delta)
    assert s_needed in (s, s + 1)
    eps2 = theory.spectral_deviation_bound(n, s, 16.0, delta, C=0.5)
    assert theory.spectral_tail_probability(eps2, n, s, 16.0, C=0.5) == pytest.approx(delta)
    big = theory.spectral_deviation_bound(n, 2, 16.0, delta, C=0.5)   # the linear branch of min{.,.}
    assert theory.spectral_tail_probability(big, n, 2, 16.0, C=0.5) == pytest.approx(delta)
    assert theory.spectral_expectation_bound(n, 400, 4.0) < theory.spectral_expectation_bound(n, 100, 4.0)
    assert theory.block_size_bound(num_samples=10, sigma=10.0, delta=0.01) == pytest.approx(
        1 + 10 * (3 * math.log(1000) + 2))


@pytest.mark.parametrize("call", [
    lambda: theory.psi(0.0), lambda: theory.psi(float("nan")),
    lambda: theory.block_size_bound(num_samples=10, sigma=1.0, delta=0.5),
    lambda: theory.max_norm_deviation_bound(10, 0, 0.1),
    lambda: theory.samples_for_max_norm(0.0, 10, 0.1),
])
def test_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("n", [1, 2, 97, 500])
def test_norms_match_dense_computation(n):
    sigma = poslsh.alibi_sigmas(4)
    P = poslsh.sample_partitions(sigma, 9, seed=n)
    D = poslsh.alibi.alibi_matrix(n, sigma) - P.dense_mean(n)
    dense_spec = torch.linalg.eigvalsh(D).abs().amax(-1)
    dense_max = D.abs().amax((1, 2))
    errs = theory.mask_error_norms(P, n)
    print("spectral", errs.spectral.tolist(), dense_spec.tolist())
    assert torch.allclose(errs.spectral, dense_spec, rtol=1e-5)
    assert torch.allclose(errs.max, dense_max, rtol=0, atol=1e-12)


def test_instance_stats_and_output_bound():
    n, d = 64, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, n, d, generator=g), torch.randn(2, n, d, generator=g)
    sigma = torch.tensor([4.0, 64.0])
    stats = theory.instance_stats(q, k, sigma, causal=True, row_chunk=7)
    P = torch.softmax((q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf), -1)
    L = poslsh.alibi.alibi_matrix(n, sigma)
    assert torch.allclose(stats.beta_star, (P.double() * L).sum(-1).amin(-1))
    assert torch.allclose(stats.p_2inf, P.double().pow(2).sum(-1).sqrt().amax(-1))
    b = theory.output_error_bound(0.9, 0.3, 1.0, n=n, num_samples=1000, sigma=4.0, delta=0.01, C=1.0)
    C, ok = theory.smallest_constant(b, 0.9, 0.3, 1.0, n=n, num_samples=1000, sigma=4.0, delta=0.01)
    assert ok and C == pytest.approx(1.0)
    assert theory.output_error_bound(0.01, 0.3, 1.0, n=n, num_samples=10, sigma=4.0, delta=0.01) == math.inf


def test_window_theory_is_part_of_theory():
    """poslsh.theory exposes the window's truncation bound (defined in the window's room) next to the paper's bounds."""
    from poslsh.window import theory as window_theory
    for name in ("window_tail_ratio", "window_error_bound", "smallest_window", "logit_range"):
        assert getattr(theory, name) is getattr(window_theory, name) and name in theory.__all__
    # the window a tolerance needs grows like sigma (R + ln 1/tol); positional LSH's s like 1/eps^2
    w = theory.smallest_window(1e-3, torch.tensor([8.0, 64.0]), 5.0)
    assert torch.equal(w, theory.smallest_window(torch.tensor([1e-3, 1e-3]), torch.tensor([8.0, 64.0]), 5.0))
    assert float(w[1]) / float(w[0]) == pytest.approx(8.0, rel=0.02)
