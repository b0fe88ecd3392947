"""Inputs shared by the library tests: random q, k, v and ALiBi partitions (importable as ``inputs``)."""
import torch

import poslsh


def make_qkv(B, Hq, Hkv, n, d, *, dtype=torch.float64, seed=0, dv=None, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, n, dv or d, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def alibi_partitions(H, s, seed=0, stretch=1.0):
    return poslsh.sample_partitions(poslsh.alibi_sigmas(H) * stretch, s, seed=seed)


class LargestTensor(torch.overrides.TorchFunctionMode):
    """Inside ``with LargestTensor() as watch:``, ``watch.largest`` is the most elements of any tensor
    a torch function returned: the check that a fast path builds nothing of ``n x n`` size."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def assert_compiles_like_eager(loss, *inputs, fullgraph=True):
    """``torch.compile(loss, fullgraph=True)`` (aot_eager: no C++ compiler needed) traces without a
    graph break (``fullgraph=False``: breaks allowed), and its value and gradients equal the eager ones."""
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=fullgraph, backend="aot_eager")
    lc = compiled(*inputs)
    gc = torch.autograd.grad(lc, inputs)
    le = loss(*inputs)
    ge = torch.autograd.grad(le, inputs)
    assert torch.allclose(lc, le)
    for a, b in zip(gc, ge):
        assert torch.allclose(a, b)
