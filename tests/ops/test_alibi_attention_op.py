"""poslsh.alibi_attention is the fast exact op (the window op with no cut) against the dense float64
oracle poslsh.reference.alibi_attention_reference: awkward lengths, causal and not, GQA, batches,
queries and keys at given positions, packed documents, forward, lse and gradients; no n x n tensor."""
import pytest
import torch

import poslsh
import poslsh.ops.torch.band as band
from poslsh.reference import alibi_attention_reference

from inputs import LargestTensor, make_qkv

SLOPES = poslsh.alibi_slopes(4)


def _max_err(xs, ys):
    return max(float((a - b).detach().abs().max()) for a, b in zip(xs, ys))


def _out_lse_grads(fn, q, k, v, w, **kw):
    out, lse = fn(q, k, v, SLOPES, return_lse=True, **kw)
    return [out, lse, *torch.autograd.grad((out * w).sum(), (q, k, v))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hkv,n", [(2, 2, 1), (2, 4, 2), (2, 2, 97), (1, 2, 1025)])
def test_equals_the_dense_oracle(B, Hkv, n, causal):
    """Float64 in, the oracle's float64 answer out (out, lse, dq, dk, dv to 1e-10), on the default backend."""
    q, k, v = make_qkv(B, 4, Hkv, n, 8, seed=n, dv=6, requires_grad=True)
    w = torch.randn(B, 4, n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    got = _out_lse_grads(poslsh.alibi_attention, q, k, v, w, causal=causal)
    want = _out_lse_grads(alibi_attention_reference, q, k, v, w, causal=causal)
    err = _max_err(got, want)
    print(f"B={B} Hkv={Hkv} n={n} causal={causal}: max error out / lse / grads {err:.1e}")
    assert got[0].shape == (B, 4, n, 6) and err < 1e-10


@pytest.mark.parametrize("causal", [True, False])
def test_rows_at_given_positions(causal):
    """Queries [p, p + nq) against every key (a cache, a shard with its halo) are the full attention's rows."""
    n, p, nq = 300, 123, 40
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=3, requires_grad=True)
    full = alibi_attention_reference(q, k, v, SLOPES, causal=causal)[:, :, p:p + nq]
    hi = p + nq if causal else n
    out = poslsh.alibi_attention(q[:, :, p:p + nq], k[:, :, :hi], v[:, :, :hi], SLOPES, causal=causal, q_start=p,
                                 k_start=0, seq_len=n)
    g = torch.randn_like(full)
    err = _max_err([out, *torch.autograd.grad((out * g).sum(), (q, k, v))],
                   [full, *torch.autograd.grad((full * g).sum(), (q, k, v))])
    print(f"causal={causal}: rows [{p}, {p + nq}) max error {err:.1e}")
    assert err < 1e-12


@pytest.mark.parametrize("docs", ["cu_seqlens", "document_ids"])
def test_packed_documents(docs):
    n = 97
    q, k, v = make_qkv(2 if docs == "document_ids" else 1, 4, 2, n, 8, seed=5, requires_grad=True)
    if docs == "cu_seqlens":
        kw = {"cu_seqlens": torch.tensor([0, 1, 40, 41, n])}
    else:
        ids = torch.zeros(2, n, dtype=torch.int64)
        ids[0, 30:], ids[1, 5:], ids[1, 60:] = 1, 1, 2
        kw = {"document_ids": ids}
    w = torch.randn(q.shape[0], 4, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    err = _max_err(_out_lse_grads(poslsh.alibi_attention, q, k, v, w, causal=True, **kw),
                   _out_lse_grads(alibi_attention_reference, q, k, v, w, causal=True, **kw))
    print(f"{docs}: max error {err:.1e}")
    assert err < 1e-10


def test_one_op_for_exact_and_windowed_alibi():
    """window=None is no cut: the same as a window past n, bitwise; the windowed name is the same function."""
    q, k, v = make_qkv(1, 4, 2, 60, 8, seed=7)
    assert poslsh.windowed_alibi_attention is poslsh.alibi_attention
    exact = poslsh.alibi_attention(q, k, v, SLOPES, causal=True)
    assert torch.equal(exact, poslsh.alibi_attention(q, k, v, SLOPES, window=None, causal=True))
    assert torch.equal(exact, poslsh.alibi_attention(q, k, v, SLOPES, window=10 ** 6, causal=True))
    assert not torch.equal(exact, poslsh.alibi_attention(q, k, v, SLOPES, window=3, causal=True))


@pytest.mark.parametrize("causal", [True, False])
def test_no_n_by_n_tensor(causal, monkeypatch):
    """Exact ALiBi visits every key, yet builds nothing of n x n size (chunks of the band kernels)."""
    n = 2048
    monkeypatch.setattr(band, "CHUNK_ELEMENTS", 1 << 16)
    q, k, v = make_qkv(1, 4, 2, n, 8, seed=1, dtype=torch.float32)
    with LargestTensor() as watch:
        out = poslsh.alibi_attention(q, k, v, SLOPES, causal=causal)
    print("largest tensor elements", watch.largest, "n^2 =", n * n)
    assert torch.isfinite(out).all() and watch.largest < n * n // 16
