"""Queries and keys at given positions (KV-cache decoding, context-parallel shards):
the torch backend against the dense float64 oracle and against full self-attention."""
import pytest
import torch

import poslsh

from inputs import make_qkv

SIGMAS = torch.tensor([1.5, 6.0, 40.0, 400.0], dtype=torch.float64)


def _parts(s=5, seed=0):
    return poslsh.sample_partitions(SIGMAS, s, seed=seed)


def _needed_range(parts, positions, n, causal):
    start, end = parts.block_bounds(n, positions)
    lo = int(start.min())
    hi = int(torch.minimum(end, positions + 1).max()) if causal else int(end.max())
    return lo, hi


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,p,nq", [(97, 0, 1), (97, 40, 1), (97, 96, 1), (300, 123, 17), (1025, 1000, 25),
                                    (1025, 0, 1025)])
def test_rows_equal_full_self_attention(backend, causal, n, p, nq):
    """Queries [p, p+nq) against exactly the keys they can see give the rows of the full
    self-attention (fwd and grads wrt the keys used), to float64 rounding."""
    parts = _parts(seed=n + p)
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=p, requires_grad=True)
    full = poslsh.poslsh_attention_reference(q, k, v, parts, causal=causal)[:, :, p:p + nq]
    lo, hi = _needed_range(parts, torch.arange(p, p + nq), n, causal)
    out = poslsh.poslsh_attention(q[:, :, p:p + nq], k[:, :, lo:hi], v[:, :, lo:hi], parts, causal=causal,
                                  q_start=p, k_start=lo, seq_len=n, backend=backend)
    w = torch.randn_like(full)
    g_full = torch.autograd.grad((full * w).sum(), (q, k, v))
    g_span = torch.autograd.grad((out * w).sum(), (q, k, v))
    errs = [float((out - full).detach().abs().max())] + [float((a - b).abs().max()) for a, b in zip(g_span, g_full)]
    print(f"{backend} causal={causal} n={n} queries [{p}, {p + nq}) keys [{lo}, {hi}): errors {errs}")
    assert max(errs) < 1e-12


def test_extra_keys_on_both_sides_change_nothing():
    parts = poslsh.sample_partitions(SIGMAS / 8, 5, seed=3)
    n, p, nq = 300, 150, 20
    q, k, v = make_qkv(1, 4, 4, n, 8, seed=1)
    lo, hi = _needed_range(parts, torch.arange(p, p + nq), n, True)
    assert lo >= 7
    a = poslsh.poslsh_attention(q[:, :, p:p + nq], k[:, :, lo:hi], v[:, :, lo:hi], parts, causal=True,
                                q_start=p, k_start=lo, backend="torch")
    b = poslsh.poslsh_attention(q[:, :, p:p + nq], k[:, :, lo - 7:], v[:, :, lo - 7:], parts, causal=True,
                                q_start=p, k_start=lo - 7, seq_len=n, backend="torch")
    print(f"extra keys: max difference {float((a - b).abs().max()):.2e}")
    assert torch.allclose(a, b, rtol=0, atol=1e-14)


def test_missing_keys_are_an_error():
    parts = _parts(seed=4)
    n, p = 300, 200
    q, k, v = make_qkv(1, 4, 4, n, 8, seed=2)
    lo, hi = _needed_range(parts, torch.tensor([p]), n, True)
    assert lo < p, "the widest head's block must reach back"
    with pytest.raises(ValueError, match="can see keys in"):     # dropped a key the query needs
        poslsh.poslsh_attention(q[:, :, p:p + 1], k[:, :, lo + 1:p + 1], v[:, :, lo + 1:p + 1], parts,
                                causal=True, q_start=p, k_start=lo + 1, backend="torch")
    with pytest.raises(ValueError, match="seq_len"):               # non-causal needs the sequence end
        poslsh.poslsh_attention(q[:, :, p:p + 1], k[:, :, lo:], v[:, :, lo:], parts, q_start=p, k_start=lo)
    with pytest.raises(ValueError, match="does not support queries and keys at given positions"):
        poslsh.poslsh_attention(q[:, :, p:p + 1], k, v, parts, causal=True, q_start=p, backend="triton")
    with pytest.raises(ValueError, match="q_start"):
        poslsh.poslsh_attention(q[:, :, :1], k, v, parts, causal=True, q_start=-1)


@pytest.mark.parametrize("causal", [True, False])
def test_few_queries_path_equals_the_tiled_path(causal, monkeypatch):
    """Decoding-sized calls (a few query rows) take a dense pass over each head's key range;
    it equals the tiled path and the oracle, forward and backward."""
    from poslsh.ops.torch import ops as torch_ops

    parts = _parts(seed=11)
    n, p, nq = 300, 200, 5
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=4, requires_grad=True)
    lo, hi = _needed_range(parts, torch.arange(p, p + nq), n, causal)
    call = lambda: poslsh.poslsh_attention(q[:, :, p:p + nq], k[:, :, lo:hi], v[:, :, lo:hi], parts,  # noqa: E731
                                           causal=causal, q_start=p, k_start=lo, seq_len=n, backend="torch")
    few = call()
    monkeypatch.setattr(torch_ops, "FEW_QUERIES", 0)
    tiled = call()
    full = poslsh.poslsh_attention_reference(q, k, v, parts, causal=causal)[:, :, p:p + nq]
    g_few = torch.autograd.grad(few.sum(), (q, k, v))
    g_full = torch.autograd.grad(full.sum(), (q, k, v))
    errs = [float((few - tiled).detach().abs().max()), float((few - full).detach().abs().max())]
    errs += [float((a - b).abs().max()) for a, b in zip(g_few, g_full)]
    print(f"causal={causal}: few vs tiled, few vs oracle, grads: {errs}")
    assert max(errs) < 1e-12
