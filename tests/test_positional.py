"""The positional protocol (poslsh.positional): every kind answers the same questions, and the answers
agree with each other and with the dense oracle (what a query can reach is exactly where its dense
bias is finite; the first key it needs and the cache bound follow from the reach)."""
import pytest
import torch

import poslsh
from poslsh.positional import Positional, check_positional
from poslsh.window import make_window


def kinds():
    sigma = torch.tensor([1.5, 6.0, 20.0], dtype=torch.float64)
    return {
        "partitions": poslsh.sample_partitions(sigma, 4, seed=0),
        "grouped": poslsh.sample_partitions(sigma, 6, seed=1, sampler="grouped"),
        "fixed": poslsh.Partitions.fixed_blocks(3, 7),
        "window": make_window(1 / sigma, torch.tensor([0, 5, 40])),
    }


@pytest.mark.parametrize("name", list(kinds()))
def test_reach_is_where_the_dense_bias_is_finite(name):
    """Per head, the keys a query at p can see (reach) are exactly those with a finite dense bias."""
    p = kinds()[name]
    n = 61
    pos = torch.arange(n)
    first, end = p.reach(pos, n)                                   # [H, n]
    bias = p.dense_bias(pos, pos)                                  # [H, n, n]
    seen = torch.isfinite(bias)
    j = torch.arange(n)
    inside = (j[None, None, :] >= first[:, :, None]) & (j[None, None, :] < end[:, :, None])
    assert torch.equal(seen, inside)          # (a union of blocks holding p is contiguous)
    assert bool((first <= pos).all() and (end > pos).all())        # a query sees itself


@pytest.mark.parametrize("name", list(kinds()))
def test_first_needed_and_cache_bound_follow_from_the_reach(name):
    p = kinds()[name]
    pos = torch.arange(0, 300, 7)
    first = p.reach(pos, 300)[0]
    assert torch.equal(p.first_needed(pos, per_head=True), first.cpu())
    assert torch.equal(p.first_needed(pos), first.amin(0).cpu())
    bound = p.cache_bound(per_head=True)
    kept = [int((pos - first[h]).max()) for h in range(p.num_heads)]    # keys before p a stream keeps
    assert all(k <= b for k, b in zip(kept, bound)) and p.cache_bound() == max(bound)


def test_fingerprint_same_as_and_the_kinds_names():
    a, b = kinds()["partitions"], kinds()["window"]
    assert a.fingerprint() == poslsh.sample_partitions(a.sigma, 4, seed=0).fingerprint()
    assert a.fingerprint() != poslsh.sample_partitions(a.sigma, 4, seed=1).fingerprint()
    assert a.fingerprint() != b.fingerprint() and a.same_as(poslsh.sample_partitions(a.sigma, 4, seed=0))
    assert b.same_as(make_window(b.slopes.clone(), b.window.clone())) and not b.same_as(a)
    assert {a.op, b.op, kinds()["fixed"].op} == {"sequence", "window"}
    for p in kinds().values():
        assert isinstance(p, Positional) and p.to("cpu") is p and len(p.tensors()) == 2
    with pytest.raises(ValueError, match="slopes and window give 3 heads but q has 4"):
        b.check_heads(4)
    with pytest.raises(ValueError, match="partitions were built for 3 heads but q has 2"):
        a.check_heads(2)
    with pytest.raises(TypeError, match="positional must be a poslsh.Partitions or a poslsh.AlibiWindow, got str"):
        check_positional("x", op=("sequence", "window"))
    with pytest.raises(ValueError, match="grid: Partitions attends sequences"):
        a.check_layout(16, (4, 4))


def test_attend_serves_every_kind_on_every_backend_that_runs_it():
    """poslsh.attend dispatches on the object's op: the same as the op's own entry point."""
    q, k, v = (torch.randn(2, 3, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    for p in kinds().values():
        for backend in ("torch", "reference"):
            got = poslsh.attend(q, k, v, p, causal=True, backend=backend)
            if p.op == "window":                 # each kind's own entry point
                want = poslsh.windowed_alibi_attention(q, k, v, p.slopes, window=p.window, causal=True, backend=backend)
            else:
                want = poslsh.poslsh_attention(q, k, v, p, causal=True, backend=backend)
            assert torch.equal(got, want)
    boxes = poslsh.sample_partitions_nd(torch.tensor([2.0, 3.0, 4.0]), 3, seed=0)
    q2, k2, v2 = (t[:, :, :36] for t in (q, k, v))
    got = poslsh.attend(q2, k2, v2, boxes, grid=(6, 6))
    assert torch.equal(got, poslsh.poslsh_attention_nd(q2, k2, v2, boxes, grid=(6, 6)))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_every_backend_refuses_keys_that_miss_what_a_query_sees(backend):
    """The key-coverage check is the dispatcher's: the same check and message on every backend."""
    parts = poslsh.sample_partitions(torch.tensor([8.0, 30.0], dtype=torch.float64), 4, seed=3)
    n, p = 120, 100
    q, k, v = (torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    lo = int(parts.first_needed([p])[0])
    assert lo < p
    out = poslsh.poslsh_attention(q[:, :, p:p + 1], k[:, :, lo:p + 1], v[:, :, lo:p + 1], parts, causal=True,
                                  q_start=p, k_start=lo, backend=backend)
    assert out.shape == (1, 2, 1, 8)
    with pytest.raises(ValueError, match=f"can see keys in \\[{lo}, {p + 1}\\): pass keys from k_start <= {lo}"):
        poslsh.poslsh_attention(q[:, :, p:p + 1], k[:, :, lo + 1:p + 1], v[:, :, lo + 1:p + 1], parts, causal=True,
                                q_start=p, k_start=lo + 1, backend=backend)
