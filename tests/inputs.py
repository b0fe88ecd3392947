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
