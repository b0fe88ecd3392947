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


class NewStorage(torch.overrides.TorchFunctionMode):
    """Inside ``with NewStorage() as watch:``, ``watch.largest`` is the most bytes of any *new* storage a torch
    function returned (a view of an argument's storage is not new): the check that a path copies nothing of a
    given size (a cache's keys). Torch functions called inside a custom op are not seen."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def assert_compiles_like_eager(fn, *inputs, backend="aot_eager", out_tol=None, grad_tol=None, fullgraph=True):
    """``torch.compile(fn, fullgraph=fullgraph)`` traces (without a graph break), and its output and the
    gradients of ``sum(out * g)`` (``g`` fixed and random) equal the eager ones: within ``out_tol`` /
    ``grad_tol`` (max abs) when given, else ``torch.allclose``. ``backend``: ``"aot_eager"`` (no
    C++ compiler needed) or ``"inductor"`` (also checks the custom ops' fake strides against the
    real ones: inductor asserts them)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=fullgraph, backend=backend)
    oc = compiled(*inputs)
    g = torch.randn(oc.shape, generator=torch.Generator().manual_seed(0), dtype=oc.dtype)
    gc = torch.autograd.grad(oc, inputs, g)
    oe = fn(*inputs)
    ge = torch.autograd.grad(oe, inputs, g)

    def close(a, b, tol):
        return torch.allclose(a, b) if tol is None else float((a - b).detach().abs().max()) <= tol

    assert close(oc, oe, out_tol), f"compiled output differs by {float((oc - oe).detach().abs().max()):.2e}"
    for i, (a, b) in enumerate(zip(gc, ge)):
        assert close(a, b, grad_tol), f"compiled gradient of input {i} differs by {float((a - b).abs().max()):.2e}"
