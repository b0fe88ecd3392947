"""The torch backend against the one oracle: the dense float64 M~ reference."""
import pytest
import torch

import poslsh
from poslsh.reference import alibi_attention_reference, dense_attention_with_bias

from inputs import alibi_partitions, make_qkv

CASES = [  # (B, Hq, Hkv, n)
    (2, 4, 2, 1), (1, 4, 4, 2), (2, 8, 2, 97), (2, 12, 4, 97), (2, 4, 1, 1025), (1, 12, 3, 1025), (2, 8, 8, 300),
]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,n", CASES)
def test_forward_matches_reference_float64(B, Hq, Hkv, n, causal):
    q, k, v = make_qkv(B, Hq, Hkv, n, 16, dv=12, seed=n)
    P = alibi_partitions(Hq, 7, seed=n, stretch=4.0)   # stretch: blocks of all sizes at these n
    ref = poslsh.poslsh_attention_reference(q, k, v, P, causal=causal)
    out = poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch")
    err = rel_err(out, ref)
    print(f"B={B} Hq={Hq} Hkv={Hkv} n={n} causal={causal}: rel err {err:.2e}")
    assert out.shape == (B, Hq, n, 12) and out.dtype == torch.float64
    assert err < 1e-10


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,n", [(2, 4, 2, 1025), (1, 8, 2, 97), (2, 12, 4, 2)])
def test_gradients_match_reference(B, Hq, Hkv, n, causal):
    q, k, v = make_qkv(B, Hq, Hkv, n, 8, seed=3, requires_grad=True)
    P = alibi_partitions(Hq, 5, seed=4, stretch=2.0)
    w = torch.randn(B, Hq, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g_fast = torch.autograd.grad((poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch") * w).sum(),
                                 (q, k, v))
    g_ref = torch.autograd.grad((poslsh.poslsh_attention_reference(q, k, v, P, causal=causal) * w).sum(), (q, k, v))
    errs = [rel_err(a, b) for a, b in zip(g_fast, g_ref)]
    print(f"n={n} causal={causal}: grad rel errs dq, dk, dv = {errs}")
    assert max(errs) < 1e-10


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v = make_qkv(2, 2, 1, 13, 3, seed=5, requires_grad=True)
    P = poslsh.sample_partitions(torch.tensor([1.5, 6.0]), 3, seed=6)
    assert torch.autograd.gradcheck(
        lambda q, k, v: poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch"), (q, k, v))


def test_estimator_is_sum_of_numerators_over_sum_of_denominators():
    """Independent check of the estimator, one sample at a time (not a mean of outputs)."""
    q, k, v = make_qkv(1, 2, 2, 60, 8, seed=8)
    P = alibi_partitions(2, 4, seed=9, stretch=4.0)
    ids = P.block_ids(60)
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / 8 ** 0.5
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    num, den = 0, 0
    for t in range(4):
        same = (ids[:, t, :, None] == ids[:, t, None, :]).double()
        num = num + torch.einsum("bhij,bhjd->bhid", e * same, v)
        den = den + (e * same).sum(-1, keepdim=True)
    expected = num / den
    mean_of_outputs = sum(
        torch.einsum("bhij,bhjd->bhid", e * (ids[:, t, :, None] == ids[:, t, None, :]), v)
        / (e * (ids[:, t, :, None] == ids[:, t, None, :])).sum(-1, keepdim=True) for t in range(4)) / 4
    out = poslsh.poslsh_attention(q, k, v, P, backend="torch")
    print("vs estimator", rel_err(out, expected), "vs mean of outputs", rel_err(out, mean_of_outputs))
    assert rel_err(out, expected) < 1e-12
    assert rel_err(out, mean_of_outputs) > 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_single_whole_sequence_block_is_plain_softmax(causal):
    n = 97
    q, k, v = make_qkv(2, 4, 2, n, 16, seed=10)
    P = poslsh.Partitions.fixed_blocks(4, n)
    out = poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch")
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal)
    print("vs plain softmax attention", rel_err(out, plain))
    assert rel_err(out, plain) < 1e-12


def test_fixed_blocks_equal_block_local_attention():
    n, bs = 50, 8
    q, k, v = make_qkv(1, 2, 2, n, 8, seed=11)
    P = poslsh.Partitions.fixed_blocks(2, bs)
    blk = torch.arange(n) // bs
    bias = torch.where(blk[:, None] == blk[None, :], 0.0, float("-inf")).double()
    expected = dense_attention_with_bias(q, k, v, bias, causal=True)
    assert rel_err(poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch"), expected) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_float64(dtype):
    q, k, v = make_qkv(2, 4, 2, 300, 32, seed=12)
    P = alibi_partitions(4, 6, seed=13)
    ref = poslsh.poslsh_attention_reference(q, k, v, P, causal=True)
    out = poslsh.poslsh_attention(q.to(dtype), k.to(dtype), v.to(dtype), P, causal=True, backend="torch")
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    err = rel_err(out.double(), ref)
    print(dtype, "rel err vs float64 reference", err)
    assert out.dtype == dtype and err < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_extreme_logits_stay_finite(dtype, causal):
    """Scores of about +-1e4 must not overflow (the softmax is stabilised per row)."""
    n = 200
    q, k, v = make_qkv(1, 4, 2, n, 16, seed=14)
    q[..., 7, :] = 50.0     # q_7 . k_3 / sqrt(16) = 50 * 50 * 16 / 4 = 1e4
    k[..., 3, :] = 50.0
    k[..., 5, :] = -50.0    # and -1e4 for k_5
    P = alibi_partitions(4, 5, seed=15)
    q_, k_, v_ = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    out = poslsh.poslsh_attention(q_, k_, v_, P, causal=causal, backend="torch")
    out.sum().backward()
    scores = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1)) / 4
    print("max |score|", scores.abs().max().item())
    assert scores.abs().max() >= 1e4
    for t in (out, q_.grad, k_.grad, v_.grad):
        assert torch.isfinite(t.float()).all()
    ref = poslsh.poslsh_attention_reference(q_.detach().double(), k_.detach().double(), v_.detach().double(), P,
                                            causal=causal)
    assert rel_err(out.double(), ref) < (1e-4 if dtype == torch.float32 else 5e-2)


def test_partitions_on_other_device_are_moved():
    q, k, v = make_qkv(1, 4, 4, 30, 8)
    P = alibi_partitions(4, 3)
    out = poslsh.poslsh_attention(q, k, v, P.to("cpu"), backend="auto")
    assert torch.allclose(out, poslsh.poslsh_attention_reference(q, k, v, P))


@pytest.mark.parametrize("chunk", [1 << 9, 1 << 13])
def test_small_chunks_match_reference(monkeypatch, chunk):
    """Many chunks per group (reused buffers, ragged last chunk), batch 2, both passes."""
    import poslsh.ops.torch.tiles as ti

    monkeypatch.setattr(ti, "CHUNK_ELEMENTS", chunk)
    q, k, v = make_qkv(2, 4, 2, 300, 8, seed=21, requires_grad=True)
    P = alibi_partitions(4, 6, seed=22, stretch=2.0)
    out = poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch")
    ref = poslsh.poslsh_attention_reference(q, k, v, P, causal=True)
    g_fast = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    errs = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip(g_fast, g_ref)]
    print(f"chunk={chunk}: rel errs out, dq, dk, dv = {errs}")
    assert max(errs) < 1e-10


def test_autocast_is_safe():
    q, k, v = make_qkv(1, 4, 2, 64, 16, dtype=torch.float32)
    P = alibi_partitions(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch")
    ref = poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), P, causal=True)
    assert out.dtype == torch.float32 and rel_err(out.double(), ref) < 1e-5


# ---------------------------------------------------------------- custom ops / torch.compile
def test_torch_backend_compiles_fullgraph():
    """The torch backend is a pair of custom ops: torch.compile(fullgraph=True) traces a
    function that calls it (no graph break on the plan's data-dependent shapes), and the
    compiled forward and backward equal the eager ones and the float64 oracle."""
    torch._dynamo.reset()
    poslsh.available_backends()   # backends register on first use: not inside a trace
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 5, seed=1)
    q, k, v = make_qkv(2, 4, 2, 97, 16, requires_grad=True)

    def f(q, k, v):
        return poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch")

    out = torch.compile(f, fullgraph=True)(q, k, v)
    ref = poslsh.poslsh_attention_reference(q, k, v, parts, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    errs = [float((out - ref).detach().abs().max())] + [float((a - b).abs().max()) for a, b in zip(grads, want)]
    print(f"compiled vs reference: out / dq / dk / dv max error {errs}")
    assert max(errs) < 1e-12


def test_torch_custom_ops_pass_opcheck():
    from poslsh.ops.torch import ops as torch_ops

    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)
    q, k, v = make_qkv(1, 2, 1, 33, 8, requires_grad=True)
    k, v = (torch.cat([x, x[:, :, :5]], 2).detach().requires_grad_() for x in (k, v))   # 38 keys at [0, 38)
    torch.library.opcheck(torch_ops.torch_attention_fwd,
                          (q, k, v, parts.widths, parts.offsets, None, None, True, 0.3, True, [5, 0, 40]),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_matches_reference(causal):
    """create_graph=True (gradient penalties, Hessian-vector products) gives correct
    second-order gradients: gradgradcheck, and a gradient penalty's d/dk against the
    float64 reference."""
    P = poslsh.sample_partitions(torch.tensor([1.5, 6.0]), 3, seed=6)
    q, k, v = make_qkv(1, 2, 1, 9, 3, seed=7, requires_grad=True)
    f = lambda q, k, v: poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch")  # noqa: E731
    assert torch.autograd.gradgradcheck(f, (q, k, v))

    def penalty_grad(fn):
        gq, = torch.autograd.grad(fn(q, k, v).square().sum(), (q,), create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (k, v))

    ref = penalty_grad(lambda q, k, v: poslsh.poslsh_attention_reference(q, k, v, P, causal=causal))
    got = penalty_grad(f)
    errs = [float((a - b).abs().max()) for a, b in zip(got, ref)]
    print(f"causal={causal}: gradient-penalty d/dk, d/dv errors {errs} (largest true value "
          f"{float(ref[0].abs().max()):.2f})")
    assert max(errs) < 1e-10


def test_single_thread_when_the_cpu_is_oversubscribed(monkeypatch):
    """On a busy CPU the call runs on one intra-op thread (barriers of many small parallel
    regions wait for descheduled threads otherwise) and restores the thread count after;
    the result is the same."""
    from poslsh.ops.torch import ops as torch_ops

    seen = []
    real = torch_ops.torch_attention_fwd

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setitem(torch_ops.FORWARD, "sequence", spy)
    q, k, v = make_qkv(1, 4, 2, 97, 8, seed=1)
    P = alibi_partitions(4, 3, seed=2)
    with torch_impl_threads(2):
        monkeypatch.setattr(torch_ops, "cpu_oversubscribed", lambda: True)
        busy = poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch")
        after = torch.get_num_threads()
        monkeypatch.setattr(torch_ops, "cpu_oversubscribed", lambda: False)
        quiet = poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch")
    print(f"threads seen by the op: busy {seen[0]}, quiet {seen[1]}; restored to {after}")
    assert seen == [1, 2] and after == 2 and torch.equal(busy, quiet)


def torch_impl_threads(n):
    from poslsh.threads import intra_op_threads
    return intra_op_threads(n)


@pytest.mark.parametrize("op", ["sequence", "window-documents"])
def test_threads_share_the_chunks(op, monkeypatch):
    """With 3 threads the chunks of the tile plan (positional LSH; the window op with packed
    documents) run concurrently, the gradient adds in one order: bitwise the result of one thread,
    and the oracle's, forward, lse and gradients; small chunks so that many run at once."""
    import threading

    from poslsh.ops.torch import kernels as torch_kernels, ops as torch_ops, tiles as torch_tiles
    from poslsh.threads import intra_op_threads

    monkeypatch.setattr(torch_tiles, "CHUNK_ELEMENTS", 1 << 10)
    monkeypatch.setattr(torch_ops, "SINGLE_THREAD_WHEN_BUSY", False)     # the machine's load must not matter
    threads = set()
    run_items = torch_kernels.run_items

    def recording(items, run, cost, **kw):
        threads.add(torch.get_num_threads())
        return run_items(items, lambda it: (threads.add(threading.current_thread().name), run(it))[1], cost, **kw)

    monkeypatch.setattr(torch_kernels, "run_items", recording)
    q, k, v = make_qkv(2, 4, 2, 300, 8, seed=3, requires_grad=True)
    g = torch.randn(2, 4, 300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    P = alibi_partitions(4, 5, seed=2, stretch=4.0)
    ids = torch.zeros(2, 300, dtype=torch.int64)
    ids[0, 100:], ids[1, 7:], ids[1, 250:] = 1, 1, 2
    slopes, window = poslsh.alibi_slopes(4), torch.tensor([0, 3, 30, 299])

    def run(backend):
        if op == "sequence":
            fn = poslsh.poslsh_attention if backend else poslsh.poslsh_attention_reference
            out, lse = fn(q, k, v, P, causal=True, return_lse=True, **({"backend": backend} if backend else {}))
        else:
            fn = poslsh.windowed_alibi_attention if backend else alibi_attention_reference
            out, lse = fn(q, k, v, slopes, window=window, document_ids=ids, return_lse=True,
                          **({"backend": backend} if backend else {}))
        return [out, lse, *torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))]

    one = run("torch")
    with intra_op_threads(3):
        three = run("torch")
    want = run(None)
    err = lambda xs, ys: max(float((a - b).abs().max()) for a, b in zip(xs, ys))  # noqa: E731
    assert 3 in threads and len(threads - {1, 3}) > 1          # several threads ran chunks
    assert err(three, one) == 0 and err(three, want) < 1e-10
