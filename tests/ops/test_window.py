"""windowed_alibi_attention on the torch backend against the dense float64 windowed ALiBi oracle
(alibi_attention_reference(window=...)): forward and gradients, GQA, causal and not, queries and keys
at given positions, per-head windows from 0 to past the sequence, and an O(n w) cost."""
import threading

import pytest
import torch

import poslsh
from poslsh.ops.torch import ops as torch_ops, tiles as torch_tiles
from poslsh.ops.torch.plan import Span
from poslsh.reference import alibi_attention_reference

from inputs import LargestTensor, make_qkv

SLOPES = poslsh.alibi_slopes(8)


def _windows(n):
    return torch.tensor([0, 1, 2, 7, 37, n - 1, n, n + 5])


def _max_err(xs, ys):
    return max(float((a - b).detach().abs().max()) for a, b in zip(xs, ys))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,n", [(2, 8, 2, 1), (2, 8, 4, 2), (2, 8, 2, 97), (1, 8, 8, 300), (2, 8, 2, 1025)])
def test_equals_dense_windowed_alibi(B, Hq, Hkv, n, causal):
    """Windows 0, 1, 2, 7, 37, n - 1, n, n + 5 (one per head): out, lse and dq, dk, dv to 1e-10."""
    q, k, v = make_qkv(B, Hq, Hkv, n, 8, seed=n, dv=6, requires_grad=True)
    w = torch.randn(B, Hq, n, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    results = []
    for fn in (lambda: poslsh.windowed_alibi_attention(q, k, v, SLOPES, window=_windows(n), causal=causal,
                                                        backend="torch", return_lse=True),
               lambda: alibi_attention_reference(q, k, v, SLOPES, window=_windows(n), causal=causal, return_lse=True)):
        out, lse = fn()
        results.append([out, lse, *torch.autograd.grad((out * w).sum(), (q, k, v))])
    err = _max_err(*results)
    print(f"B={B} Hq={Hq} Hkv={Hkv} n={n} causal={causal}: max error out / lse / grads {err:.1e}")
    assert results[0][0].shape == (B, Hq, n, 6) and err < 1e-10


def test_window_zero_is_the_value_and_past_n_is_exact_alibi():
    q, k, v = make_qkv(1, 4, 4, 50, 8, seed=1)
    alone = poslsh.windowed_alibi_attention(q, k, v, SLOPES[:4], window=0, backend="torch")
    assert torch.equal(alone, v)                                       # a query sees itself only
    wide = poslsh.windowed_alibi_attention(q, k, v, SLOPES[:4], window=10 ** 18, causal=True, backend="torch")
    assert _max_err([wide], [alibi_attention_reference(q, k, v, SLOPES[:4], causal=True)]) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,p,nq", [(97, 0, 1), (97, 96, 1), (300, 123, 5), (300, 150, 40), (1025, 1000, 25)])
def test_rows_at_given_positions_equal_full_attention(n, p, nq, causal):
    """Queries [p, p + nq) against exactly the keys their windows reach (decoding, context parallel
    shards) give the full attention's rows, forward and gradients; fewer keys is an error."""
    window = torch.tensor([0, 3, 30, 64, 5, 9, 17, 2])
    q, k, v = make_qkv(2, 8, 2, n, 8, seed=p, requires_grad=True)
    lo = max(0, p - int(window.max()))
    hi = p + nq if causal else min(n, p + nq + int(window.max()))
    full = alibi_attention_reference(q, k, v, SLOPES, window=window, causal=causal)[:, :, p:p + nq]
    out = poslsh.windowed_alibi_attention(q[:, :, p:p + nq], k[:, :, lo:hi], v[:, :, lo:hi], SLOPES, window=window,
                                          causal=causal, q_start=p, k_start=lo, seq_len=n, backend="torch")
    g = torch.randn_like(full)
    err = _max_err([out, *torch.autograd.grad((out * g).sum(), (q, k, v))],
                   [full, *torch.autograd.grad((full * g).sum(), (q, k, v))])
    print(f"causal={causal} queries [{p}, {p + nq}) keys [{lo}, {hi}): max error {err:.1e}")
    assert err < 1e-12
    if lo > 0:
        with pytest.raises(ValueError, match="can see keys in"):
            poslsh.windowed_alibi_attention(q[:, :, p:p + nq], k[:, :, lo + 1:hi], v[:, :, lo + 1:hi], SLOPES,
                                            window=window, causal=causal, q_start=p, k_start=lo + 1, seq_len=n,
                                            backend="torch")


@pytest.mark.parametrize("causal", [True, False])
def test_few_queries_path_equals_the_tiled_path(causal, monkeypatch):
    n, p, nq = 300, 200, 5
    q, k, v = make_qkv(2, 8, 2, n, 8, seed=4)
    window = torch.tensor([0, 3, 30, 64, 5, 9, 17, 2])

    def call():
        return poslsh.windowed_alibi_attention(q[:, :, p:p + nq], k, v, SLOPES, window=window, causal=causal,
                                               q_start=p, seq_len=n, backend="torch", return_lse=True)

    few = call()
    monkeypatch.setattr(torch_ops, "FEW_QUERIES", 0)
    assert _max_err(few, call()) < 1e-13


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward(causal):
    """create_graph=True: gradgradcheck and a gradient penalty's d/dk, d/dv against the oracle."""
    q, k, v = make_qkv(1, 2, 1, 9, 3, seed=7, requires_grad=True)
    slopes, window = torch.tensor([0.3, 0.05], dtype=torch.float64), torch.tensor([2, 0])
    fast = lambda q, k, v: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window,  # noqa: E731
                                                           causal=causal, backend="torch")
    assert torch.autograd.gradgradcheck(fast, (q, k, v))

    def penalty_grad(fn):
        gq, = torch.autograd.grad(fn(q, k, v).square().sum(), (q,), create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (k, v))

    oracle = lambda q, k, v: alibi_attention_reference(q, k, v, slopes, window=window, causal=causal)  # noqa: E731
    assert _max_err(penalty_grad(fast), penalty_grad(oracle)) < 1e-10


def test_cost_is_linear_in_n_times_the_window():
    """The plan computes O(n (w + tile)) scores per head, the window op reuses the tile machinery of
    positional LSH (one block per row), and no tensor on the path is n x n."""
    n, H = 4096, 4
    window = torch.tensor([0, 8, 64, 200])
    span = Span.self_attention(n)
    for causal in (False, True):
        plan = torch_ops.make_plan("window", SLOPES[:4], window, span, None, causal, "cpu")
        scores = torch_tiles.score_elements(plan.groups)
        tiles = torch_tiles.choose_tiles((2 * window + 1)[:, None], n)
        per_head = n * ((1 if causal else 2) * window + 1 + tiles) * 1.25 + n
        print(f"causal={causal}: {scores} scores, bound {int(per_head.sum())}, n^2 H = {n * n * H}")
        assert scores <= per_head.sum() and scores < n * n * H / 8

    import poslsh.ops.torch.tiles as tt
    q, k, v = make_qkv(1, H, 2, n, 8, dtype=torch.float32)
    saved = tt.CHUNK_ELEMENTS
    tt.CHUNK_ELEMENTS = 1 << 16
    try:
        with LargestTensor() as watch:
            out = poslsh.windowed_alibi_attention(q, k, v, SLOPES[:4], window=window, causal=True, backend="torch")
    finally:
        tt.CHUNK_ELEMENTS = saved
    largest = watch.largest
    print("largest tensor elements", largest, "n^2 =", n * n)
    assert torch.isfinite(out).all() and largest < n * n // 16


def test_registered_features():
    """The torch backend serves the window op with spans, documents and the lse; auto picks it."""
    from poslsh.ops import registry

    torch_backend = {b.name: b for b in registry.registered("window")}["torch"]
    assert torch_backend.features["window"] == frozenset({"spans", "documents", "lse"})
    assert torch_backend.features["sequence"] == frozenset({"spans", "documents", "lse"})
    q, _, _ = make_qkv(1, 2, 2, 4, 8)
    assert registry.resolve("auto", "window", q, {"spans", "documents", "lse"}).name == "torch"


@pytest.mark.parametrize("causal", [True, False])
def test_threads_share_the_chunks(causal, monkeypatch):
    """With 3 threads the band kernels' chunks run concurrently (key gradients added in one order):
    bitwise the result of one thread, and the oracle's; small chunks so that many run at once."""
    from poslsh.ops.torch import band as torch_band
    from poslsh.threads import intra_op_threads

    monkeypatch.setattr(torch_band, "CHUNK_ELEMENTS", 1 << 10)
    monkeypatch.setattr(torch_ops, "SINGLE_THREAD_WHEN_BUSY", False)      # the machine's load must not matter
    threads = set()
    run_items = torch_band.run_items

    def recording(items, run, cost, **kw):
        threads.add(torch.get_num_threads())
        return run_items(items, lambda it: (threads.add(threading.current_thread().name), run(it))[1], cost, **kw)

    monkeypatch.setattr(torch_band, "run_items", recording)
    q, k, v = make_qkv(2, 8, 2, 300, 8, seed=3, requires_grad=True)
    window = torch.tensor([0, 3, 30, 64, 5, 9, 17, 299])
    g = torch.randn(2, 8, 300, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def run(fn):
        out, lse = fn(q, k, v, SLOPES, window=window, causal=causal, return_lse=True)
        return [out, lse, *torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))]

    one = run(lambda *a, **kw: poslsh.windowed_alibi_attention(*a, backend="torch", **kw))
    with intra_op_threads(3):
        three = run(lambda *a, **kw: poslsh.windowed_alibi_attention(*a, backend="torch", **kw))
    want = run(alibi_attention_reference)
    assert 3 in threads and len(threads - {1, 3}) > 1          # several threads ran chunks
    assert _max_err(three, one) == 0 and _max_err(three, want) < 1e-10


@pytest.mark.parametrize("causal", [True, False])
def test_transposed_views_give_the_contiguous_result(causal):
    """q, k, v as the ``[B, n, H, d] -> transpose(1, 2)`` views models pass (the band kernels read
    them in place): bitwise the result of contiguous copies, forward and gradients."""
    window = torch.tensor([0, 3, 30, 64, 5, 9, 17, 200])
    g = torch.Generator().manual_seed(2)
    leaves = [torch.randn(2, 300, h, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (8, 2, 2)]
    dout = torch.randn(2, 8, 300, 8, dtype=torch.float64, generator=g)

    def run(views):
        xs = [x.transpose(1, 2) if views else x.transpose(1, 2).contiguous() for x in leaves]
        out = poslsh.windowed_alibi_attention(*xs, SLOPES, window=window, causal=causal, backend="torch")
        return [out, *torch.autograd.grad(out, leaves, dout)]

    assert not leaves[0].transpose(1, 2).is_contiguous()
    assert _max_err(run(True), run(False)) == 0


@pytest.mark.parametrize("tile", [16, 32, 64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_every_tile_size_equals_the_oracle(tile, causal, monkeypatch):
    """The band kernels with every tile height the rules can choose (forward and backward), windows
    from 0 to past the sequence: out, lse and gradients equal the dense float64 oracle."""
    from poslsh.ops.torch import band as torch_band

    monkeypatch.setattr(torch_band, "FORWARD_TILES", ((float("inf"), tile),))
    monkeypatch.setattr(torch_band, "BACKWARD_TILES", ((float("inf"), tile),))
    q, k, v = make_qkv(2, 8, 2, 301, 8, seed=tile, dv=6, requires_grad=True)
    window = torch.tensor([0, 3, 30, 64, 129, 200, 300, 999])
    g = torch.randn(2, 8, 301, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for fn, kw in ((poslsh.windowed_alibi_attention, {"backend": "torch"}), (alibi_attention_reference, {})):
        out, lse = fn(q, k, v, SLOPES, window=window, causal=causal, return_lse=True, **kw)
        results.append([out, lse, *torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))])
    assert _max_err(*results) < 1e-10
