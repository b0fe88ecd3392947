"""The near-linear 2-D attention against the one oracle (dense float64 M~ reference): forward
and gradients on awkward grids, batch > 1, GQA, raster-causal; plus gradcheck, chunking, the
underflow fallback, near-linear work and clear errors."""
import pytest
import torch

import poslsh
from poslsh.attention import poslsh_attention_nd
from poslsh.ops.torch import grid as torch_grid
from poslsh.partitions_nd import PartitionsND, grid_coords, sample_partitions_nd
from poslsh.reference import poslsh_attention_reference_nd

GRIDS = [(1, 1), (1, 17), (17, 1), (7, 13), (32, 32)]
SIGMA = torch.tensor([[0.6, 0.6], [2.0, 5.0], [6.0, 1.5], [40.0, 40.0]], dtype=torch.float64)   # per axis


def make_qkv(B, Hq, Hkv, n, d, dv=None, seed=0, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(B, h, n, e, generator=g, dtype=dtype) for h, e in ((Hq, d), (Hkv, d), (Hkv, dv or d))]
    return [t.requires_grad_(requires_grad) for t in out]


def rel_err(a, b):
    """max |a - b| relative to max |b|, absolute below 1 (a 1x1 grid has exactly zero dq, dk)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_forward_and_grads_match_the_dense_oracle(grid, causal):
    n = grid[0] * grid[1]
    q, k, v = make_qkv(2, 4, 2, n, 8, dv=6, seed=n, requires_grad=True)
    P = sample_partitions_nd(SIGMA, 5, seed=n)
    out = poslsh_attention_nd(q, k, v, P, grid=grid, causal=causal)
    ref = poslsh_attention_reference_nd(q, k, v, P, grid=grid, causal=causal)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    errs = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(g_fast, g_ref)]
    print(f"grid {grid[0]}x{grid[1]} causal={causal}: rel err out {errs[0]:.1e}, dq/dk/dv "
          f"{errs[1]:.1e} {errs[2]:.1e} {errs[3]:.1e}")
    assert out.shape == (2, 4, n, 6) and out.dtype == torch.float64
    assert max(errs) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_tiny(causal):
    q, k, v = make_qkv(2, 2, 1, 6, 3, seed=4, requires_grad=True)
    P = sample_partitions_nd([1.0, 3.0], 3, seed=2)
    assert torch.autograd.gradcheck(lambda q, k, v: poslsh_attention_nd(q, k, v, P, grid=(2, 3), causal=causal), (q, k, v))


def test_float32_close_to_float64_oracle():
    q, k, v = make_qkv(2, 4, 4, 7 * 13, 16, dtype=torch.float32)
    P = sample_partitions_nd(SIGMA, 10, seed=0)
    out = poslsh_attention_nd(q, k, v, P, grid=(7, 13))
    ref = poslsh_attention_reference_nd(q.double(), k.double(), v.double(), P, grid=(7, 13))
    print(f"float32 vs float64 oracle: rel err {rel_err(out.double(), ref):.1e}")
    assert out.dtype == torch.float32 and rel_err(out.double(), ref) < 1e-5


def test_estimator_is_sum_of_numerators_over_sum_of_denominators():
    """Independent check, one sample at a time: sum_t N_t / sum_t D_t, not a mean of outputs."""
    grid, n = (5, 6), 30
    q, k, v = make_qkv(1, 2, 2, n, 8, seed=9)
    P = sample_partitions_nd([1.5, 4.0], 4, seed=9)
    ids = P.block_ids(grid_coords(*grid))
    e = torch.exp(torch.einsum("bhid,bhjd->bhij", q, k) / 8 ** 0.5)
    same = [(ids[:, t, :, None] == ids[:, t, None, :]).double() for t in range(4)]
    num = sum(torch.einsum("bhij,bhjd->bhid", e * m, v) for m in same)
    den = sum((e * m).sum(-1, keepdim=True) for m in same)
    mean_of_outputs = sum(torch.einsum("bhij,bhjd->bhid", e * m, v) / (e * m).sum(-1, keepdim=True) for m in same) / 4
    out = poslsh_attention_nd(q, k, v, P, grid=grid)
    print(f"vs estimator {rel_err(out, num / den):.1e}, vs mean of outputs {rel_err(out, mean_of_outputs):.1e}")
    assert rel_err(out, num / den) < 1e-13 and rel_err(out, mean_of_outputs) > 1e-3


def test_fixed_box_covering_the_grid_is_plain_softmax_and_small_boxes_are_block_attention():
    q, k, v = make_qkv(2, 3, 3, 48, 8, seed=3)
    whole = poslsh_attention_nd(q, k, v, PartitionsND.fixed_blocks(3, (6, 8)), grid=(6, 8))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert rel_err(whole, plain) < 1e-13
    boxed = poslsh_attention_nd(q, k, v, PartitionsND.fixed_blocks(3, (2, 3)), grid=(6, 8), causal=True)
    c = grid_coords(6, 8)
    box = (c[:, 0] // 2) * 10 + c[:, 1] // 3
    allowed = (box[:, None] == box[None]) & torch.ones(48, 48, dtype=torch.bool).tril()
    ref = poslsh.reference.dense_attention(q, k, v, allowed=allowed)
    assert rel_err(boxed, ref) < 1e-13


def test_underflow_fallback_is_exact():
    """A raster-later key (masked) scores 1000 above every visible key: the safe shift underflows,
    the chunk is redone with the max over shared keys; still equal to the oracle."""
    q, k, v = make_qkv(1, 1, 1, 16, 4, seed=5)
    q[..., :] = 1.0
    k[0, 0, 15] = 400.0
    P = sample_partitions_nd([50.0], 3, seed=1)
    out = poslsh_attention_nd(q, k, v, P, grid=(4, 4), causal=True)
    ref = poslsh_attention_reference_nd(q, k, v, P, grid=(4, 4), causal=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-12


def test_chunking_does_not_change_the_result(monkeypatch):
    q, k, v = make_qkv(2, 4, 2, 7 * 13, 8, seed=6)
    P = sample_partitions_nd(SIGMA, 4, seed=6)
    base = poslsh_attention_nd(q, k, v, P, grid=(7, 13), causal=True)
    monkeypatch.setattr(torch_grid, "CHUNK_ELEMENTS", 64)     # one tile per chunk
    assert torch.equal(poslsh_attention_nd(q, k, v, P, grid=(7, 13), causal=True), base)


def test_work_is_near_linear_on_a_large_grid():
    """No n x n: on a 64 x 64 grid with sigma in {1, 2, 4} the planned scores per query are a small
    fraction of n, and the largest chunk is bounded by CHUNK_ELEMENTS, not by n^2."""
    G, n = 64, 64 * 64
    P = sample_partitions_nd([1.0, 2.0, 4.0], 10, seed=0)
    b, groups = torch_grid._plan(P.widths, P.offsets, [G, G], False, "cpu")
    per_query = sum(g.head.numel() * g.tr * g.tc * g.pr * g.pc for g in groups) / (3 * n)
    biggest = max(g.tr * g.tc * g.pr * g.pc for g in groups)
    print(f"scores per query {per_query:.0f} of n = {n}; largest tile {biggest} elements")
    assert per_query < 0.2 * n and biggest <= torch_grid.CHUNK_ELEMENTS


def test_double_backward_runs():
    q, k, v = make_qkv(1, 2, 2, 12, 4, seed=7, requires_grad=True)
    P = sample_partitions_nd([1.0, 3.0], 3, seed=3)
    g, = torch.autograd.grad(poslsh_attention_nd(q, k, v, P, grid=(3, 4)).pow(2).sum(), q, create_graph=True)
    g2, = torch.autograd.grad(g.sum(), k)
    assert g2.shape == k.shape and torch.isfinite(g2).all()


@pytest.mark.parametrize("call,exc,match", [
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, poslsh.sample_partitions([1.0] * 4, 2), grid=(4, 4)),
     TypeError, "partitions must be a poslsh.PartitionsND"),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, sample_partitions_nd([1.0] * 4, 2, dims=3), grid=(4, 4)),
     ValueError, "partitions have 3 axes"),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, P, grid=(4, 5)), ValueError, "grid 4x5 has 20 tokens but q has seqlen 16"),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, P, grid=16), ValueError, r"grid must be \(height, width\)"),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, sample_partitions_nd([1.0] * 2, 2), grid=(4, 4)),
     ValueError, "partitions were built for 2 heads but q has 4"),
    # through the one registry: a backend without the "nd" op (triton, when installed) or none at all
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, P, grid=(4, 4), backend="triton"), ValueError,
     r"backend='triton' cannot run this call: it does not implement the 'nd' op|backend='triton' is not available"),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, P, grid=(4, 4), backend="fast"), ValueError,
     r"backend: unknown backend 'fast'; available: \["),
    (lambda q, k, v, P: poslsh_attention_nd(q, k, v, P, grid=(4, 4), backend="torch", return_lse=True), ValueError,
     r"backend='torch' cannot run this call: it does not support the log-sum-exp .*one of \['reference'\]"),
])
def test_bad_calls_fail_with_one_clear_line(call, exc, match):
    q, k, v = make_qkv(1, 4, 2, 16, 4)
    with pytest.raises(exc, match=match) as err:
        call(q, k, v, sample_partitions_nd([1.0] * 4, 2))
    assert "\n" not in str(err.value)


def test_empty_and_meta_inputs():
    P = sample_partitions_nd([1.0, 2.0], 2, seed=0)
    q, k, v = make_qkv(0, 2, 2, 6, 4)
    assert poslsh_attention_nd(q, k, v, P, grid=(2, 3)).shape == (0, 2, 6, 4)
    q, k, v = (torch.empty(1, 2, 6, 4, device="meta") for _ in range(3))
    assert poslsh_attention_nd(q, k, v, P, grid=(2, 3)).device.type == "meta"
    q, k, v = make_qkv(1, 2, 2, 6, 0, dv=3)       # head_dim 0: weights are the counts alone
    out = poslsh_attention_nd(q, k, v, P, grid=(2, 3))
    ref = poslsh_attention_reference_nd(torch.zeros(1, 2, 6, 1, dtype=torch.float64),
                                        torch.zeros(1, 2, 6, 1, dtype=torch.float64), v, P, grid=(2, 3))
    assert rel_err(out, ref) < 1e-13


def test_op_boxes_are_the_sampler_boxes():
    """One geometry: the op's per-line bins are exactly PartitionsND.block_bounds on the grid."""
    P = sample_partitions_nd(SIGMA, 6, seed=8)
    b = torch_grid.grid_bounds(P.widths, P.offsets, (7, 13), False, "cpu")
    lo, hi = P.block_bounds((7, 13), grid_coords(7, 13))
    rows, cols = grid_coords(7, 13).unbind(1)
    assert torch.equal(lo[..., 0], b.rlo[:, :, rows]) and torch.equal(hi[..., 0], b.rhi[:, :, rows])
    assert torch.equal(lo[..., 1], b.clo[:, :, cols]) and torch.equal(hi[..., 1], b.chi[:, :, cols])
