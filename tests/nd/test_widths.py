"""Width distributions: the closed-form kernels against quadrature, and against the empirical
mean of many draws (Monte Carlo within its standard error): E[M] = k, in 1-D and on a grid."""
import math

import pytest
import torch

import poslsh
from poslsh.widths import FixedWidth, GammaWidths, kernel_by_quadrature
from poslsh.partitions_nd import expected_mask, grid_coords, sample_partitions_nd

DISTRIBUTIONS = [GammaWidths(0.5), GammaWidths(1.0), GammaWidths(2.0), GammaWidths(3.5), GammaWidths(6.0),
                 FixedWidth(3.0)]


@pytest.mark.parametrize("m", [0.5, 1.0, 1.5, 2.0, 3.0, 7.5])
def test_closed_form_matches_quadrature(m):
    dist = GammaWidths(m)
    deltas = torch.tensor([0.0, 0.01, 0.3, 1.0, 2.5, 7.0, 30.0], dtype=torch.float64)
    closed = dist.kernel(deltas, 2.0)
    quad = torch.tensor([kernel_by_quadrature(dist, float(d), 2.0) for d in deltas], dtype=torch.float64)
    err = (closed - quad).abs().max().item()
    print(f"Gamma({m}): max |closed form - quadrature| = {err:.2e}")
    assert err < 1e-9
    assert closed[0] == 1.0 and bool((closed[1:] < closed[:-1]).all())      # k(0) = 1, decreasing


def test_gamma2_is_the_laplacian_and_fixed_is_the_triangle():
    d = torch.arange(0, 40, dtype=torch.float64) / 3
    lap = (GammaWidths(2.0).kernel(d, 4.0) - torch.exp(-d / 4.0)).abs().max().item()
    tri = (FixedWidth(2.0).kernel(d, 3.0) - (1 - d / 6.0).clamp(min=0)).abs().max().item()
    print(f"Gamma(2) vs exp(-d/sigma): {lap:.1e}; fixed vs triangle: {tri:.1e}")
    assert lap < 1e-14 and tri == 0.0


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.name)
def test_monte_carlo_collision_rate_matches_kernel_1d(dist):
    """Over s = 20000 draws, the fraction of samples in which positions 0 and delta share a bin is
    within 4.5 standard errors of k(delta) for every delta (a wrong kernel is off by 10+ SE)."""
    s, sigma = 20000, 2.5
    parts = sample_partitions_nd([sigma], s, dims=1, widths=dist, seed=11)
    labels = parts.labels(torch.arange(13)[:, None])[0, :, :, 0]           # [s, 13]
    emp = (labels == labels[:, :1]).double().mean(0)
    k = dist.kernel(torch.arange(13, dtype=torch.float64), sigma)
    se = (k * (1 - k) / s).sqrt().clamp_min(1e-12)
    z = ((emp - k).abs() / se)[1:]
    print(f"{dist.name}: k = {[round(x, 4) for x in k.tolist()[:6]]}..., max |z| = {z.max().item():.2f}")
    assert z.max().item() < 4.5
    mean_w = parts.widths.mean().item()
    sd = parts.widths.std().item() / math.sqrt(s)
    print(f"  mean width {mean_w:.4f} vs {float(dist.mean_width(sigma)):.4f} (se {sd:.4f})")
    assert abs(mean_w - float(dist.mean_width(sigma))) < 4.5 * sd + 1e-12


@pytest.mark.parametrize("dist", [GammaWidths(2.0), GammaWidths(1.5)], ids=lambda d: d.name)
def test_monte_carlo_box_mask_matches_product_kernel_2d(dist):
    """E[M] on a grid with per-axis sigma: the empirical M~ of 4000 draws is within 5 SE of
    prod_a k(|x_a - y_a|; sigma_a) at every one of the n^2 entries (2-D ALiBi for Gamma(2))."""
    s = 4000
    sigma = torch.tensor([[1.5, 4.0], [3.0, 3.0]], dtype=torch.float64)      # [H, D]: anisotropic and isotropic
    coords = grid_coords(5, 6)
    parts = sample_partitions_nd(sigma, s, widths=dist, seed=5)
    M, L = parts.dense_mean(coords), parts.expected_mean(coords)
    se = (L * (1 - L) / s).sqrt()
    z = ((M - L).abs() / se.clamp_min(1e-12))[se > 0]
    print(f"{dist.name}: max |M~ - E[M]| = {(M - L).abs().max().item():.4f}, max |z| = {z.max().item():.2f}")
    assert z.max().item() < 5.0
    if dist.shape == 2.0:   # exactly 2-D ALiBi: exp(-sum_a |dx_a| / sigma_a)
        x = coords.double()
        l1 = ((x[:, None] - x[None]).abs()[None] / sigma[:, None, None, :]).sum(-1)
        assert (L - torch.exp(-l1)).abs().max().item() < 1e-14


def test_box_count_is_per_sample_not_a_product_of_axes():
    """count = #samples in which BOTH axes agree; the product of per-axis counts (over s) differs."""
    coords = grid_coords(4, 4)
    parts = sample_partitions_nd([2.0], 6, seed=3)
    M = parts.dense_mean(coords)[0]
    lab = parts.labels(coords)[0]                                            # [s, n, 2]
    same = (lab[:, :, None, :] == lab[:, None, :, :])                        # [s, n, n, 2]
    brute = same.all(-1).double().mean(0)
    product = same[..., 0].double().mean(0) * same[..., 1].double().mean(0)
    print(f"|M~ - brute| = {(M - brute).abs().max().item():.1e}, |M~ - product of axes| = "
          f"{(M - product).abs().max().item():.3f}")
    assert torch.equal(M, brute)
    assert (M - product).abs().max().item() > 0.05


def test_expected_mask_default_is_alibi():
    coords = torch.tensor([[0, 0], [2, 5], [7, 1]])
    L = expected_mask(coords, torch.tensor([3.0]))
    assert abs(L[0, 1, 2].item() - math.exp(-(5 + 4) / 3.0)) < 1e-15


@pytest.mark.parametrize("bad,match", [(0.0, "shape must be a finite number > 0"), (-1, "> 0"),
                                       (float("nan"), "> 0"), (True, "> 0")])
def test_bad_shapes_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        GammaWidths(bad)
    with pytest.raises(ValueError, match="FixedWidth.width"):
        FixedWidth(0)


def test_non_integer_shape_is_seeded_and_reproducible():
    a = sample_partitions_nd([2.0, 5.0], 50, widths=GammaWidths(2.5), seed=1)
    b = sample_partitions_nd([2.0, 5.0], 50, widths=GammaWidths(2.5), seed=1)
    assert torch.equal(a.widths, b.widths) and torch.equal(a.offsets, b.offsets)
    assert bool((a.offsets >= 0).all()) and bool((a.offsets <= a.widths).all())
    assert poslsh.widths.GammaWidths is GammaWidths
