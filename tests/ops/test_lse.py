"""return_lse=True on the torch backend (both ops) and merge_attention, against the float64 oracles:
the lse is the log of the weighted sum of exponentials, differentiable on every path, and two
attentions over disjoint key sets merge into the whole."""
import pytest
import torch

import poslsh
from poslsh.ops.torch import ops as torch_ops
from poslsh.reference import alibi_attention_reference

from inputs import make_qkv

SLOPES = poslsh.alibi_slopes(4)
WINDOWS = torch.tensor([0, 3, 40, 5000])


def _parts(seed=0):
    return poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 2, 5, seed=seed)


def _ops(parts):
    """(name, torch-backend call, float64 oracle) of both ops, keyword arguments passed on."""
    return [
        ("sequence", lambda q, k, v, **kw: poslsh.poslsh_attention(q, k, v, parts, backend="torch", **kw),
         lambda q, k, v, **kw: poslsh.poslsh_attention_reference(q, k, v, parts, **kw)),
        ("window", lambda q, k, v, **kw: poslsh.windowed_alibi_attention(q, k, v, SLOPES, window=WINDOWS,
                                                                          backend="torch", **kw),
         lambda q, k, v, **kw: alibi_attention_reference(q, k, v, SLOPES, window=WINDOWS, **kw)),
    ]


def _max_err(xs, ys):
    return max(float((a - b).detach().abs().max()) for a, b in zip(xs, ys))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 97, 1025])
def test_lse_equals_the_oracles(n, causal):
    """lse [B, Hq, n] = log sum_j w_ij e^{s_ij} (w = count, or ALiBi inside the window), float64 for
    float64 input and float32 otherwise; batch 2, GQA 4 / 2."""
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=n)
    for name, fast, oracle in _ops(_parts(seed=n)):
        out, lse = fast(q, k, v, causal=causal, return_lse=True)
        ref_out, ref_lse = oracle(q, k, v, causal=causal, return_lse=True)
        err = _max_err([out, lse], [ref_out, ref_lse])
        print(f"{name} n={n} causal={causal}: max error out / lse {err:.1e}")
        assert lse.shape == (2, 4, n) and lse.dtype == torch.float64 and err < 1e-10
        _, lse32 = fast(q.float(), k.float(), v.float(), causal=causal, return_lse=True)
        assert lse32.dtype == torch.float32 and float((lse32.double() - ref_lse).abs().max()) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2, 97])
def test_gradients_through_the_lse(n, causal):
    """A loss of out and lse: ds = P (dP - delta + dlse), against autograd through the oracles."""
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=3, requires_grad=True)
    w = torch.randn(2, 4, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for name, fast, oracle in _ops(_parts(seed=2)):
        grads = []
        for fn in (fast, oracle):
            out, lse = fn(q, k, v, causal=causal, return_lse=True)
            grads.append(torch.autograd.grad(out.square().sum() + (w * lse).sum(), (q, k, v)))
        only_lse = [torch.autograd.grad(fn(q, k, v, causal=causal, return_lse=True)[1].sum(), (q, k))
                    for fn in (fast, oracle)]
        err, err_lse = _max_err(*grads), _max_err(*only_lse)
        print(f"{name} n={n} causal={causal}: gradient errors {err:.1e}, lse alone {err_lse:.1e}")
        assert err < 1e-10 and err_lse < 1e-10
        assert float(only_lse[1][0].abs().max()) > 1e-3        # the lse alone has a gradient to get right


@pytest.mark.parametrize("causal", [False, True])
def test_lse_on_the_few_queries_path_and_at_positions(causal, monkeypatch):
    """Queries [200, 205) against the keys they can see: the few-queries path and the tiled path give
    the oracle's rows of out and lse, and the same gradients through both."""
    n, p, nq = 300, 200, 5
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=4, requires_grad=True)
    parts = _parts(seed=5)
    start, end = parts.block_bounds(n, torch.arange(p, p + nq))
    for name, fast, oracle in _ops(parts):
        # the keys the queries can see: their blocks, or (window) every key up to the widest window
        lo = int(start.min()) if name == "sequence" else max(0, p - int(WINDOWS.max()))
        hi = p + nq if causal else (int(end.max()) if name == "sequence" else n)
        full_out, full_lse = oracle(q, k, v, causal=causal, return_lse=True)
        want = [full_out[:, :, p:p + nq], full_lse[:, :, p:p + nq]]
        g_want = torch.autograd.grad(want[0].sum() + want[1].sum(), (q, k, v))
        for few in (16, 0):
            monkeypatch.setattr(torch_ops, "FEW_QUERIES", few)
            got = fast(q[:, :, p:p + nq], k[:, :, lo:hi], v[:, :, lo:hi], causal=causal, q_start=p, k_start=lo,
                       seq_len=n, return_lse=True)
            g_got = torch.autograd.grad(got[0].sum() + got[1].sum(), (q, k, v))
            err = _max_err(list(got) + list(g_got), want + list(g_want))
            print(f"{name} causal={causal} FEW_QUERIES={few}: max error {err:.1e}")
            assert err < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_double_backward_through_the_lse(causal):
    """create_graph=True with the lse used: gradgradcheck, and a gradient penalty's d/dk against the
    oracle."""
    parts = poslsh.sample_partitions(torch.tensor([1.5, 6.0]), 3, seed=6)
    q, k, v = make_qkv(1, 2, 1, 7, 2, seed=7, requires_grad=True)
    slopes, window = torch.tensor([0.3, 0.05], dtype=torch.float64), torch.tensor([2, 0])
    pairs = [(lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend="torch", return_lse=True),
              lambda q, k, v: poslsh.poslsh_attention_reference(q, k, v, parts, causal=causal, return_lse=True)),
             (lambda q, k, v: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=causal,
                                                              backend="torch", return_lse=True),
              lambda q, k, v: alibi_attention_reference(q, k, v, slopes, window=window, causal=causal, return_lse=True))]
    for fast, oracle in pairs:
        # the lse alone (the output's double backward is checked in test_torch_impl / test_window)
        assert torch.autograd.gradgradcheck(lambda q, k: fast(q, k, v)[1], (q, k))

        def penalty_grad(fn):
            out, lse = fn(q, k, v)
            gq, = torch.autograd.grad(out.square().sum() + lse.square().sum(), (q,), create_graph=True)
            return torch.autograd.grad(gq.square().sum(), (k, v))

        assert _max_err(penalty_grad(fast), penalty_grad(oracle)) < 1e-10


def test_compiled_with_lse_and_window_fullgraph():
    """torch.compile(fullgraph=True) through both custom-op pairs with return_lse: no graph break,
    forward and gradients equal the oracles."""
    torch._dynamo.reset()
    poslsh.available_backends()   # backends register on first use: not inside a trace
    parts = _parts(seed=1)
    q, k, v = make_qkv(2, 4, 2, 97, 16, requires_grad=True)

    def loss(q, k, v, backend):
        a, lse_a = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend=backend, return_lse=True)
        b, lse_b = poslsh.windowed_alibi_attention(q, k, v, SLOPES, window=WINDOWS, causal=True, backend=backend,
                                                   return_lse=True)
        return a.square().sum() + lse_a.sum() + b.square().sum() + lse_b.sum()

    got = torch.compile(loss, fullgraph=True)(q, k, v, "torch")
    want = loss(q, k, v, "reference")
    err = _max_err([got, *torch.autograd.grad(got, (q, k, v))], [want, *torch.autograd.grad(want, (q, k, v))])
    print(f"compiled vs oracles: max error {err:.1e}")
    assert err < 1e-9


@pytest.mark.parametrize("op", ["torch_attention_fwd", "torch_window_fwd"])
def test_custom_ops_pass_opcheck_with_documents(op):
    """Both forward ops, with packed documents and the lse used (fakes, schema, autograd)."""
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)
    q, k, v = make_qkv(2, 2, 1, 33, 8, requires_grad=True)
    docs = poslsh.documents.make_documents(2, 33, document_ids=torch.tensor([[0] * 20 + [1] * 13, [4] * 33]))
    a, b = (parts.widths, parts.offsets) if op == "torch_attention_fwd" else (SLOPES[:2], torch.tensor([3, 50]))
    torch.library.opcheck(getattr(torch_ops, op), (q, k, v, a, b, docs.start, docs.end, False, 0.3, True, [0, 0, 33]),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ---------------------------------------------------------------- merge_attention
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [2, 97])
def test_two_halves_of_the_keys_merge_into_the_whole(n, causal):
    """Keys [0, m) and [m, n) attended separately (the oracles at given key positions; causal queries
    before m see nothing in the second half: lse -inf there) merge into the torch backend's whole
    attention, forward and gradients."""
    m = n // 2
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=8, requires_grad=True)
    for name, fast, oracle in _ops(_parts(seed=9)):
        halves = [oracle(q, k[:, :, :m], v[:, :, :m], causal=causal, q_start=0, return_lse=True),
                  oracle(q, k[:, :, m:], v[:, :, m:], causal=causal, q_start=0, k_start=m, return_lse=True)]
        out, lse = poslsh.merge_attention([h[0] for h in halves], [h[1] for h in halves])
        whole_out, whole_lse = fast(q, k, v, causal=causal, return_lse=True)
        if causal:
            assert bool(torch.isinf(halves[1][1][:, :, :m]).all())
        g_merged = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
        g_whole = torch.autograd.grad(whole_out.square().sum() + whole_lse.sum(), (q, k, v))
        err = _max_err([out, lse, *g_merged], [whole_out, whole_lse, *g_whole])
        print(f"{name} n={n} causal={causal}: merged vs whole, max error {err:.1e}")
        assert err < 1e-10


def test_merge_is_safe_on_rows_with_no_keys():
    """A row with no key in any set: out 0, lse -inf, finite (zero) gradients; a NaN partial output
    of an empty set is ignored; one partial is returned as is; dtypes are kept."""
    out1 = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    out2 = torch.full((1, 2, 3, 4), float("nan"), dtype=torch.float64)
    lse1 = torch.tensor([[[0.5, -torch.inf, 2.0], [1.0, -torch.inf, -torch.inf]]], dtype=torch.float64,
                        requires_grad=True)
    lse2 = torch.full((1, 2, 3), -torch.inf, dtype=torch.float64)
    out, lse = poslsh.merge_attention([out1, out2], [lse1, lse2])
    assert torch.equal(out[0, 0, 1], torch.zeros(4, dtype=torch.float64)) and lse[0, 1, 2] == -torch.inf
    assert torch.allclose(out[0, 0, 0], out1[0, 0, 0]) and torch.allclose(lse[0, 0, 2], lse1[0, 0, 2])
    g_out, g_lse = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (out1, lse1))
    assert torch.isfinite(g_out).all() and torch.isfinite(g_lse).all()
    half, lse_half = poslsh.merge_attention([out1.detach().half()], [lse1.detach().float()])
    assert half.dtype == torch.float16 and lse_half.dtype == torch.float32


def test_merge_propagates_nan():
    """A NaN lse in one partial makes that query's merged out and lse NaN, so a later merge cannot
    mistake it for "no key" (-inf) and return the other partials alone, finite and wrong."""
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    lses = [torch.randn(1, 2, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    lses[1][0, 1, 3] = float("nan")
    ab, lse_ab = poslsh.merge_attention(outs[:2], lses[:2])
    assert torch.isnan(lse_ab[0, 1, 3]) and torch.isnan(ab[0, 1, 3]).all()
    abc, lse_abc = poslsh.merge_attention([ab, outs[2]], [lse_ab, lses[2]])
    flat, lse_flat = poslsh.merge_attention(outs, lses)
    for nested, whole in ((abc, flat), (lse_abc, lse_flat)):
        assert torch.isnan(nested[0, 1, 3]).all() and torch.isnan(whole[0, 1, 3]).all()
        keep = ~torch.isnan(whole)
        assert torch.allclose(nested[keep], whole[keep], rtol=0, atol=1e-12)


def test_merge_rejects_bad_input():
    o, l = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="one lse per partial output"):
        poslsh.merge_attention([o, o], [l])
    with pytest.raises(ValueError, match="outs\\[0\\].shape\\[:-1\\]"):
        poslsh.merge_attention([o], [l[..., :2]])
    with pytest.raises(TypeError, match="sequences of tensors"):
        poslsh.merge_attention(o, l)
