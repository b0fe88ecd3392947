"""Streaming decoding with a bounded KV cache (poslsh.decoding), against the dense float64 oracle."""
import math

import pytest
import torch

import poslsh
from poslsh.decoding import KVWindow, cache_bound, cache_bound_whp, first_needed


def narrow_and_wide(s=4, seed=0):
    """Two heads: sigma 2 (blocks of a few tokens) and 150 (blocks of hundreds)."""
    return poslsh.sample_partitions(torch.tensor([2.0, 150.0], dtype=torch.float64), s, seed=seed)


def test_first_needed_is_exactly_the_first_key_any_later_query_sees():
    parts, n = narrow_and_wide(), 1200
    count = parts.dense_count(n)                                   # [H, n, n] oracle
    later = count.flip(1).cummax(1).values.flip(1) > 0             # [H, p, j]: some query >= p sees j
    seen = later.any(0)                                            # [p, j]
    want = torch.where(seen, torch.arange(n)[None], n).amin(1)     # first key a query >= p sees
    got = first_needed(parts, torch.arange(n))
    print("positions where first_needed differs from the dense oracle:", int((got != want).sum()))
    assert torch.equal(got, want)


def test_cache_bound_and_eq4():
    assert cache_bound(poslsh.Partitions.fixed_blocks(3, 7)) == 6
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(8), 10, seed=1)
    b = cache_bound(parts)
    assert b == math.ceil(float(parts.widths.max())) - 1
    whp = cache_bound_whp(poslsh.alibi_sigmas(8), 10, delta=0.01)
    print(f"widest block - 1 = {b}, eq. (4) bound (delta 0.01 per head) = {whp:.0f}")
    assert b < whp < 1e4


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_window_decoding_equals_dense_oracle_at_every_position(dtype, tol):
    """A long sequence, a narrow and a wide head, GQA, chunks of 1..64 tokens: every step
    equals the full-sequence dense float64 oracle, and the window stays within the bound."""
    parts, n = narrow_and_wide(), 1500
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    want = poslsh.poslsh_attention_reference(q, k, v, parts, causal=True)
    win = KVWindow(parts, backend="torch")
    sizes, pos, outs, i = [], 0, [], 0
    chunks = [1, 1, 3, 64, 1, 17, 1, 1, 40, 2]
    while pos < n:
        c = min(chunks[i % len(chunks)], n - pos)
        sl = slice(pos, pos + c)
        outs.append(win.step(q[:, :, sl].to(dtype), k[:, :, sl].to(dtype), v[:, :, sl].to(dtype)))
        assert win.size <= win.bound and win.peak <= win.bound + max(chunks)
        sizes.append(win.size)
        pos, i = pos + c, i + 1
    err = float((torch.cat(outs, 2).double() - want).abs().max())
    print(f"{dtype}: max |window - dense oracle| over {n} positions = {err:.2e}; kept keys: max {max(sizes)}, "
          f"final {win.size}, bound {win.bound}, peak attended {win.peak}")
    assert err < tol
    assert win.start > 0 and max(sizes) < n // 2          # keys were really dropped


def test_dropping_one_more_key_is_loud():
    parts, n = narrow_and_wide(), 400
    q, k, v = (torch.randn(1, 2 if i == 0 else 1, n, 8, dtype=torch.float64) for i in range(3))
    p = n - 1
    c0 = int(first_needed(parts, torch.tensor([p]))[0])
    out = poslsh.poslsh_attention(q[:, :, p:], k[:, :, c0:], v[:, :, c0:], parts, causal=True, q_start=p,
                                  k_start=c0, backend="torch")
    want = poslsh.poslsh_attention_reference(q, k, v, parts, causal=True)[:, :, p:]
    assert float((out - want).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="must not drop keys"):
        poslsh.poslsh_attention(q[:, :, p:], k[:, :, c0 + 1:], v[:, :, c0 + 1:], parts, causal=True, q_start=p,
                                k_start=c0 + 1, backend="torch")


def test_window_rejects_bad_input():
    win = KVWindow(narrow_and_wide())
    x = torch.randn(1, 2, 3, 8)
    win.step(x, x[:, :1], x[:, :1])
    with pytest.raises(ValueError, match="one KVWindow per stream"):
        win.step(x, x, x)
    with pytest.raises(ValueError, match="same nq"):
        win.step(x, x[:, :1, :2], x[:, :1, :2])
    with pytest.raises(TypeError, match="Partitions"):
        KVWindow("not partitions")
