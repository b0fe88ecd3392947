import pytest
import torch

import poslsh

# Tests use small tensors: one intra-op thread avoids OpenMP overhead (and makes the
# suite insensitive to other processes sharing the CPU).
torch.set_num_threads(1)


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


@pytest.fixture
def qkv_factory():
    return make_qkv
