import math

import pytest
import torch

import poslsh
from poslsh import theory

from inputs import make_qkv


def test_alibi_attention_matches_explicit_formula():
    q, k, v = make_qkv(2, 4, 2, 33, 8)
    slopes = poslsh.alibi_slopes(4)
    out = poslsh.alibi_attention(q, k, v, slopes, causal=True)
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
    exact = poslsh.alibi_attention(q, k, v, 1.0 / sigma, causal=causal)
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
        poslsh.alibi_attention(q, k, v, poslsh.alibi_slopes(3))
