"""ALiBi slopes past float32's range (finite in float64): every backend gives the float64 oracle's
answer. A slope that steep leaves each query its own key alone (``out = v``), and the float32 /
bfloat16 / float16 kernels used to turn it into ``inf`` and the head into NaN (``inf * 0`` on the
diagonal). Slopes just inside float32's range (``3e38``, whose base-2 form ``m log2 e`` is not) and
an ordinary slope beside them, windows cut and whole, causal and not, forward, lse and gradients."""
from __future__ import annotations

import pytest
import torch

import poslsh
from poslsh.ops import flex
from poslsh.reference import alibi_attention_reference
from poslsh.window.kind import NO_WINDOW

SLOPES = torch.tensor([1e39, 1e300, 3e38, 0.5], dtype=torch.float64)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _qkv(dtype, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, n, 8, generator=g).to(dtype) for h in (4, 2, 2)]


def _err(ours, ref) -> float:
    return float((ours.detach().double() - ref.detach().double()).abs().max() / ref.detach().double().abs().max())


def _check(backend, dtype, window, causal, grads=True):
    g = torch.Generator().manual_seed(1)
    xs = [x.requires_grad_(grads) for x in _qkv(dtype)]
    rs = [x.detach().double().requires_grad_(grads) for x in xs]
    out, lse = poslsh.windowed_alibi_attention(*xs, SLOPES, window=window, causal=causal, backend=backend,
                                               return_lse=True)
    ref, rlse = alibi_attention_reference(*rs, SLOPES, window=window, causal=causal, return_lse=True)
    assert torch.equal(ref[:, :3], rs[2].detach().repeat_interleave(2, 1)[:, :3])    # the oracle: out = v
    errs = {"out": _err(out, ref), "lse": _err(lse, rlse)}
    if grads:
        dout, dlse = torch.randn(ref.shape, generator=g, dtype=torch.float64), torch.randn(rlse.shape, generator=g)
        ((out * dout.to(out)).sum() + (lse * dlse.to(lse)).sum()).backward()
        ((ref * dout).sum() + (rlse * dlse.double()).sum()).backward()
        errs.update({f"d{c}": _err(x.grad, r.grad) for c, x, r in zip("qkv", xs, rs)})
    print(f"{backend} {dtype} window={window} causal={causal}: "
          + "  ".join(f"{m} {e:.1e}" for m, e in errs.items()))
    for m, e in errs.items():
        assert e < TOL[dtype], f"{m}: error {e:.2e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [3, NO_WINDOW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_backend(dtype, window, causal):
    _check("torch", dtype, window, causal)


@pytest.mark.skipif(not flex.AVAILABLE, reason="this torch has no FlexAttention")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_backend(dtype, causal):
    _check("flex", dtype, 3, causal, grads=False)     # flex runs forward only on the CPU


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")   # -inf far away: exact
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backend(interpret, causal):
    _check("triton", torch.float32, 3, causal)


def test_float64_keeps_the_slopes_it_was_given():
    """float64 holds these slopes: the torch backend gets them as they are (and the oracle's answer)."""
    xs = _qkv(torch.float64)
    out = poslsh.windowed_alibi_attention(*xs, SLOPES, window=NO_WINDOW, backend="torch")
    assert _err(out, alibi_attention_reference(*xs, SLOPES)) < 1e-12
    win = poslsh.window.make_window(SLOPES, 3)
    assert win.for_compute(torch.float64) is win and torch.equal(win.slopes, SLOPES)
    steep = win.for_compute(torch.float32).slopes
    assert torch.equal(steep[3:], SLOPES[3:]) and bool((steep[:3] < SLOPES[:3]).all())
    assert bool(torch.isfinite((steep * 1.4426950408889634).float() * 4).all())    # base 2, 4 positions away
