"""Inputs at the edges: each gets the right answer or one clear error naming the argument."""
import pytest
import torch

import poslsh


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("shape", [(0, 4, 10, 8), (2, 4, 10, 0)])
def test_empty_batch_or_head_dim(backend, shape):
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 3, seed=0)
    B, H, n, d = shape
    q = torch.randn(B, H, n, d, requires_grad=True)
    k, v = torch.randn(B, 2, n, d), torch.randn(B, 2, n, d)
    out = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend=backend)
    assert out.shape == (B, H, n, d)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("shape", [(0, 4, 10, 8), (2, 4, 10, 0)])
def test_window_op_empty_batch_or_head_dim(backend, shape):
    B, H, n, d = shape
    q = torch.randn(B, H, n, d, requires_grad=True)
    k, v = torch.randn(B, 2, n, d), torch.randn(B, 2, n, d)
    out, lse = poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(4), window=3, causal=True,
                                               backend=backend, return_lse=True)
    assert out.shape == (B, H, n, d) and lse.shape == (B, H, n)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_head_dim_zero_window_weights_are_alibi():
    q, k = torch.randn(1, 4, 30, 0, dtype=torch.float64), torch.randn(1, 2, 30, 0, dtype=torch.float64)
    v = torch.randn(1, 2, 30, 5, dtype=torch.float64)
    slopes, window = poslsh.alibi_slopes(4), torch.tensor([0, 2, 9, 100])
    out = poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, backend="torch")
    assert torch.allclose(out, poslsh.alibi_attention(q, k, v, slopes, window=window), atol=1e-12)


def test_head_dim_zero_weights_are_the_counts():
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 3, seed=0)
    q, k = torch.randn(2, 4, 30, 0, dtype=torch.float64), torch.randn(2, 2, 30, 0, dtype=torch.float64)
    v = torch.randn(2, 2, 30, 5, dtype=torch.float64)
    for causal in (False, True):
        out = poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend="torch")
        count = parts.dense_count(30).double()
        if causal:
            count = count.tril()
        want = (count / count.sum(-1, keepdim=True)) @ v.repeat_interleave(2, dim=1)
        err = float((out - want).abs().max())
        print(f"head_dim 0, causal={causal}: error {err:.1e}")
        assert err < 1e-12


def test_meta_device_infers_shapes():
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 3, seed=0)
    q, k, v = (torch.empty(2, h, 10, 8, device="meta") for h in (4, 2, 2))
    out = poslsh.poslsh_attention(q, k, v, parts, causal=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 10, 8)
    out, lse = poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(4), window=2, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 10, 8) and lse.shape == (2, 4, 10)


def test_tiny_sigma_blocks_agree_with_block_ids():
    """sigma = 1e-20: widths far below 1, every position is its own block in both views."""
    p = poslsh.sample_partitions([1e-20, 1.0, 3.0], 2, seed=1)
    n = 50
    ids, blk = p.block_ids(n), p.blocks(n)
    start = torch.repeat_interleave(blk.start, blk.length).view(3, 2, n)
    new_block = torch.ones_like(ids, dtype=torch.bool)
    new_block[..., 1:] = ids[..., 1:] != ids[..., :-1]
    assert torch.equal(new_block, start == torch.arange(n))
    assert bool((blk.length[blk.head == 0] == 1).all())


@pytest.mark.parametrize("call,err,match", [
    (lambda: poslsh.sample_partitions(None, 3), TypeError, "sigma must be"),
    (lambda: poslsh.sample_partitions([1.0, "2"], 3), TypeError, "sigma must be"),
    (lambda: poslsh.sample_partitions([1.0], 3, seed=2 ** 70), ValueError, "seed must be in"),
    (lambda: poslsh.sample_partitions([1.0], 3, seed=1.5), TypeError, "seed must be an int"),
    (lambda: poslsh.sample_partitions([1.0], 3, seed=True), TypeError, "seed must be an int"),
    (lambda: poslsh.poslsh_attention(*(torch.randn(1, 1, 4, 8),) * 3, poslsh.sample_partitions([2.0], 2, seed=0),
                                     scale="0.5"), TypeError, "scale must be a real number"),
])
def test_bad_arguments_name_themselves(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_huge_sigma_and_list_sigma_are_handled():
    p = poslsh.sample_partitions([1e308], 4, seed=0)        # widths would overflow to inf
    assert bool(torch.isfinite(p.widths).all()) and bool(torch.isfinite(p.offsets).all())
    assert p.max_block_size(1000) == 1000                   # one block: plain softmax
    p = poslsh.Partitions(torch.full((2, 1), 3.0), torch.zeros(2, 1), sigma=[1.0, 2.0])
    assert p.sigma.dtype == torch.float64 and p.sigma.tolist() == [1.0, 2.0]
    ok = poslsh.sample_partitions(torch.tensor([2.0]), 2, seed=2 ** 64 - 1)
    assert ok.widths.shape == (1, 2)
