import math

import pytest
import torch

import poslsh
from poslsh import theory

from inputs import alibi_partitions


@pytest.mark.parametrize("H", [4, 12])
@pytest.mark.parametrize("n", [1, 2, 97, 1025])
def test_blocks_are_contiguous_and_partition_the_sequence(H, n):
    P = alibi_partitions(H, 9, seed=n)
    blk = P.blocks(n)
    ids = P.block_ids(n)
    assert ids.shape == (H, 9, n)
    for h in range(H):
        for t in range(9):
            sel = (blk.head == h) & (blk.sample == t)
            start, length = blk.start[sel], blk.length[sel]
            assert start[0] == 0 and (length > 0).all()
            assert torch.equal(start[1:], (start + length)[:-1]), "blocks must tile [0, n) contiguously"
            assert int((start + length)[-1]) == n
            # block_ids agree with blocks(): constant inside a block, increasing across blocks
            changes = torch.nonzero(torch.diff(ids[h, t])).flatten() + 1
            assert (torch.diff(ids[h, t]) >= 0).all()
            assert torch.equal(changes, start[1:])


def test_dense_count_matches_block_ids():
    P = alibi_partitions(4, 13, seed=1)
    n = 150
    ids = P.block_ids(n)
    brute = (ids[..., :, None] == ids[..., None, :]).sum(1)
    assert torch.equal(P.dense_count(n), brute.int())
    assert torch.allclose(P.dense_mean(n), brute.double() / 13)


def test_hash_matches_definition():
    P = poslsh.sample_partitions(torch.tensor([3.0, 50.0]), 4, seed=5)
    u = torch.arange(40, dtype=torch.float64)
    h = torch.floor((u - P.offsets[..., None]) / P.widths[..., None])
    assert torch.equal(P.block_ids(40), (h - h[..., :1]).long())
    assert ((P.offsets >= 0) & (P.offsets <= P.widths)).all()


def test_seeds_reproduce_and_differ():
    sig = poslsh.alibi_sigmas(8)
    a = poslsh.sample_partitions(sig, 5, seed=123)
    b = poslsh.sample_partitions(sig, 5, generator=torch.Generator().manual_seed(123))
    c = poslsh.sample_partitions(sig, 5, seed=124)
    assert torch.equal(a.widths, b.widths) and torch.equal(a.offsets, b.offsets)
    assert not torch.equal(a.widths, c.widths)
    assert torch.equal(a.to("cpu").widths, a.widths) and a.to("cpu").num_samples == 5


def test_width_distribution_is_gamma_two_sigma():
    P = poslsh.sample_partitions(torch.tensor([7.0]), 200_000, seed=0)
    w = P.widths[0]
    # Gamma(2, sigma): mean 2 sigma, variance 2 sigma^2; 6 standard errors of slack.
    se = math.sqrt(2 * 49 / 200_000)
    print("mean", w.mean().item(), "var", w.var().item())
    assert abs(w.mean().item() - 14.0) < 6 * se
    assert abs(w.var().item() / 98.0 - 1) < 0.05
    u = P.offsets[0] / w
    assert abs(u.mean().item() - 0.5) < 0.01


def test_mean_mask_converges_within_hoeffding_bound():
    n, s, delta = 128, 4000, 1e-3
    sig = poslsh.alibi_sigmas(4)
    P = poslsh.sample_partitions(sig, s, seed=7)
    err = (P.dense_mean(n) - poslsh.alibi.alibi_matrix(n, sig)).abs().amax((1, 2))
    eps = theory.max_norm_deviation_bound(n, s, delta)
    print("max-norm errors", err.tolist(), "eq.(3) bound at delta=1e-3:", eps)
    assert (err < eps).all()
    assert (err > 0).all()


def test_block_size_bound_eq4_holds():
    delta, s, trials, n = 0.01, 10, 300, 4096
    # One draw of trials * s samples; trial r owns samples [r*s, (r+1)*s).
    P = poslsh.sample_partitions(poslsh.alibi_sigmas(4), s * trials, seed=99)
    blk = P.blocks(n)
    key = blk.head * trials + blk.sample // s
    bmax = torch.zeros(4 * trials, dtype=torch.long).scatter_reduce(0, key, blk.length, "amax").view(4, trials)
    bounds = torch.tensor([theory.block_size_bound(num_samples=s, sigma=sg, delta=delta) for sg in P.sigma.tolist()])
    violations = int((bmax > bounds[:, None]).sum())
    print("largest b_max / bound per head:", (bmax / bounds[:, None]).amax(1).tolist(), "violations", violations)
    # Each (trial, head) violates with probability < delta: at most 12 expected of 1200; allow 3x.
    assert violations <= 36
    assert (bmax > 1).all()


def test_max_block_size_and_fixed_blocks():
    F = poslsh.Partitions.fixed_blocks(3, 16)
    assert F.num_samples == 1 and F.sigma is None
    assert F.max_block_size(100) == 16
    ids = F.block_ids(40)
    assert torch.equal(ids[0, 0], torch.arange(40) // 16)
    P = alibi_partitions(4, 6)
    assert P.max_block_size(500) == int(P.blocks(500).length.max())
    assert P.max_block_size(500) <= math.ceil(P.widths.max().item())


@pytest.mark.parametrize("sigma", [[0.0], [-1.0], [float("nan")], [float("inf")], [[1.0, 2.0]]])
def test_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma"):
        poslsh.sample_partitions(torch.tensor(sigma), 3)


@pytest.mark.parametrize("s", [0, -2, 1.5])
def test_bad_num_samples(s):
    with pytest.raises(ValueError, match="num_samples"):
        poslsh.sample_partitions(torch.tensor([1.0]), s)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="seed"):
        poslsh.sample_partitions(torch.tensor([1.0]), 2, seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="block_size"):
        poslsh.Partitions.fixed_blocks(2, 0)
    with pytest.raises(ValueError, match="widths"):
        poslsh.Partitions(torch.ones(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="> 0"):
        poslsh.Partitions(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sequence length"):
        alibi_partitions(2, 2).blocks(0)


@pytest.mark.parametrize("method", ["iid", "grouped"])
def test_to_any_device_including_meta(method):
    """``to`` moves checked values without checking them again: the meta device (no values) works,
    for sampled, grouped and fixed partitions; constructing on meta checks shapes only."""
    P = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 8, seed=0, sampler=method, widths=poslsh.GammaWidths(3.0))
    m = P.to("meta")
    assert m.device.type == "meta" and m.widths.shape == (4, 8) and m.offsets.device.type == "meta"
    assert m.sigma.device.type == "meta" and m.distribution == P.distribution and (m.groups is None) == (method == "iid")
    assert m.to("meta") is m and "meta" in repr(m)
    assert poslsh.Partitions.fixed_blocks(2, 16).to(torch.device("meta")).num_samples == 1
    meta = torch.empty(2, 3, device="meta", dtype=torch.float64)
    assert poslsh.Partitions(meta, meta, torch.ones(2, device="meta")).num_heads == 2
    with pytest.raises(ValueError, match=r"\[H, s\]"):
        poslsh.Partitions(meta, meta[:, :2])
