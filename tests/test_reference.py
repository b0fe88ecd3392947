import math

import pytest
import torch

import poslsh
from poslsh import theory
from poslsh.reference import alibi_attention_reference

from inputs import make_qkv


def test_alibi_attention_matches_explicit_formula():
    q, k, v = make_qkv(2, 4, 2, 33, 8)
    slopes = poslsh.alibi_slopes(4)
    out = alibi_attention_reference(q, k, v, slopes, causal=True)
    kx, vx = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    i = torch.arange(33)
    w = torch.exp(torch.einsum("bhid,bhjd->bhij", q, kx) / math.sqrt(8)) \
        * torch.exp(-slopes[:, None, None] * (i[:, None] - i[None, :]).abs()) * (i[:, None] >= i[None, :])
    expected = torch.einsum("bhij,bhjd->bhid", w / w.sum(-1, keepdim=True), vx)
    assert torch.allclose(out, expected, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_large_s_approaches_alibi_within_theorem_2_2(causal):
    """Proof of Thm 2.2 (eqs. 8, 10, 14) with the realised eps = ||L* - M~||_max:
    ||T* - T~||_max <= 2 eps ||V||_max / (beta* - eps). eps itself is bounded by
    eq. (3) at confidence 1 - delta, so the test has no free tolerance."""
    n, H, s, delta = 256, 4, 2000, 1e-6
    q, k, v = make_qkv(1, H, H, n, 16, seed=1)
    sigma = poslsh.alibi_sigmas(H) * 8       # sigma = 32 .. 2048: beta* well above eps at n = 256
    P = poslsh.sample_partitions(sigma, s, seed=2)
    exact = alibi_attention_reference(q, k, v, 1.0 / sigma, causal=causal)
    approx = poslsh.poslsh_attention(q, k, v, P, causal=causal, backend="torch")
    err = (exact - approx).abs().amax((0, 2, 3))
    eps = theory.max_norm_error(P, n)
    eps_hoeffding = theory.max_norm_deviation_bound(n, s, delta)
    beta, _ = theory.instance_stats(q[0], k[0], sigma, causal=causal)
    vmax = v.abs().max().item()
    bound = 2 * eps * vmax / (beta - eps)
    print("err", err.tolist(), "\nbound", bound.tolist(), "\neps", eps.tolist(), "eq.(3)", eps_hoeffding)
    assert (eps < eps_hoeffding).all() and (beta > eps).all()
    assert (err <= bound).all()
    assert (err > 0).all() and bound[-1] < 0.1   # informative for the widest head


def test_reference_rejects_wrong_head_count():
    q, k, v = make_qkv(1, 4, 4, 10, 8)
    with pytest.raises(ValueError, match="partitions were built for 2 heads"):
        poslsh.poslsh_attention_reference(q, k, v, poslsh.Partitions.fixed_blocks(2, 4))
    with pytest.raises(ValueError, match="slopes"):
        alibi_attention_reference(q, k, v, poslsh.alibi_slopes(3))


# ------------------------------------------------- the oracles' own extensions, against loops
def _loop_attention(q, k, v, weight, scale):
    """Per (b, h, i): sum_j w_ij e^{s_ij} v_j / sum_j w_ij e^{s_ij} and log sum_j w_ij e^{s_ij}, by loops."""
    B, Hq, nq, _ = q.shape
    g = Hq // k.shape[1]
    out = torch.zeros(B, Hq, nq, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(B, Hq, nq, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(nq):
                w = torch.tensor([weight(b, h, i, j) for j in range(k.shape[2])], dtype=torch.float64)
                e = w * torch.exp(scale * (k[b, h // g] @ q[b, h, i]))
                out[b, h, i] = (e[:, None] * v[b, h // g]).sum(0) / e.sum()
                lse[b, h, i] = torch.log(e.sum())
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_windowed_alibi_oracle_with_positions_equals_loops(causal):
    q, k, v = make_qkv(1, 4, 2, 6, 3, seed=3)
    k2, v2 = torch.cat([k, k[:, :, :3]], 2), torch.cat([v, v[:, :, :3]], 2)      # 9 keys at positions 2..10
    slopes, window = poslsh.alibi_slopes(4), torch.tensor([0, 1, 3, 100])
    out, lse = alibi_attention_reference(q, k2, v2, slopes, window=window, causal=causal, q_start=5, k_start=2,
                                      return_lse=True)

    def weight(b, h, i, j):
        d = abs((5 + i) - (2 + j))
        ok = d <= int(window[h]) and (not causal or 2 + j <= 5 + i)
        return math.exp(-float(slopes[h]) * d) if ok else 0.0

    want, want_lse = _loop_attention(q, k2, v2, weight, 3 ** -0.5)
    assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_oracles_equal_loops_with_restarting_positions(causal):
    """Both oracles with document_ids (per-row packing): the weight of a pair is its own kernel at
    the positions inside the document, and 0 across documents."""
    q, k, v = make_qkv(2, 2, 1, 7, 3, seed=4)
    ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 9]])
    starts = [[0, 0, 0, 3, 4, 4, 4], [0, 0, 0, 0, 0, 0, 6]]
    parts = poslsh.sample_partitions(torch.tensor([1.5, 4.0], dtype=torch.float64), 3, seed=5)
    count = parts.dense_count(7)
    slopes = 1 / parts.sigma
    oracles = [(lambda *a, **kw: poslsh.poslsh_attention_reference(*a, parts, **kw),
                lambda h, a, b: float(count[h, a, b])),
               (lambda *a, **kw: alibi_attention_reference(*a, slopes, **kw),
                lambda h, a, b: math.exp(-float(slopes[h]) * abs(a - b)))]
    for oracle, kernel in oracles:
        out, lse = oracle(q, k, v, causal=causal, document_ids=ids, return_lse=True)

        def weight(b, h, i, j):
            same = ids[b, i] == ids[b, j] and (not causal or j <= i)
            return kernel(h, i - starts[b][i], j - starts[b][j]) if same else 0.0

        want, want_lse = _loop_attention(q, k, v, weight, 3 ** -0.5)
        assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)


def test_documents_are_checked_at_the_boundary():
    q, k, v = make_qkv(2, 2, 2, 5, 3)
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 2, seed=0)
    with pytest.raises(ValueError, match="document_ids: row 0 has a document whose tokens are not contiguous"):
        poslsh.poslsh_attention_reference(q, k, v, parts, document_ids=torch.tensor([[0, 1, 0, 2, 2]] * 2))
    with pytest.raises(ValueError, match="batch of packed rows"):
        poslsh.poslsh_attention_reference(q, k, v, parts, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="end at the sequence length 5"):
        alibi_attention_reference(q[:1], k[:1], v[:1], poslsh.alibi_slopes(2), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
        alibi_attention_reference(q[:1], k[:1], v[:1], poslsh.alibi_slopes(2), cu_seqlens=torch.tensor([0., 5.]))
    with pytest.raises(ValueError, match="window: windows must be >= 0"):
        alibi_attention_reference(q, k, v, poslsh.alibi_slopes(2), window=torch.tensor([1, -1]))


def test_one_positions_rule_unequal_lengths_need_positions():
    """nq != nk without q_start raises in every oracle (and the fast ops), naming flash-attention's
    bottom-right mapping; with q_start = k_start + nk - nq the oracles give the last rows of the whole."""
    from poslsh.reference import dense_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = poslsh.alibi_slopes(2)
    parts = poslsh.sample_partitions(1 / slopes, 3, seed=0)
    rule = "pass q_start .*q_start = k_start \\+ nk - nq"
    calls = [lambda: alibi_attention_reference(q[:, :, 6:], k, v, slopes, causal=True),
             lambda: poslsh.poslsh_attention_reference(q[:, :, 6:], k, v, parts, causal=True),
             lambda: dense_attention(q[:, :, 6:], k, v, causal=True),
             lambda: poslsh.alibi.alibi_bias(9, slopes, num_queries=3),
             lambda: poslsh.poslsh_attention(q[:, :, 6:], k, v, parts, causal=True),
             lambda: poslsh.windowed_alibi_attention(q[:, :, 6:], k, v, slopes, window=3, causal=True)]
    for call in calls:
        with pytest.raises(ValueError, match=rule):
            call()
    whole = alibi_attention_reference(q, k, v, slopes, causal=True)
    last = alibi_attention_reference(q[:, :, 6:], k, v, slopes, causal=True, q_start=6)
    assert torch.equal(last, whole[:, :, 6:])
    bias = poslsh.alibi.alibi_bias(9, slopes, num_queries=3, q_start=6, causal=True)
    assert torch.equal(bias, poslsh.alibi.alibi_bias(9, slopes, causal=True)[:, 6:])
    assert torch.allclose(dense_attention(q[:, :, 6:], k, v, causal=True, q_start=6),
                          dense_attention(q, k, v, causal=True)[:, :, 6:], atol=1e-14, rtol=0)
