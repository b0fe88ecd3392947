"""poslsh.AlibiAttention (exact or windowed ALiBi as an nn.Module) against the float64 oracle
(alibi_attention_reference): forward and backward, awkward lengths, GQA, batches, packed documents,
every way to give the windows; and it trains."""
import pytest
import torch

import poslsh
from poslsh.reference import alibi_attention_reference
from poslsh.theory import smallest_window
from poslsh.window import windows_in_sigmas

from inputs import make_qkv

H, KV = 4, 2


def oracle_of(layer, q, k, v, **docs):
    win = layer.window
    window = None if layer.exact else win.window
    return alibi_attention_reference(q, k, v, win.slopes, window=window, causal=layer.causal, **docs)


def max_err(a, b):
    return max(float((x - y).detach().abs().max()) for x, y in zip(a, b))


WINDOWS = {"exact": {}, "int": dict(window=3), "list": dict(window=[0, 2, 9, 40]),
           "tensor": dict(window=torch.tensor([5, 1, 0, 7])), "sigmas": dict(window_sigmas=1.5),
           "tol": dict(tol=1e-2, logit_range=2.0)}


@pytest.mark.parametrize("spec", list(WINDOWS))
@pytest.mark.parametrize("n", [1, 2, 97])
@pytest.mark.parametrize("causal", [True, False])
def test_attend_equals_the_oracle_forward_and_backward(spec, n, causal):
    layer = poslsh.AlibiAttention(num_heads=H, num_kv_heads=KV, causal=causal, **WINDOWS[spec])
    q, k, v = make_qkv(2, H, KV, n, 8, seed=n, requires_grad=True)
    out, want = layer.attend(q, k, v), oracle_of(layer, q, k, v)
    g_out = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    err = max_err([out, *g_out], [want, *g_want])
    print(f"{spec} n={n} causal={causal}: max error {err:.1e}")
    assert err < 1e-11


def test_long_sequence_and_the_transposed_layout_models_produce():
    layer = poslsh.AlibiAttention(num_heads=H, num_kv_heads=KV, window_sigmas=2.0)
    g = torch.Generator().manual_seed(3)
    qkv = [torch.randn(1, 1025, h, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_(True)
           for h in (H, KV, KV)]                                   # [B, n, H, d] -> [B, H, n, d] views
    out, want = layer.attend(*qkv), oracle_of(layer, *qkv)
    g1 = torch.autograd.grad(out.sum(), qkv)
    g2 = torch.autograd.grad(want.sum(), qkv)
    assert max_err([out, *g1], [want, *g2]) < 1e-11


@pytest.mark.parametrize("spec", ["exact", "list"])
def test_projections_and_packed_documents(spec):
    """forward(x): the projections around attend; packed documents (cu_seqlens, document_ids) equal
    the oracle with the same documents (no weight across, positions restart)."""
    torch.manual_seed(0)
    layer = poslsh.AlibiAttention(32, H, num_kv_heads=KV, causal=True, bias=True, **WINDOWS[spec]).double()
    x = torch.randn(2, 30, 32, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0] * 11 + [1] * 19, [0] * 4 + [1] * 20 + [2] * 6])
    out = layer(x, document_ids=ids)
    q = layer.q_proj(x).view(2, 30, H, 8).transpose(1, 2)
    k = layer.k_proj(x).view(2, 30, KV, 8).transpose(1, 2)
    v = layer.v_proj(x).view(2, 30, KV, 8).transpose(1, 2)
    want = layer.o_proj(oracle_of(layer, q, k, v, document_ids=ids).transpose(1, 2).reshape(2, 30, 32))
    g1, = torch.autograd.grad(out.sum(), x)
    g2, = torch.autograd.grad(want.sum(), x)
    assert max_err([out, g1], [want, g2]) < 1e-11
    cu = torch.tensor([0, 11, 30])
    one = layer(x[:1], cu_seqlens=cu)
    assert torch.allclose(one, layer(x[:1], document_ids=ids[:1]), atol=1e-13, rtol=0)


def test_the_windows_follow_each_rule():
    sigma = poslsh.alibi_sigmas(H)
    assert poslsh.AlibiAttention(num_heads=H).exact
    assert poslsh.AlibiAttention(num_heads=H, window=3).window.window.tolist() == [3] * H
    assert torch.equal(poslsh.AlibiAttention(num_heads=H, window_sigmas=1.5).window.window,
                       windows_in_sigmas(1.5, sigma))
    assert torch.equal(poslsh.AlibiAttention(num_heads=H, tol=1e-3, logit_range=4.0).window.window,
                       smallest_window(1e-3, sigma, 4.0))
    custom = poslsh.AlibiAttention(num_heads=2, slopes=1 / torch.tensor([2.0, 8.0]), window=[1, 2])
    assert torch.equal(custom.window.slopes, torch.tensor([0.5, 0.125], dtype=torch.float64))
    for kwargs, match in [(dict(window=3, tol=1e-3), "at most one of"), (dict(tol=1e-3), "need logit_range"),
                          (dict(logit_range=3.0), "together with tol"), (dict(dims=2), "attends sequences"),
                          (dict(window=[1, 2]), "2 windows for 4 heads"), (dict(window=-1), "windows must be >= 0"),
                          (dict(slopes=[1.0], window=1), "1 slopes for 4 query heads")]:
        with pytest.raises(ValueError, match=match):
            poslsh.AlibiAttention(num_heads=H, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sigma'"):     # one word: slopes
        poslsh.AlibiAttention(num_heads=H, slopes=poslsh.alibi_slopes(H), sigma=sigma)
    layer = poslsh.AlibiAttention(num_heads=H, window=2)
    q, k, v = make_qkv(1, H, H, 12, 8)
    with pytest.raises(ValueError, match="has no projections: call .attend"):
        layer(q)
    with pytest.raises(ValueError, match="grid: AlibiAttention attends sequences"):
        layer.attend(q, k, v, grid=(3, 4))
    assert torch.equal(layer.attend(q, k, v, step=7), layer.attend(q, k, v))     # the step changes nothing


def test_a_small_model_on_it_trains():
    """A few optimizer steps of a one-layer windowed-ALiBi regressor reduce its loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), poslsh.AlibiAttention(32, 4, num_kv_heads=2, window=6),
                                torch.nn.Linear(32, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 40, 8, generator=g)
    y = x[..., :1].cumsum(1) / 10           # a causal target: running sums need the earlier tokens
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("spec", ["exact", "sigmas"])
def test_compiled_training_equals_eager(spec):
    """torch.compile(fullgraph=True) of forward + backward through the module's projections (q, k, v the
    transposed [B, n, H, d] views models produce): loss and gradients (input and every weight) as eager."""
    from inputs import assert_compiles_like_eager
    torch.manual_seed(0)
    layer = poslsh.AlibiAttention(32, H, num_kv_heads=KV, **WINDOWS[spec]).double()
    x = torch.randn(2, 37, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 37, 32, dtype=torch.float64)
    weights = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.o_proj.weight]

    def loss(x, *params):
        return (layer(x) * w).sum()
    assert_compiles_like_eager(loss, x, *weights)
