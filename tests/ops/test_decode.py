"""The window op's few-query forward on the torch backend (poslsh.ops.torch.decode: decoding steps) against
the dense float64 oracle: 1, 2 and 16 queries against 1, 2, 97 and 1025 keys, exact ALiBi and per-head windows,
GQA and multi-query, batch > 1, causal and not, queries at offsets; gradients through the tiles' backward from
its lse; keys that are views of a larger buffer give the same answer bitwise and are never copied."""
import pytest
import torch

import poslsh
from poslsh.ops.torch import decode, kernels, ops as torch_ops
from poslsh.ops.torch.plan import Span, window_row_bounds
from poslsh.reference import alibi_attention_reference
from poslsh.window.kind import NO_WINDOW

from inputs import NewStorage, make_qkv

SLOPES = poslsh.alibi_slopes(8)


def _windows(nk):
    return torch.tensor([0, 1, 7, 37, nk - 1, nk, nk + 5, NO_WINDOW]).clamp(min=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", ["exact", "per-head"])
@pytest.mark.parametrize("B,Hkv,nq,nk", [(1, 8, 1, 1), (2, 2, 1, 2), (3, 1, 2, 97), (2, 4, 16, 1025), (1, 8, 1, 1025)])
def test_equals_the_dense_oracle(B, Hkv, nq, nk, window, causal):
    """Queries at the end of the keys (causal: decoding) or in the middle (not causal: the keys cover their
    windows): out, lse and dq, dk, dv to 1e-11."""
    win = None if window == "exact" else _windows(nk)
    q, k, v = make_qkv(B, 8, Hkv, nk, 8, seed=nk + nq, dv=5, requires_grad=True)
    p = nk - nq if causal else max(0, nk // 2 - nq // 2)
    qs = q[:, :, p:p + nq]
    kw = dict(window=win, causal=causal, q_start=p, return_lse=True)
    got = poslsh.alibi_attention(qs, k, v, SLOPES, backend="torch", seq_len=nk, **kw)
    want = alibi_attention_reference(qs, k, v, SLOPES, **kw)
    g = torch.randn_like(want[0])
    grads = [torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v)) for out, lse in (got, want)]
    err = max(float((a - b).detach().abs().max()) for a, b in zip([*got, *grads[0]], [*want, *grads[1]]))
    print(f"B={B} Hkv={Hkv} nq={nq} nk={nk} {window} causal={causal}: max error {err:.1e}")
    assert got[0].shape == (B, 8, nq, 5) and err < 1e-11


def test_the_op_takes_this_path_for_few_queries_without_documents(monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args[0].shape[2])
        return decode.forward(*args)

    monkeypatch.setitem(torch_ops.KERNELS, "window", torch_ops.KERNELS["window"]._replace(few=spy))
    q, k, v = make_qkv(1, 8, 2, 40, 8)
    for nq in (1, torch_ops.FEW_QUERIES, torch_ops.FEW_QUERIES + 1):
        poslsh.alibi_attention(q[:, :, -nq:], k, v, SLOPES, causal=True, q_start=40 - nq, backend="torch")
    poslsh.alibi_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], SLOPES, causal=True, backend="torch",
                           document_ids=torch.tensor([[0, 0, 1, 1]]))
    assert calls == [1, torch_ops.FEW_QUERIES]


def _in_buffer(x, capacity):
    """``x [B, H, n, d]`` as the filled part of a buffer ``[B, H, capacity, d]`` (an appending cache's view)."""
    buf = torch.full((*x.shape[:2], capacity, x.shape[-1]), float("nan"), dtype=x.dtype)
    buf[:, :, :x.shape[2]] = x
    return buf[:, :, :x.shape[2]]


@pytest.mark.parametrize("window", ["exact", "per-head"])
@pytest.mark.parametrize("B,Hkv", [(1, 8), (3, 8), (3, 2)])
def test_keys_in_a_larger_buffer_are_read_in_place(B, Hkv, window):
    """Keys and values that are views of a larger buffer (NaN past their end): the same output bitwise as
    contiguous ones, whatever the thread count, and no new storage of a tenth of the keys' bytes (the scores are
    Hq / (Hkv d) of them; the general few-queries path gathers them all)."""
    nk = 3000
    q, k, v = make_qkv(B, 8, Hkv, nk, 64, dtype=torch.float32, seed=3)
    win = torch.tensor([NO_WINDOW] * 8) if window == "exact" else torch.tensor([3, 9, 40, 100, 600, 2000, 2999, 5000])
    kb, vb = _in_buffer(k, 4096), _in_buffer(v, 4096)
    shape = torch_ops._shape(q[:, :, -1:], k, v)
    args = (SLOPES.float(), win, shape, 0.25, True, nk - 1)
    with NewStorage() as watch:
        out, lse = decode.forward(q[:, :, -1:], kb, vb, *args)
    ref = decode.forward(q[:, :, -1:], k.contiguous(), v.contiguous(), *args)
    with poslsh.threads.intra_op_threads(1):
        one = decode.forward(q[:, :, -1:], kb, vb, *args)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]) and torch.equal(out, one[0])
    key_bytes = k.numel() * k.element_size()
    print(f"B={B} Hkv={Hkv} {window}: largest new storage {watch.largest} bytes, keys {key_bytes}")
    assert watch.largest < key_bytes / 10
    span = Span(nk - 1, 0, 1, nk, nk)
    with NewStorage() as gather:
        kernels.few_queries_forward(q[:, :, -1:], kb, vb, window_row_bounds(win, span, True, "cpu"), shape, 0.25,
                                    SLOPES.float())
    assert gather.largest >= key_bytes / 10      # the watch sees the general path's copies (per group of heads)
