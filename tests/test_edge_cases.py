"""Inputs at the edges: each gets the right answer or one clear error naming the argument."""
import pytest
import torch

import poslsh
from poslsh.reference import alibi_attention_reference
from poslsh.window.kind import NO_WINDOW


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
    assert torch.allclose(out, alibi_attention_reference(q, k, v, slopes, window=window), atol=1e-12)


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
    (lambda: poslsh.cost.cost_matched_window(poslsh.alibi_sigmas(2), 0), ValueError,
     "num_samples must be an int >= 1, got 0"),
    (lambda: poslsh.cost.cost_matched_window(poslsh.alibi_sigmas(2), 2.5), ValueError,
     "num_samples must be an int >= 1, got 2.5"),
    (lambda: poslsh.windowed_alibi_attention(*(torch.randn(1, 2, 4, 8),) * 3, poslsh.alibi_slopes(2), window=2,
                                             causal="no"), TypeError, "causal must be a bool, got str"),
    (lambda: poslsh.poslsh_attention(*(torch.randn(1, 1, 4, 8),) * 3, poslsh.sample_partitions([2.0], 2, seed=0),
                                     causal=1), TypeError, "causal must be a bool, got int"),
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


# ------------------------------------------------ windows past int64: exact ALiBi, or the value given
def _window_heads(window):
    return poslsh.window.make_window(poslsh.alibi_slopes(2), window).window.tolist()


@pytest.mark.parametrize("window,want", [
    (float("inf"), [NO_WINDOW] * 2), (1e30, [NO_WINDOW] * 2), (2 ** 64, [NO_WINDOW] * 2), (2 ** 63, [NO_WINDOW] * 2),
    (5.0, [5, 5]), (torch.tensor([1e30, 3.0]), [NO_WINDOW, 3]), (torch.tensor([float("inf"), 2.0]), [NO_WINDOW, 2]),
    (torch.tensor([2.0 ** 63, 2.0 ** 62]), [NO_WINDOW, 2 ** 62]), (torch.tensor(1e30, dtype=torch.float32), [NO_WINDOW] * 2),
    ([2 ** 64, 3], [NO_WINDOW, 3]), ((float("inf"), 4), [NO_WINDOW, 4]),
])
def test_windows_past_int64_are_exact_alibi(window, want):
    """A window >= n is exact ALiBi (docs): one past int64 is the widest window, not a wrapped negative one."""
    assert _window_heads(window) == want
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
               for _ in range(3))
    out = poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(2), window=window, causal=True, backend="torch")
    ref = alibi_attention_reference(q, k, v, poslsh.alibi_slopes(2), window=torch.tensor(want), causal=True)
    assert float((out - ref).abs().max()) < 1e-12


@pytest.mark.parametrize("window,err,match", [
    (torch.tensor([-1e30, 2.0], dtype=torch.float64), ValueError, r"got \[-1e\+30, 2\.0\]"),
    (-2 ** 70, ValueError, r"got -1180591620717411303424"),
    (-1, ValueError, r"got -1\b"),
    (float("-inf"), ValueError, r"got -inf"),
    (float("nan"), ValueError, "whole numbers"),
    (2.5, ValueError, "whole numbers"),
    (torch.tensor([float("nan"), 1.0]), ValueError, "whole numbers"),
    ([1, "2"], TypeError, "window must be"),
    (True, TypeError, "window must be"),
])
def test_bad_windows_name_the_value_given(window, err, match):
    with pytest.raises(err, match=match) as info:
        _window_heads(window)
    assert "9223372036854775808" not in str(info.value)          # never a wrapped int64


def test_window_rules_past_int64():
    from poslsh.cost import cost_matched_window
    from poslsh.window import windows_in_sigmas
    assert windows_in_sigmas(1e300, [1.0, 2.0]).tolist() == [NO_WINDOW] * 2
    assert windows_in_sigmas(float("inf"), [1.0]).tolist() == [NO_WINDOW]
    assert windows_in_sigmas(2.5, [2.0, 4.0]).tolist() == [5, 10]
    for c in (float("nan"), -1.0, "4"):
        with pytest.raises((ValueError, TypeError), match="c must be"):
            windows_in_sigmas(c, [1.0])
    w = cost_matched_window(poslsh.alibi_sigmas(4), 10 ** 30)                 # s past int64
    assert w.dtype == torch.int64 and bool((w > cost_matched_window(poslsh.alibi_sigmas(4), 10 ** 6)).all())
    layer = poslsh.AlibiAttention(16, 4, window_sigmas=1e300)
    assert layer.exact and poslsh.AlibiAttention(16, 4, window=2 ** 64).exact
    assert poslsh.AlibiAttention(16, 4, window=[2 ** 64, 1, 2, float("inf")]).window.window.tolist() == \
        [NO_WINDOW, 1, 2, NO_WINDOW]


# ------------------------------------------------ arguments on the meta device: named, with the device
_Q = torch.randn(1, 2, 6, 4)
_M = "meta"
_PARTS = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)


@pytest.mark.parametrize("name,call", [
    ("cu_seqlens", lambda: poslsh.windowed_alibi_attention(_Q, _Q, _Q, poslsh.alibi_slopes(2), window=2,
                                                           cu_seqlens=torch.tensor([0, 3, 6], device=_M))),
    ("document_ids", lambda: poslsh.poslsh_attention(_Q, _Q, _Q, _PARTS,
                                                     document_ids=torch.zeros(1, 6, dtype=torch.long, device=_M))),
    ("window", lambda: poslsh.windowed_alibi_attention(_Q, _Q, _Q, poslsh.alibi_slopes(2),
                                                       window=torch.tensor([2, 3], device=_M))),
    ("slopes", lambda: poslsh.windowed_alibi_attention(_Q, _Q, _Q, poslsh.alibi_slopes(2).to(_M), window=2)),
    ("slopes", lambda: poslsh.PoslshAttention(8, 2, slopes=poslsh.alibi_slopes(2).to(_M))),
    ("sigma", lambda: poslsh.sample_partitions(poslsh.alibi_sigmas(2).to(_M), 3, seed=0)),
    ("sigma", lambda: poslsh.PartitionSchedule(poslsh.alibi_sigmas(2).to(_M), 3)),
    ("slopes", lambda: alibi_attention_reference(_Q.double(), _Q.double(), _Q.double(), poslsh.alibi_slopes(2).to(_M))),
    ("slopes", lambda: poslsh.alibi_attention(_Q, _Q, _Q, poslsh.alibi_slopes(2).to(_M), causal=True)),
    ("slopes", lambda: poslsh.AlibiAttention(8, 2, slopes=poslsh.alibi_slopes(2).to(_M))),
    ("window", lambda: poslsh.AlibiAttention(8, 2, window=torch.tensor([2, 3], device=_M))),
    ("partitions", lambda: poslsh.poslsh_attention(_Q, _Q, _Q, _PARTS.to(_M))),
    ("positional", lambda: poslsh.attend(_Q, _Q, _Q, poslsh.window.make_window(poslsh.alibi_slopes(2), 2).to(_M))),
])
def test_arguments_on_the_meta_device_are_named(name, call):
    """A meta tensor has a shape and no values; these arguments' values decide the attention."""
    with pytest.raises(ValueError, match=rf"^{name} is on the meta device .*: pass it on the CPU or on q's device"):
        call()


def test_meta_queries_with_real_arguments_still_infer_shapes():
    q = torch.empty(1, 2, 6, 4, device=_M)
    out = poslsh.windowed_alibi_attention(q, q, q, poslsh.alibi_slopes(2), window=2, cu_seqlens=torch.tensor([0, 3, 6]))
    assert out.device.type == "meta" and out.shape == (1, 2, 6, 4)


def test_a_number_as_sigma_is_one_head_and_a_head_mismatch_says_so():
    """sample_partitions(8, ...) is one head of sigma 8 (documented; a one-element tensor is the same):
    attending 8 heads with it names the mismatch and what a number means."""
    one = poslsh.sample_partitions(8, 3, seed=0)
    assert one.num_heads == 1 and one.sigma.tolist() == [8.0]
    assert one.same_as(poslsh.sample_partitions(torch.tensor([8.0]), 3, seed=0))
    q = torch.randn(1, 8, 5, 4)
    with pytest.raises(ValueError, match=r"1 heads but q has 8 query heads \(a number as sigma or slopes is one "
                                         r"head's value; 8 heads need one each, e.g. poslsh.alibi_sigmas\(8\)\)"):
        poslsh.poslsh_attention(q, q, q, one)
    with pytest.raises(ValueError, match=r"slopes and window give 1 heads but q has 8 query heads \(a number"):
        poslsh.windowed_alibi_attention(q, q, q, 0.5, window=2)
