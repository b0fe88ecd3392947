"""Theory for any positional LSH (paper section 5) on 2-D ALiBi and another kernel: eq. (3) at
delta = 1e-3, the dense norms, Theorem 2.2 with Delta'_P, and the exact references."""
import math

import pytest
import torch

import poslsh
from poslsh import theory
from poslsh.widths import GammaWidths
from poslsh.partitions_nd import grid_coords, sample_partitions_nd
from poslsh.reference import (alibi_attention_reference_nd, alibi_bias_nd, alibi_matrix_nd, kernel_attention_nd,
                                 poslsh_attention_reference_nd)
from poslsh.reference import dense_attention


def make_qkv(B, H, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("dist", [GammaWidths(2.0), GammaWidths(3.0)], ids=lambda d: d.name)
def test_eq3_max_norm_bound_at_delta_1e_3(dist):
    """eq. (3): Pr[||L - M~||_max >= eps] <= 2 n^2 exp(-2 s eps^2). At delta = 1e-3 over 60 draws
    per head the bound may fail at most once by chance (P[>= 2 failures] < 0.002); a sampler with the
    wrong kernel exceeds it in most draws (checked below)."""
    coords, delta, s, trials = grid_coords(6, 6), 1e-3, 200, 60
    sigma = torch.tensor([[0.8, 0.8], [2.0, 5.0], [12.0, 12.0]])
    n = coords.shape[0]
    L = poslsh.partitions_nd.expected_mask(coords, sigma, dist)
    eps = theory.max_norm_deviation_bound(n, s, delta)
    worst, fails, wrong = 0.0, 0, 0
    for t in range(trials):
        P = sample_partitions_nd(sigma, s, widths=dist, seed=t)
        err = theory.dense_mask_errors(L, P.dense_mean(coords)).max
        worst = max(worst, err.max().item() / eps)
        fails += int((err >= eps).sum())
        if t < 10:   # the same draws judged against the other Gamma kernel: must violate the bound
            other = poslsh.partitions_nd.expected_mask(coords, sigma, GammaWidths(5.0 - dist.shape))
            wrong += int((theory.dense_mask_errors(other, P.dense_mean(coords)).max >= eps).sum())
    print(f"{dist.name}: eps(delta=1e-3, n={n}, s={s}) = {eps:.4f}; worst ratio {worst:.3f}; violations {fails}/"
          f"{3 * trials}; wrong-kernel violations {wrong}/30")
    assert fails <= 1 and worst < 1.0 + (fails > 0)
    assert wrong >= 15


def test_dense_norms_match_torch():
    coords = grid_coords(5, 7)
    P = sample_partitions_nd([1.0, 4.0], 6, seed=0)
    L, M = P.expected_mean(coords), P.dense_mean(coords)
    errs = theory.dense_mask_errors(L, M)
    assert torch.allclose(errs.spectral, torch.linalg.matrix_norm(L - M, ord=2), rtol=1e-12)
    assert torch.equal(errs.max, (L - M).abs().amax((1, 2)))
    with pytest.raises(ValueError, match=r"\[H, n, n\]"):
        theory.dense_mask_errors(L, M[:, :3])


def test_spectral_error_decays_like_one_over_sqrt_s():
    coords = grid_coords(8, 8)
    L = alibi_matrix_nd(coords, torch.tensor([3.0]))
    means = []
    for s in (10, 1000):
        errs = [theory.dense_mask_errors(L, sample_partitions_nd([3.0], s, seed=100 * s + t).dense_mean(coords))
                .spectral.item() for t in range(6)]
        means.append(sum(errs) / len(errs))
    slope = math.log(means[1] / means[0]) / math.log(100)
    print(f"||L** - M~||: s=10 {means[0]:.3f}, s=1000 {means[1]:.3f}, slope {slope:.3f}")
    assert -0.65 < slope < -0.35


@pytest.mark.parametrize("causal", [False, True])
def test_theorem_2_2_with_delta_p_prime(causal):
    """Deterministic step with the realised eps = ||L** - M~||_max holds for every draw; the
    probabilistic bound with Delta'_P (C from eq. (3): Delta'_P >= eps at confidence 1 - delta)
    holds in every trial."""
    grid, delta, s = (6, 7), 1e-3, 400
    coords = grid_coords(*grid)
    n = coords.shape[0]
    sigma = torch.tensor([6.0, 20.0])
    q, k, v = make_qkv(1, 2, n, 4, seed=1)
    L = alibi_matrix_nd(coords, sigma)
    exact = alibi_attention_reference_nd(q, k, v, 1 / sigma, grid=grid, causal=causal)
    stats = theory.kernel_instance_stats(q[0], k[0], L, causal=causal)
    C = theory.max_norm_deviation_bound(n, s, delta) / theory.delta_p_prime(n, s, delta)
    v_max = v.abs().max().item()
    for t in range(8):
        P = sample_partitions_nd(sigma, s, seed=t)
        approx = poslsh.poslsh_attention_nd(q, k, v, P, grid=grid, causal=causal)
        err = (approx - exact).abs().amax((0, 2, 3))
        eps = theory.dense_mask_errors(L, P.dense_mean(coords)).max
        for h in range(2):
            beta = stats.beta_star[h].item()
            realised = theory.realized_output_error_bound(beta, eps[h].item(), v_max)
            general = theory.general_output_error_bound(beta, v_max, n, s, delta, C)
            if t == 0:
                print(f"head {h} causal={causal}: |T**-T~| {err[h]:.2e} <= realised {realised:.2e} <= "
                      f"Delta'_P bound {general:.2e} (beta* {beta:.3f}, C {C:.3f})")
            assert err[h].item() <= realised <= general < math.inf


def test_delta_p_prime_values_and_checks():
    assert abs(theory.delta_p_prime(100, 25, 0.01, C=2.0) - 2.0 * math.sqrt(math.log(1e4) / 25)) < 1e-15
    assert theory.general_output_error_bound(0.01, 1.0, 100, 1, 0.01) == math.inf
    with pytest.raises(ValueError, match="delta must be in"):
        theory.delta_p_prime(10, 5, 1.5)


def test_alibi_nd_references():
    """2-D ALiBi attention = weights multiplied by exp(-||x - y||_1 / sigma), computed by hand; the
    Gamma(2) kernel attention is the same; with huge s the PosLSH oracle approaches it."""
    grid, n = (4, 5), 20
    q, k, v = make_qkv(2, 2, n, 8, seed=2)
    sigma = torch.tensor([1.5, 6.0], dtype=torch.float64)
    x = grid_coords(*grid).double()
    L = torch.exp(-(x[:, None] - x[None]).abs().sum(-1)[None] / sigma[:, None, None])
    w = torch.exp(torch.einsum("bhid,bhjd->bhij", q, k) / 8 ** 0.5) * L
    by_hand = torch.einsum("bhij,bhjd->bhid", w / w.sum(-1, keepdim=True), v)
    exact = alibi_attention_reference_nd(q, k, v, 1 / sigma, grid=grid)
    assert (exact - by_hand).abs().max().item() < 1e-13
    assert (kernel_attention_nd(q, k, v, sigma, grid=grid) - exact).abs().max().item() < 1e-13
    coords_exact = alibi_attention_reference_nd(q, k, v, 1 / sigma, coords=grid_coords(*grid), causal=True)
    assert (coords_exact - dense_attention(q, k, v, alibi_bias_nd(grid_coords(*grid), 1 / sigma), causal=True)
            ).abs().max().item() < 1e-14
    approx = poslsh_attention_reference_nd(q, k, v, sample_partitions_nd(sigma, 20000, seed=0), grid=grid)
    print(f"s=20000: |T~ - T**|_max = {(approx - exact).abs().max().item():.4f}")
    assert (approx - exact).abs().max().item() < 0.02


def test_reference_one_axis_equals_1d_reference():
    q, k, v = make_qkv(1, 4, 50, 8, seed=3)
    sig = poslsh.alibi_sigmas(4)
    P1, PN = poslsh.sample_partitions(sig, 6, seed=4), sample_partitions_nd(sig, 6, dims=1, seed=4)
    a = poslsh.poslsh_attention_reference(q, k, v, P1, causal=True)
    b = poslsh_attention_reference_nd(q, k, v, PN, coords=torch.arange(50)[:, None], causal=True)
    assert (a - b).abs().max().item() < 1e-14


def test_reference_errors():
    q, k, v = make_qkv(1, 2, 12, 4)
    P = sample_partitions_nd([1.0, 2.0], 2)
    with pytest.raises(ValueError, match="exactly one of coords"):
        poslsh_attention_reference_nd(q, k, v, P)
    with pytest.raises(ValueError, match="coords give 5 tokens but q has seqlen 12"):
        poslsh_attention_reference_nd(q, k, v, P, coords=grid_coords(1, 5))
    with pytest.raises(ValueError, match=r"slopes must be \[H\] or \[H, 2\]"):
        alibi_attention_reference_nd(q, k, v, torch.ones(2, 3), grid=(3, 4))
    with pytest.raises(ValueError, match="got 3 slopes for 2 query heads"):
        alibi_attention_reference_nd(q, k, v, torch.ones(3), grid=(3, 4))
