import math

import pytest
import torch

import poslsh


def test_power_of_two_slopes_are_geometric():
    for H in (1, 2, 4, 8, 16):
        s = poslsh.alibi_slopes(H)
        expected = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float64)
        assert torch.allclose(s, expected), (H, s, expected)


def test_interleaved_slopes_for_non_powers_of_two():
    s12 = poslsh.alibi_slopes(12)
    assert torch.allclose(s12[:8], poslsh.alibi_slopes(8))
    assert torch.allclose(s12[8:], poslsh.alibi_slopes(16)[0::2][:4])
    s40 = poslsh.alibi_slopes(40)
    assert s40.shape == (40,) and torch.allclose(s40[:32], poslsh.alibi_slopes(32))
    assert torch.allclose(s40[32:], poslsh.alibi_slopes(64)[0::2][:8])
    assert torch.allclose(poslsh.alibi_sigmas(12), 1.0 / s12)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_head_count(bad):
    with pytest.raises(ValueError, match="num_heads"):
        poslsh.alibi_slopes(bad)


def test_bias_and_matrix_agree():
    slopes = poslsh.alibi_slopes(4)
    n = 9
    bias = poslsh.alibi.alibi_bias(n, slopes, dtype=torch.float64)
    L = poslsh.alibi.alibi_matrix(n, 1.0 / slopes)
    assert torch.allclose(torch.exp(bias), L)
    causal = poslsh.alibi.alibi_bias(n, slopes, causal=True)
    assert torch.isinf(causal[:, 0, 1]).all() and causal[:, 3, 1].eq(-2 * slopes.float()).all()
    assert L[0, 2, 5].item() == pytest.approx(math.exp(-3 * slopes[0].item()))
