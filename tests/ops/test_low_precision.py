"""Low-precision accuracy judged as flash-attention does: every output and gradient
error (against the float64 oracle on the same rounded inputs) at most 3x PyTorch's own
error at the same dtype (SDPA with the same log-count bias, dense)."""
import pytest
import torch
import torch.nn.functional as F

import poslsh


def _case(dtype, n, logit, seed=0, H=4, d=32):  # noqa: D103  (CPU tensors)
    g = torch.Generator().manual_seed(seed)
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H) * 4, 5, seed=seed)
    q, k, v = (torch.randn(1, H, n, d, generator=g) for _ in range(3))
    mag = logit ** 0.5 / d ** 0.25            # scale * q.k ~ +-logit
    q, k, v = (q * mag).to(dtype), (k * mag).to(dtype), v.to(dtype)
    dout = torch.randn(1, H, n, d, generator=g).to(dtype)
    return parts, q, k, v, dout


def _errors(fn, q, k, v, dout, ref):
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, dout)
    return [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip([out.detach(), *grads], ref)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [97, 257])
@pytest.mark.parametrize("logit", [1.0, 1e2, 1e4])
def test_torch_backend_within_3x_of_sdpa(dtype, n, logit):
    parts, q, k, v, dout = _case(dtype, n, logit, seed=n)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = poslsh.poslsh_attention_reference(*ref_in, parts, causal=True)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dout.double())]
    bias = parts.dense_count(n).double().log()
    bias = bias.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).to(dtype)[None]
    ours = _errors(lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch"),
                   q, k, v, dout, ref)
    sdpa = _errors(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), q, k, v, dout, ref)
    names = ("out", "dq", "dk", "dv")
    print(f"{dtype} n={n} logits ~{logit:g}: " + ", ".join(
        f"{m} {a:.1e} (sdpa {b:.1e})" for m, a, b in zip(names, ours, sdpa)))
    for m, a, b in zip(names, ours, sdpa):
        assert a <= 3 * b + 1e-6, f"{m}: error {a:.2e} > 3x SDPA's {b:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [97, 1025])
@pytest.mark.parametrize("logit", [1.0, 1e2, 1e4])
def test_triton_within_3x_of_sdpa(dtype, n, logit):
    parts, q, k, v, dout = _case(dtype, n, logit, seed=n, d=64)
    q, k, v, dout = (x.cuda() for x in (q, k, v, dout))
    parts = parts.to("cuda")
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = poslsh.poslsh_attention_reference(*ref_in, parts, causal=True)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dout.double())]
    bias = parts.dense_count(n).double().log()
    bias = bias.masked_fill(~torch.ones(n, n, dtype=torch.bool, device="cuda").tril(), float("-inf")).to(dtype)[None]
    ours = _errors(lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton"),
                   q, k, v, dout, ref)
    sdpa = _errors(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), q, k, v, dout, ref)
    names = ("out", "dq", "dk", "dv")
    print(f"triton {dtype} n={n} logits ~{logit:g}: " + ", ".join(
        f"{m} {a:.1e} (sdpa {b:.1e})" for m, a, b in zip(names, ours, sdpa)))
    for m, a, b in zip(names, ours, sdpa):
        assert a <= 3 * b + 1e-6, f"{m}: error {a:.2e} > 3x SDPA's {b:.2e}"
