"""The expected keys per query of positional LSH (poslsh.cost) against counted unions of blocks, and the
window of its cost (poslsh.cost)."""
import math

import pytest
import torch

import poslsh
from poslsh.cost import poslsh_keys_per_query
from poslsh.cost import cost_matched_window, window_keys_per_query


@pytest.mark.parametrize("causal", [True, False])
def test_expected_keys_per_query_equal_counted_unions(causal):
    """Mean over many draws of |union of a middle query's blocks| (restricted to j <= i when causal)."""
    sigma, s, n, draws = torch.tensor([1.5, 6.0, 30.0], dtype=torch.float64), 7, 2001, 400
    counted = torch.zeros(3, dtype=torch.float64)
    i = torch.tensor([n // 2])
    for d in range(draws):
        parts = poslsh.sample_partitions(sigma, s, seed=d)
        start, end = parts.block_bounds(n, i)                          # [H, s, 1]
        lo, hi = start.amin(1)[:, 0], (i + 1 if causal else end.amax(1)[:, 0])
        counted += (hi - lo).to(torch.float64)
    counted /= draws
    want = poslsh_keys_per_query(sigma, s, causal=causal)
    print(counted.tolist(), want.tolist())
    assert torch.allclose(counted, want, rtol=0.06)
    harmonic = sum(1 / k for k in range(1, s + 1))
    assert torch.allclose(want[-1], torch.tensor(1 + (1 if causal else 2) * 30.0 * harmonic, dtype=torch.float64),
                          rtol=0.05)                                  # ~ sigma H_s for wide heads


def test_cost_matched_window_and_errors():
    sigma = poslsh.alibi_sigmas(8)
    w = cost_matched_window(sigma, 10)
    assert w.dtype == torch.int64 and torch.allclose(window_keys_per_query(w).double(),
                                                     poslsh_keys_per_query(sigma, 10), atol=0.5)
    assert int(cost_matched_window([256.0], 1)) == round(sum(math.exp(-x / 256) for x in range(1, 20000)))
    with pytest.raises(ValueError, match="s must be an int"):
        poslsh_keys_per_query(sigma, 0)
    with pytest.raises(ValueError, match="sigma must be finite"):
        poslsh_keys_per_query([0.0], 3)
