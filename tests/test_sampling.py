"""Correlated samplers (``sampler="stratified" | "grouped"``): every slot marginally
exact, E[M~] = L*, the lattice count equal to mask-by-mask counting, the group
structure kept, seeds reproducible, the backends exact, the grouped bound valid."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

import poslsh
from poslsh import theory
from poslsh.partitions import Partitions, block_labels, group_count, sample_partitions
from poslsh.reference import poslsh_attention_reference
from poslsh.sampling import group_sizes

METHODS = [("stratified", None), ("grouped", None), ("grouped", "sqrt"), ("grouped", 2)]


@pytest.mark.parametrize("method,k", METHODS)
def test_every_slot_is_marginally_gamma_and_uniform(method, k):
    # R heads with one sigma = R independent draws of the s slots
    R, s, sigma = 3000, 10, 7.0
    P = sample_partitions(torch.full((R,), sigma), s, seed=11, sampler=method, group_size=k)
    worst = []
    for t in range(s):
        b = P.widths[:, t].numpy() / sigma
        v = (P.offsets[:, t] / P.widths[:, t]).numpy()
        pb = stats.kstest(b, stats.gamma(2.0).cdf).pvalue
        pv = stats.kstest(v, "uniform").pvalue
        # c | b ~ U[0, b): v independent of b (chi-square on a 4 x 4 grid of (F(b), v))
        cells = np.histogram2d(stats.gamma(2.0).cdf(b), v, bins=4, range=[[0, 1], [0, 1]])[0]
        pc = stats.chisquare(cells.ravel()).pvalue
        worst.append(min(pb, pv, pc))
        assert ((P.offsets[:, t] >= 0) & (P.offsets[:, t] < P.widths[:, t])).all()
    print(method, k, "smallest p over slots (KS width, KS offset, chi2 joint):", min(worst))
    # 3 tests x 10 slots x 4 configurations, seeded: 1e-4 is a Bonferroni level of about 1%
    assert min(worst) > 1e-4


@pytest.mark.parametrize("method,k", [("grouped", None), ("grouped", "sqrt"), ("stratified", None)])
def test_mean_mask_is_unbiased(method, k):
    n, s, R = 48, 20, 4000        # s = 20: 5 groups of 4 (default), 4 groups of 5 (sqrt), 20 strata
    for sigma in (4.0, 16.0):
        P = sample_partitions(torch.full((R,), sigma), s, seed=3, sampler=method, group_size=k)
        m = P.dense_mean(n)                                  # [R, n, n]: R independent draws of M~
        mean, se = m.mean(0), m.std(0) / math.sqrt(R)
        lstar = poslsh.alibi.alibi_matrix(n, torch.tensor([sigma]))[0]
        use = (lstar > 0.02) & (lstar < 0.98)
        z = ((mean - lstar) / se)[use]
        # and one global statistic: the per-draw average of the used entries (R i.i.d. values)
        avg = m[:, use].mean(1)
        z_avg = float((avg.mean() - lstar[use].mean()) / (avg.std() / math.sqrt(R)))
        print(method, k, f"sigma={sigma}: max |z| {z.abs().max():.2f} over {int(use.sum())} entries, "
              f"z of the average entry {z_avg:+.2f}, largest |mean - L*| {(mean - lstar).abs().max():.4f}")
        assert z.abs().max() < 5.0          # ~2000 correlated entries; 5 standard errors
        assert abs(z_avg) < 4.0


@pytest.mark.parametrize("sigma", [0.4, 3.0, 40.0, 1e4])
@pytest.mark.parametrize("k", [None, "sqrt", 3, 8])
def test_group_count_equals_per_mask_counting(sigma, k):
    n, s = 160, 17
    P = sample_partitions(torch.full((3,), sigma), s, seed=int(sigma * 10) + len(str(k)), sampler="grouped",
                          group_size=k)
    labels = block_labels(P.widths, P.offsets, torch.arange(n, dtype=torch.float64))   # [H, s, n]
    width, origin, size = P.group_lattices()
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    total = torch.zeros(3, n, n, dtype=torch.int64)
    for h in range(3):
        for g in range(P.num_groups):
            lab = labels[h, P.groups[h] == g]                                           # the group's masks
            per_mask = (lab[:, :, None] == lab[:, None, :]).sum(0)
            lattice = group_count(i, j, width[h, g], origin[h, g], size[h, g])
            assert torch.equal(per_mask, lattice), (h, g, float(width[h, g]))
            total[h] += lattice
    assert torch.equal(total, P.dense_count(n).to(torch.int64))


def test_group_count_by_hand():
    # b = 4, k = 2: masks with offsets 1 and 3, lattice 1 + 2Z; (0, 1] holds 1, (1, 2] none
    assert group_count(0, 1, 4.0, 1.0, 2).item() == 1
    assert group_count(1, 2, 4.0, 1.0, 2).item() == 2
    assert group_count(2, 1, 4.0, 1.0, 2).item() == 2          # symmetric
    assert group_count(0, 4, 4.0, 1.0, 2).item() == 0          # j - i >= b
    assert group_count(5, 5, 4.0, 1.0, 2).item() == 2
    P = Partitions(torch.tensor([[4.0, 4.0]]), torch.tensor([[1.0, 3.0]]), groups=torch.tensor([[0, 0]]))
    assert torch.equal(P.dense_count(3), torch.tensor([[[2, 1, 1], [1, 2, 2], [1, 2, 2]]], dtype=torch.int32))


def test_group_sizes_and_structure():
    assert group_sizes(20, "grouped") == [4] * 5                      # default: groups of at most 4
    assert group_sizes(20, "grouped", "sqrt") == [5, 5, 5, 5]         # G = round(sqrt(20)) = 4
    assert group_sizes(10, "grouped") == group_sizes(10, "grouped", "sqrt") == [4, 3, 3]
    assert group_sizes(100, "grouped", "sqrt") == [10] * 10 and group_sizes(100, "grouped") == [4] * 25
    assert group_sizes(5, "grouped", 4) == [3, 2]                     # never fewer than two groups
    assert group_sizes(4, "grouped", 8) == [2, 2]
    assert group_sizes(1, "grouped") == [1]
    assert group_sizes(6, "stratified") == [1] * 6
    P = sample_partitions(poslsh.alibi_sigmas(4), 20, seed=0, sampler="grouped", group_size=4)
    assert P.num_groups == 5 and P.effective_groups() == 5.0
    assert (P.group_sizes() == 4).all()
    assert sample_partitions(poslsh.alibi_sigmas(2), 9, seed=0, sampler="stratified").effective_groups() == 9
    iid = sample_partitions(poslsh.alibi_sigmas(2), 9, seed=0)
    assert iid.groups is None and iid.num_groups == 9 and iid.effective_groups() == 9
    # one width per group, from its own quantile stratum: group g's widths increase with g
    w, _, _ = P.group_lattices()
    assert (w[:, 1:] > w[:, :-1]).all()


def test_seeds_reproduce_and_structure_survives_to_and_slicing():
    sig = poslsh.alibi_sigmas(6)
    a = sample_partitions(sig, 10, seed=5, sampler="grouped")
    b = sample_partitions(sig, 10, generator=torch.Generator().manual_seed(5), sampler="grouped")
    c = sample_partitions(sig, 10, seed=6, sampler="grouped")
    assert a == b and a is not b and a != c
    assert a != sample_partitions(sig, 10, seed=5)                     # iid: a different draw
    assert a.to("cpu") is a and a.to(torch.device("cpu")).groups is a.groups
    one = a.select_heads([1, 3])
    assert one.num_heads == 2 and torch.equal(one.groups, a.groups[[1, 3]]) and torch.equal(one.sigma, sig[[1, 3]])
    assert hash(a) == hash(b)
    # built from tensors as before (HF / serialisation code): no groups, still valid
    plain = Partitions(a.widths, a.offsets, a.sigma)
    assert plain.groups is None and plain != a
    assert Partitions(a.widths, a.offsets, a.sigma, a.groups) == a


def test_bad_arguments_are_one_line_errors():
    sig = torch.tensor([2.0])
    for kwargs, word in [(dict(sampler="sobol"), "sampler"), (dict(sampler="iid", group_size=4), "group_size"),
                         (dict(sampler="grouped", group_size=0), "group_size"),
                         (dict(sampler="grouped", group_size=2.5), "group_size"),
                         (dict(sampler="grouped", group_size="cubic"), "group_size")]:
        with pytest.raises(ValueError, match=word) as e:
            sample_partitions(sig, 4, **kwargs)
        assert "\n" not in str(e.value)
    w = torch.tensor([[4.0, 4.0, 5.0]])
    with pytest.raises(ValueError, match="share one width"):
        Partitions(w, torch.tensor([[1.0, 3.0, 1.0]]), groups=torch.tensor([[0, 0, 0]]))
    with pytest.raises(ValueError, match="lattice"):
        Partitions(w[:, :2], torch.tensor([[1.0, 2.5]]), groups=torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="0..G-1"):
        Partitions(w[:, :2], torch.tensor([[1.0, 3.0]]), groups=torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="integer tensor"):
        Partitions(w[:, :2], torch.tensor([[1.0, 3.0]]), groups=torch.tensor([[0.0, 0.0]]))


@pytest.mark.parametrize("causal", [True, False])
def test_torch_backend_matches_float64_oracle_on_grouped(causal):
    H, n, d = 4, 300, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    for method, size in [("grouped", None), ("grouped", 4), ("stratified", None)]:
        P = sample_partitions(poslsh.alibi_sigmas(H), 10, seed=1, sampler=method, group_size=size)
        out = poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch")
        ref = poslsh_attention_reference(q, k, v, P, causal=causal)
        err = float((out - ref).abs().max())
        print(f"{method} k={size} causal={causal}: |torch - float64 oracle|max = {err:.2e}")
        assert err < 1e-12


def test_grouped_bound_holds_and_iid_bound_is_kept():
    n, delta, s = 96, 0.05, 20
    sig = poslsh.alibi_sigmas(4)
    iid = sample_partitions(sig, s, seed=0)
    assert theory.max_norm_bound_for(iid, n, delta) == theory.max_norm_deviation_bound(n, s, delta)
    strat = sample_partitions(sig, s, seed=0, sampler="stratified")
    assert theory.max_norm_bound_for(strat, n, delta) == pytest.approx(theory.max_norm_deviation_bound(n, s, delta))
    G = sample_partitions(sig, s, seed=0, sampler="grouped", group_size=4).effective_groups()
    eps = theory.grouped_max_norm_deviation_bound(n, G, delta)
    assert theory.grouped_max_norm_tail_probability(eps, n, G) == pytest.approx(delta)
    assert eps > theory.max_norm_deviation_bound(n, s, delta)            # fewer independent terms: weaker
    worst = 0.0
    for t in range(30):
        P = sample_partitions(sig, s, seed=100 + t, sampler="grouped", group_size=4)
        err = theory.max_norm_error(P, n)
        worst = max(worst, float(err.max()) / theory.max_norm_bound_for(P, n, delta))
    print(f"grouped s={s}, G={G}: largest ||L*-M~||max / bound over 30 draws x 4 heads = {worst:.3f}")
    assert worst < 1.0
    with pytest.raises(ValueError, match="groups"):
        theory.grouped_max_norm_deviation_bound(n, 0.5, delta)


def test_gamma2_quantile_equals_scipy():
    """The grouped sampler's inverse CDF is plain torch (the library needs no scipy); scipy checks it."""
    special = pytest.importorskip("scipy.special")
    from poslsh.sampling import gamma2_quantile
    u = torch.cat([torch.tensor([0.0, 1e-300, 1e-30, 1e-12, 1e-6, 0.5, 1 - 1e-6, 1 - 1e-12, 1 - 2 ** -53],
                                dtype=torch.float64),
                   torch.rand(10000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))])
    got = gamma2_quantile(u)
    want = torch.from_numpy(special.gammaincinv(2.0, u.numpy()))
    rel = ((got - want).abs() / want.clamp_min(1e-300)).max()
    print("max relative difference", float(rel))
    assert float(rel) < 1e-13 and float(got[0]) == 0.0
    assert torch.isinf(gamma2_quantile(torch.tensor([1.0], dtype=torch.float64))).all()


# ------------------------------------------------------------ width distributions
WIDTHS = [poslsh.GammaWidths(1.0), poslsh.GammaWidths(3.5), poslsh.FixedWidth(2.5)]


def test_default_widths_are_gamma2_bit_for_bit():
    sig = poslsh.alibi_sigmas(4)
    for method, k in [("iid", None)] + METHODS:
        a = sample_partitions(sig, 9, seed=2, sampler=method, group_size=k)
        b = sample_partitions(sig, 9, seed=2, sampler=method, group_size=k, widths=poslsh.GammaWidths(2.0))
        assert a == b and a.distribution == poslsh.GammaWidths()
    # built from tensors with a sigma: the widths are Gamma(2) unless told otherwise
    assert Partitions(a.widths, a.offsets, a.sigma).distribution == poslsh.GammaWidths()
    assert Partitions.fixed_blocks(2, 4).distribution is None


@pytest.mark.parametrize("method", ["iid", "stratified", "grouped"])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: w.name)
def test_widths_give_their_kernel_exactly(widths, method):
    """E[M~] = k(|i - j|) for every sampler and width law: the mean over R independent draws of M~
    is within 5 standard errors of expected_mean (the kernel) where 0.02 < k < 0.98 (rarer events make
    the empirical standard error unreliable), within
    5 sqrt(k (1 - k) / R) everywhere (Var M~ <= k (1 - k) for any [0, 1] variable of mean k), and
    exactly equal where k is 0 or 1 (outside the triangle kernel's support, on the diagonal)."""
    R, n, s, sigma = 2000, 30, 8, 3.0
    P = sample_partitions(torch.full((R,), sigma), s, seed=7, sampler=method, widths=widths)
    assert P.distribution == widths and (P.groups is None) == (method == "iid")
    L = P.select_heads([0]).expected_mean(n)[0]              # every head has the same sigma
    M = P.dense_mean(n)
    mean, se = M.mean(0), M.std(0) / math.sqrt(R)
    use = (L > 0.02) & (L < 0.98)
    z = ((mean - L).abs() / se)[use]
    print(f"{widths.name} {method}: max |z| {z.max().item():.2f} over {int(use.sum())} entries")
    assert z.max().item() < 5.0
    assert bool(((mean - L).abs() <= 5 * (L * (1 - L) / R).sqrt()).all())
    edge = (L == 0) | (L == 1)
    assert torch.equal(mean[edge], L[edge]) and int(edge.sum()) >= n
    # the kernel matrix is the one of expected_mask (N-D, one axis), and ALiBi's for Gamma(2)
    few = P.select_heads([0, 1])
    assert torch.equal(few.expected_mean(n), poslsh.partitions_nd.expected_mask(torch.arange(n)[:, None], few.sigma, widths))


def test_gamma2_expected_mean_is_alibi():
    P = sample_partitions(poslsh.alibi_sigmas(4), 3, seed=0)
    assert (P.expected_mean(64) - poslsh.alibi.alibi_matrix(64, P.sigma)).abs().max().item() < 1e-15
    with pytest.raises(ValueError, match="E\\[M\\] = M"):
        Partitions.fixed_blocks(2, 4).expected_mean(10)


@pytest.mark.parametrize("method", ["stratified", "grouped"])
def test_stratified_gamma_widths_are_marginally_exact(method):
    R, s, m = 3000, 6, 3.5
    P = sample_partitions(torch.full((R,), 2.0), s, seed=13, sampler=method, widths=poslsh.GammaWidths(m))
    p = min(stats.kstest(P.widths[:, t].numpy() / 2.0, stats.gamma(m).cdf).pvalue for t in range(s))
    print(method, "smallest KS p over slots", p)
    assert p > 1e-3


def test_fixed_widths_in_groups_are_shifted_grids():
    P = sample_partitions(torch.tensor([2.0, 5.0]), 8, seed=0, sampler="grouped", widths=poslsh.FixedWidth(3.0))
    assert torch.equal(P.widths, torch.tensor([[6.0] * 8, [15.0] * 8], dtype=torch.float64))
    width, origin, size = P.group_lattices()
    assert (size == 4).all() and torch.equal(width, P.widths[:, :2])


@pytest.mark.parametrize("m", [0.3, 0.5, 1.0, 1.5, 3.0, 7.5, 40.0])
def test_gamma_quantile_equals_scipy(m):
    special = pytest.importorskip("scipy.special")
    from poslsh.widths import gamma_quantile
    u = torch.cat([torch.tensor([1e-30, 1e-12, 1e-6, 0.5, 1 - 1e-6, 1 - 1e-12], dtype=torch.float64),
                   torch.rand(2000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))])
    got = gamma_quantile(m, u)
    want = torch.from_numpy(special.gammaincinv(m, u.numpy()))
    rel = float(((got - want).abs() / want).max())
    print(f"Gamma({m}) quantile: max relative difference {rel:.1e}")
    # torch.special.gammainc (the CDF it inverts) is ~1e-14 accurate for small shapes, ~1e-9 for large
    assert rel < (1e-12 if m < 10 else 1e-8)
    edge = gamma_quantile(m, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert edge[0] == 0.0 and torch.isinf(edge[1])


def test_widths_without_a_quantile_are_iid_only():
    class Uniform:                       # a user's distribution: draws and a kernel, no quantile
        name = "uniform(1, 3)"

        def draw(self, sigma, generator):
            u = torch.rand(2, *sigma.shape, dtype=torch.float64, generator=generator)
            w = sigma * (1 + 2 * u[0])
            return w, u[1] * w

        def kernel(self, delta, sigma):
            raise NotImplementedError

    P = sample_partitions(torch.tensor([1.0, 2.0]), 5, seed=0, widths=Uniform())
    assert P.widths.shape == (2, 5) and bool((P.widths >= 1).all())
    with pytest.raises(ValueError, match=r"sampler='grouped' stratifies widths through their quantile function, "
                                         r"which widths=uniform\(1, 3\) does not have: use sampler='iid'") as e:
        sample_partitions(torch.tensor([1.0]), 5, sampler="grouped", widths=Uniform())
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="widths must be a width distribution"):
        sample_partitions(torch.tensor([1.0]), 5, widths="gamma")


def test_alibi_theory_refuses_other_widths():
    P = sample_partitions(torch.tensor([4.0]), 4, seed=0, widths=poslsh.FixedWidth(2.0))
    with pytest.raises(ValueError, match=r"L\* is ALiBi's kernel \(Gamma\(2\) widths\) but these widths are fixed\(2\)"):
        theory.max_norm_error(P, 16)
