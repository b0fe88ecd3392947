"""The N-D sampler: seeded, one geometry per axis shared with the 1-D sampler, consistent ids,
labels and box bounds, and clear errors for bad coordinates and sigma shapes."""
import pytest
import torch

import poslsh
from poslsh.partitions import hash_positions
from poslsh.partitions_nd import (PartitionsND, check_coords, grid_coords, sample_partitions_nd)


def test_one_axis_reproduces_the_1d_sampler():
    sigma = poslsh.alibi_sigmas(8)
    p1 = poslsh.sample_partitions(sigma, 7, seed=42)
    pn = sample_partitions_nd(sigma, 7, dims=1, seed=42)
    assert torch.equal(p1.widths, pn.widths[..., 0]) and torch.equal(p1.offsets, pn.offsets[..., 0])
    ids = pn.block_ids(torch.arange(300)[:, None])
    assert torch.equal(ids - ids[..., :1], p1.block_ids(300) - p1.block_ids(300)[..., :1])


def test_axis_view_and_seeds():
    p = sample_partitions_nd(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5, seed=0)
    q = sample_partitions_nd(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5, seed=0)
    r = sample_partitions_nd(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5, seed=1)
    assert torch.equal(p.widths, q.widths) and not torch.equal(p.widths, r.widths)
    assert p.widths.shape == (2, 5, 2) and p.widths.dtype == torch.float64 and p.sigma.shape == (2, 2)
    ax = p.axis(1)
    assert isinstance(ax, poslsh.Partitions) and torch.equal(ax.widths, p.widths[:, :, 1])
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_partitions_nd(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5, generator=g).widths, p.widths)


def test_grid_coords_raster_order():
    c = grid_coords(3, 4)
    assert c.shape == (12, 2) and c.dtype == torch.int64
    assert c[5].tolist() == [1, 1] and c[11].tolist() == [2, 3]
    assert torch.equal(c[:, 0] * 4 + c[:, 1], torch.arange(12))


@pytest.mark.parametrize("coords", [grid_coords(7, 13), grid_coords(1, 17), torch.tensor([[3, 0, 9], [0, 4, 1],
                                                                                          [8, 8, 8], [3, 1, 9]])])
def test_ids_labels_and_boxes_agree_with_the_hash(coords):
    D = coords.shape[1]
    p = sample_partitions_nd(torch.tensor([0.6, 2.0, 9.0]), 4, dims=D, seed=D)
    ids, lab = p.block_ids(coords), p.labels(coords)
    x = coords.double()
    for h in range(3):
        for t in range(4):
            w, c = p.widths[h, t], p.offsets[h, t]
            # brute force: the same box iff the raw hash agrees on every axis (widths <= 1: the coordinate)
            key = torch.stack([torch.where(w[a] <= 1, x[:, a], hash_positions(x[:, a], w[a], c[a]))
                               for a in range(D)], 1)
            same = (key[:, None] == key[None]).all(-1)
            assert torch.equal(same, ids[h, t, :, None] == ids[h, t, None, :])
            assert torch.equal(same, (lab[h, t, :, None] == lab[h, t, None, :]).all(-1))
    lo, hi = p.block_bounds(None, coords)
    inside = ((coords[None, None, None] >= lo[:, :, :, None]) & (coords[None, None, None] < hi[:, :, :, None])).all(-1)
    # a token's box holds exactly the tokens sharing its id (on a full grid: every cell of the box)
    assert torch.equal(inside, ids[..., :, None] == ids[..., None, :])


def test_fixed_blocks():
    p = PartitionsND.fixed_blocks(2, (3, 4))
    c = grid_coords(7, 9)
    ids = p.block_ids(c)
    expect = (c[:, 0] // 3) * 10 + c[:, 1] // 4
    assert torch.equal(ids[0, 0][:, None] == ids[0, 0][None], expect[:, None] == expect[None])
    assert p.max_block_size(c) == 12
    with pytest.raises(ValueError, match="E\\[M\\] = M"):
        p.expected_mean(c)


def test_dense_mean_and_count():
    c = grid_coords(4, 5)
    p = sample_partitions_nd([1.0, 6.0], 9, seed=2)
    cnt = p.dense_count(c)
    assert cnt.dtype == torch.int32 and cnt.shape == (2, 20, 20)
    assert bool((cnt.diagonal(dim1=1, dim2=2) == 9).all()) and torch.equal(cnt, cnt.transpose(1, 2))
    assert torch.allclose(p.dense_mean(c), cnt.double() / 9)


BAD_COORDS = [
    (torch.arange(5), ValueError, r"coords must have shape \[n, D\]"),
    (torch.zeros(0, 2, dtype=torch.long), ValueError, "n >= 1"),
    (torch.tensor([[0.5, 1.0]]), ValueError, "coords must be integers"),
    (torch.tensor([[float("nan"), 1.0]]), ValueError, "coords must be integers"),
    (torch.tensor([[-1, 2]]), ValueError, r"coords must be >= 0 .*subtract coords.min\(0\)"),
    (torch.tensor([[True, False]]), TypeError, "coords must hold integers"),
    ([[0, 1]], TypeError, "coords must be a torch.Tensor"),
    (torch.zeros(4, 3, dtype=torch.long), ValueError, r"coords have D=3 axes but the partitions have 2"),
]


@pytest.mark.parametrize("coords,exc,match", BAD_COORDS)
def test_bad_coordinates_fail_with_one_clear_line(coords, exc, match):
    p = sample_partitions_nd([2.0], 2, seed=0)
    with pytest.raises(exc, match=match) as err:
        p.block_ids(coords)
    print(err.value)
    assert "\n" not in str(err.value)


def test_float_integer_coordinates_are_accepted():
    assert check_coords(torch.tensor([[1.0, 2.0]])).dtype == torch.int64


BAD_SIGMA = [
    (dict(sigma=torch.ones(4, 3), dims=2), ValueError, r"sigma has 3 per-axis bandwidths per head but dims=2"),
    (dict(sigma=torch.ones(4, 2, 1)), ValueError, r"sigma must be \[H\] .* or \[H, D\]"),
    (dict(sigma=torch.tensor([1.0, -2.0])), ValueError, "every sigma must be finite and > 0"),
    (dict(sigma=torch.tensor([1.0, float("inf")])), ValueError, "every sigma must be finite and > 0"),
    (dict(sigma="wide"), TypeError, "sigma must be a tensor"),
    (dict(sigma=[1.0], dims=0), ValueError, "dims must be an int >= 1"),
    (dict(sigma=[1.0], num_samples=0), ValueError, "num_samples must be an int >= 1"),
    (dict(sigma=[1.0], seed=1.5), TypeError, "seed must be an int"),
    (dict(sigma=[1.0], widths="gamma"), TypeError, "widths must be a width distribution of poslsh.widths"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_SIGMA)
def test_bad_sigma_shapes_fail_with_one_clear_line(kwargs, exc, match):
    kwargs = {"num_samples": 3, **kwargs}
    sigma = kwargs.pop("sigma")
    with pytest.raises(exc, match=match) as err:
        sample_partitions_nd(sigma, kwargs.pop("num_samples"), **kwargs)
    print(err.value)
    assert "\n" not in str(err.value)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"\[H, s, D\]"):
        PartitionsND.from_tensors(torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"PartitionsND.from_tensors\(widths, offsets, sigma\)"):
        PartitionsND(torch.ones(2, 3, 2), torch.zeros(2, 3, 2))        # the tensor form has its own name
    with pytest.raises(ValueError, match="block_size must be a tuple of ints >= 1"):
        PartitionsND.fixed_blocks(2, (0, 3))
    with pytest.raises(ValueError, match="axis must be an int in"):
        sample_partitions_nd([1.0], 2).axis(2)
    with pytest.raises(ValueError, match=r"grid must be \(height, width\)"):
        grid_coords(0, 3)


def test_partitions_nd_is_d_partitions():
    """Built from per-axis Partitions: the views stack them; to, select_heads, equality and the
    checks are theirs, axis by axis."""
    rows = poslsh.sample_partitions(torch.tensor([1.0, 5.0, 9.0]), 4, seed=1)
    cols = poslsh.sample_partitions(torch.tensor([2.0, 3.0, 4.0]), 4, seed=2, sampler="grouped",
                                    widths=poslsh.GammaWidths(3.0))
    P = PartitionsND([rows, cols])
    assert P.axes == (rows, cols) and P.axis(0) is rows and P.dims == 2 and P.num_heads == 3 and P.num_samples == 4
    assert torch.equal(P.widths, torch.stack([rows.widths, cols.widths], -1))
    assert torch.equal(P.offsets[..., 1], cols.offsets) and torch.equal(P.sigma, torch.tensor([[1.0, 2], [5, 3], [9, 4]]))
    assert P == PartitionsND((rows, cols)) and P != PartitionsND([cols, rows]) and hash(P) == hash(PartitionsND([rows, cols]))
    assert P.to("cpu") is P
    sub = P.select_heads([2, 0])
    assert sub.axes == (rows.select_heads([2, 0]), cols.select_heads([2, 0])) and torch.equal(sub.axes[1].groups,
                                                                                          cols.groups[[2, 0]])
    with pytest.raises(ValueError, match="the axes have different width distributions"):
        P.distribution
    assert "gamma(2), gamma(3)" in repr(P) and "groups per axis" in repr(P)
    # E[M] is the product of each axis's own kernel
    c = grid_coords(3, 4)
    x = c.double()
    want = torch.exp(-(x[:, None, 0] - x[None, :, 0]).abs() / rows.sigma[:, None, None]) * \
        poslsh.GammaWidths(3.0).kernel((x[:, None, 1] - x[None, :, 1]).abs()[None], cols.sigma[:, None, None])
    assert (P.expected_mean(c) - want).abs().max().item() < 1e-14
    # the tensor form goes through the same per-axis checks
    assert PartitionsND.from_tensors(P.widths, P.offsets, P.sigma).axes[0] == rows
    with pytest.raises(ValueError, match="partition widths must be > 0"):
        PartitionsND.from_tensors(-P.widths, P.offsets, P.sigma)


@pytest.mark.parametrize("axes,match", [
    (lambda r: [r, r.select_heads([0])], "axis 1 has 1 heads x 4 samples on cpu but axis 0 has 3 x 4"),
    (lambda r: [r, poslsh.Partitions(r.widths, r.offsets)], "mixing sampled and fixed axes"),
    (lambda r: [], "non-empty sequence of poslsh.Partitions"),
    (lambda r: [r.widths], "non-empty sequence of poslsh.Partitions"),
])
def test_inconsistent_axes_fail_with_one_line(axes, match):
    rows = poslsh.sample_partitions(torch.tensor([1.0, 5.0, 9.0]), 4, seed=1)
    with pytest.raises((ValueError, TypeError), match=match) as err:
        PartitionsND(axes(rows))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["stratified", "grouped"])
def test_correlated_boxes_are_unbiased(method):
    """Stratified / grouped per axis: every box still has E[M] = prod_a k_a (R replicas, 5 SE)."""
    R, s = 1500, 8
    coords = grid_coords(4, 5)
    P = sample_partitions_nd(torch.tensor([[1.5, 4.0]]).expand(R, 2), s, seed=4, sampler=method)
    assert all(a.groups is not None for a in P.axes)
    M = P.dense_mean(coords)
    L = P.expected_mean(coords[:, :])[0]
    mean, se = M.mean(0), M.std(0) / R ** 0.5
    use = se > 1e-9
    z = ((mean - L).abs() / se)[use]
    print(f"{method}: max |z| {z.max().item():.2f} over {int(use.sum())} entries")
    assert z.max().item() < 5.0 and torch.equal(mean[~use], L[~use])


def test_one_axis_reproduces_the_1d_sampler_for_every_method_and_width():
    sig = poslsh.alibi_sigmas(4)
    for kwargs in [dict(sampler="grouped"), dict(sampler="stratified", widths=poslsh.FixedWidth(2.0)),
                   dict(widths=poslsh.GammaWidths(3.0))]:
        pn = sample_partitions_nd(sig, 6, dims=1, seed=3, **kwargs)
        assert pn.axes[0] == poslsh.sample_partitions(sig, 6, seed=3, **kwargs)


def test_to_meta_and_back_shapes():
    P = sample_partitions_nd(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 5, seed=0, sampler="grouped")
    m = P.to("meta")
    assert m.device.type == "meta" and m.widths.shape == (2, 5, 2) and all(a.device.type == "meta" for a in m.axes)
    assert m.axes[0].groups.device.type == "meta" and "meta" in repr(m)
    assert PartitionsND.fixed_blocks(2, (3, 3)).to("meta").to("meta").dims == 2
