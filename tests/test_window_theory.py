"""The window's truncation bound (poslsh.window.theory): its closed form equals the per-query
maximum it claims, it is never violated by exact ALiBi cut at the window (float64 dense oracle,
random and adversarial inputs, causal and two-sided), it is attained by the adversarial instance
of its proof, and ``smallest_window`` is the smallest window meeting a tolerance. Real Q/K/V
(SmolLM2): paper/tests/experiments/test_frontier.py."""
import math

import pytest
import torch

import poslsh
from poslsh import theory
from poslsh.reference import alibi_attention_reference


def brute_ratio(w, sigma, n, causal):
    """max_i T_i / S_i by enumerating every query (dense)."""
    i = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    d = (i - j).abs()
    vis = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
    L = torch.exp(-d / sigma)
    S = (L * (vis & (d <= w))).sum(1)
    T = (L * (vis & (d > w))).sum(1)
    return T / S


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 97, 200])
def test_tail_ratio_closed_form_is_the_worst_query(n, causal):
    for sigma in (0.3, 1.41, 4.0, 50.0, 256.0):
        for w in sorted({0, 1, 2, n // 3, n // 2, max(0, n - 2), n - 1, 2 * n}):
            brute = brute_ratio(w, sigma, n, causal).max().item()
            got = theory.window_tail_ratio(w, sigma, causal=causal, n=n).item()
            assert got == pytest.approx(brute, rel=1e-10, abs=1e-300), (n, sigma, w, causal)
            # n=None is the supremum over every length
            assert theory.window_tail_ratio(w, sigma, causal=causal).item() >= got * (1 - 1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_tail_ratio_supremum_is_reached_at_long_lengths(causal):
    """n=None: the last query (causal) or the middle one (two-sided) of a long sequence."""
    for sigma, w in ((1.41, 5), (16.0, 40)):
        big = brute_ratio(w, sigma, 1500, causal).max().item()
        assert theory.window_tail_ratio(w, sigma, causal=causal).item() == pytest.approx(big, rel=1e-9)


def _dropped_and_error(q, k, v, slopes, window, causal):
    """max_i delta_i and ||T* - T^w||_max per head, from the dense float64 oracle."""
    full, lse = alibi_attention_reference(q, k, v, slopes, causal=causal, return_lse=True)
    cut, lse_w = alibi_attention_reference(q, k, v, slopes, causal=causal, window=window, return_lse=True)
    delta = -torch.expm1(lse_w - lse)                          # 1 - Z_W / (Z_W + Z_D)
    return delta.amax(dim=(0, 2)), (full - cut).abs().amax(dim=(0, 2, 3))


def _value_range(v, heads):
    vr = (v.amax(2) - v.amin(2)).amax(dim=(0, 2))              # [Hkv]
    return vr.repeat_interleave(heads // v.shape[1])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 97, pytest.param(1025, marks=pytest.mark.slow),
                               pytest.param(3000, marks=pytest.mark.slow)])
def test_bound_never_violated_on_random_inputs(n, causal):
    H, Hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(n)
    sigma = torch.tensor([1.41, 4.0, 32.0, 256.0], dtype=torch.float64)
    for logit_std in (0.5, 2.0, 4.0):
        q = torch.randn(2, H, n, d, generator=g, dtype=torch.float64) * math.sqrt(logit_std)
        k = torch.randn(2, Hkv, n, d, generator=g, dtype=torch.float64) * math.sqrt(logit_std)
        v = torch.randn(2, Hkv, n, 8, generator=g, dtype=torch.float64)
        R = theory.logit_range(q, k, causal=causal, chunk=64)
        for c in (0.0, 1.0, 3.0, 8.0):
            w = (c * sigma).round().to(torch.int64)
            delta, err = _dropped_and_error(q, k, v, 1 / sigma, w, causal)
            b = theory.window_error_bound(w, sigma, R, causal=causal, n=n)
            assert bool((delta <= b * (1 + 1e-9) + 1e-15).all()), (logit_std, c, delta, b)
            vr = _value_range(v, H)
            out = theory.window_error_bound(w, sigma, R, causal=causal, n=n, value_range=vr)
            assert bool((err <= out * (1 + 1e-9) + 1e-12).all()), (logit_std, c, err, out)
            assert bool((out <= b * 2 * v.abs().max() + 1e-12).all())        # value range <= 2 ||V||_max


def _worst_query(w, sigma, n, causal):
    return int(brute_ratio(w, sigma, n, causal).argmax())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,sigma,w,R", [(97, 4.0, 6, 3.0), (300, 32.0, 40, 8.0), (300, 2.0, 150, 0.0),
                                         (1000, 256.0, 100, 1.5), (64, 1.41, 0, 5.0)])
def test_bound_is_attained_by_the_adversarial_instance(n, sigma, w, R, causal):
    """Every dropped key of the worst query gets logit R, every kept key 0; values +1 / -1:
    the dropped mass equals the bound and the output error is twice it."""
    i0 = _worst_query(w, sigma, n, causal)
    j = torch.arange(n)
    dropped = (j - i0).abs() > w
    q = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    q[0, 0, i0, 0] = 1.0
    k = (dropped.to(torch.float64) * R)[None, None, :, None]
    v = torch.where(dropped, 1.0, -1.0).to(torch.float64)[None, None, :, None]
    delta, _ = _dropped_and_error(q, k, v, torch.tensor([1 / sigma]), w, causal)
    full = alibi_attention_reference(q, k, v, torch.tensor([1 / sigma]), causal=causal, scale=1.0)
    cut = alibi_attention_reference(q, k, v, torch.tensor([1 / sigma]), causal=causal, scale=1.0, window=w)
    err = float((full - cut)[0, 0, i0].abs().max())
    b = float(theory.window_error_bound(w, sigma, R, causal=causal, n=n))
    full_l, lse = alibi_attention_reference(q, k, v, torch.tensor([1 / sigma]), causal=causal, scale=1.0,
                                         return_lse=True)
    _, lse_w = alibi_attention_reference(q, k, v, torch.tensor([1 / sigma]), causal=causal, scale=1.0, window=w,
                                      return_lse=True)
    delta_i0 = float(-torch.expm1(lse_w - lse)[0, 0, i0])
    assert delta_i0 == pytest.approx(b, rel=1e-9)
    assert err == pytest.approx(2 * b, rel=1e-9)
    assert float(theory.window_error_bound(w, sigma, R, causal=causal, n=n, value_range=2.0)) == \
        pytest.approx(err, rel=1e-9)
    assert float(delta) <= 1.0


@pytest.mark.parametrize("causal", [True, False])
def test_a_far_key_with_a_large_logit_just_outside_the_window(causal):
    n, d, sigma = 700, 1, 16.0
    for w in (16, 64, 200):
        for R in (5.0, 20.0, 60.0):
            i0 = n - 1 if causal else n // 2
            q = torch.zeros(1, 1, n, d, dtype=torch.float64)
            q[..., i0, 0] = 1.0
            k = torch.zeros(1, 1, n, d, dtype=torch.float64)
            k[..., i0 - w - 1, 0] = R                             # one key right outside the window
            v = torch.zeros(1, 1, n, 1, dtype=torch.float64)
            v[..., i0 - w - 1, 0] = 1.0
            delta, err = _dropped_and_error(q, k, v, torch.tensor([1 / sigma]), w, causal)
            b = theory.window_error_bound(w, sigma, R, causal=causal, n=n)
            assert float(delta) <= float(b) * (1 + 1e-12)
            assert float(err) <= float(b) * 1.0 * (1 + 1e-12)      # value range 1
            assert float(delta) > 1e-3 * float(b) or float(b) < 1e-12   # one key: the bound is not far off


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [None, 1, 50, 4096])
def test_smallest_window_is_the_smallest_window(n, causal):
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.5, 1.41, 2.0, 8.0, 64.0, 256.0, 1000.0], dtype=torch.float64)
    for _ in range(6):
        R = float(torch.rand((), generator=g) * 20)
        tol = float(10 ** (-torch.rand((), generator=g) * 8))
        for value_range in (None, 2.0):
            w = theory.smallest_window(tol, sigma, R, causal=causal, n=n, value_range=value_range)
            assert w.dtype == torch.int64 and w.shape == sigma.shape
            b = theory.window_error_bound(w, sigma, R, causal=causal, n=n, value_range=value_range)
            assert bool((b <= tol).all()), (R, tol, w, b)
            below = theory.window_error_bound((w - 1).clamp(min=0), sigma, R, causal=causal, n=n,
                                              value_range=value_range)
            assert bool(((w == 0) | (below > tol)).all()), (R, tol, w, below)
            if n is not None:
                assert bool((w <= n - 1).all() | (n == 1))
    # about sigma (R + ln 1/tol) for the causal n=None case
    w = theory.smallest_window(1e-3, torch.tensor([100.0]), 10.0)
    assert abs(float(w) - 100 * (10 + math.log(1e3))) < 100 * 0.01 + 1


def test_smallest_window_meets_the_tolerance_on_the_dense_oracle():
    n, H, d = 700, 3, 8
    g = torch.Generator().manual_seed(3)
    sigma = torch.tensor([2.0, 16.0, 64.0], dtype=torch.float64)
    q = torch.randn(1, H, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, H, n, d, generator=g, dtype=torch.float64)
    v = torch.rand(1, H, n, 4, generator=g, dtype=torch.float64)          # values in [0, 1): range <= 1
    R = theory.logit_range(q, k)
    for tol in (1e-2, 1e-5):
        w = theory.smallest_window(tol, sigma, R, n=n, value_range=1.0)
        _, err = _dropped_and_error(q, k, v, 1 / sigma, w, True)
        assert bool((err <= tol).all())


def test_logit_range_and_argument_errors():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 33, 8, generator=g), torch.randn(2, 2, 33, 8, generator=g)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double().repeat_interleave(2, 1)) / math.sqrt(8)
    later = torch.ones(33, 33, dtype=torch.bool).triu(1)
    want = (s.masked_fill(later, -math.inf).amax(-1) - s.masked_fill(later, math.inf).amin(-1)).amax(dim=(0, 2))
    torch.testing.assert_close(theory.logit_range(q, k, chunk=5), want)
    want2 = (s.amax(-1) - s.amin(-1)).amax(dim=(0, 2))
    torch.testing.assert_close(theory.logit_range(q, k, causal=False, chunk=7), want2)
    assert float(theory.window_error_bound(10, 4.0, 3.0, n=11)) == 0.0       # w >= n - 1 drops nothing
    assert float(theory.window_error_bound(0, 4.0, 0.0, n=1)) == 0.0
    for call, match in [(lambda: theory.window_error_bound(-1, 4.0, 1.0), "w must be whole"),
                        (lambda: theory.window_error_bound(1.5, 4.0, 1.0), "w must be whole"),
                        (lambda: theory.window_error_bound(3, 0.0, 1.0), "sigma must be > 0"),
                        (lambda: theory.window_error_bound(3, 4.0, -1.0), "logit_range must be >= 0"),
                        (lambda: theory.window_error_bound(3, 4.0, 1.0, n=0), "n must be None"),
                        (lambda: theory.smallest_window(0.0, 4.0, 1.0), "tol must be > 0"),
                        (lambda: theory.window_error_bound(3, float("nan"), 1.0), "sigma must be finite"),
                        (lambda: theory.logit_range(q[0], k), "expected")]:
        with pytest.raises(ValueError, match=match):
            call()


def _within(seconds, fn):
    """``fn()``, or a failure after ``seconds`` (a bisection that never ends fails instead of hanging)."""
    import signal

    def stop(*_):
        raise AssertionError(f"did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _smallest(w, tol, sigma, R, **kw):
    """``w`` meets ``tol`` and ``w - 1`` does not (the bound evaluated in float64, as the inverse does)."""
    assert bool((theory.window_error_bound(w, sigma, R, **kw) <= tol).all())
    below = theory.window_error_bound((w - 1).clamp(min=0), sigma, R, **kw)
    assert bool(((w == 0) | (below > tol)).all()), (w, below)


@pytest.mark.parametrize("causal", [True, False])
def test_smallest_window_of_huge_sigma_returns(causal):
    """Windows past 2^53 (where float64 has no room between integers) come back, the smallest in
    float64; past int64 (sigma ~1e300, any length) the window is NO_WINDOW, which drops nothing at
    any length a tensor can have; with n, the smallest of at most n - 1."""
    from poslsh.window.kind import NO_WINDOW
    sigma = torch.tensor([1e15, 1e16, 1e17], dtype=torch.float64)
    w = _within(20, lambda: theory.smallest_window(1e-3, sigma, 5.0, causal=causal))
    assert bool((w > 2 ** 53).all()) and w.dtype == torch.int64
    _smallest(w, 1e-3, sigma, 5.0, causal=causal)
    huge = _within(20, lambda: theory.smallest_window(1e-3, [1e300, 2.0], 5.0, causal=causal))
    assert int(huge[0]) == NO_WINDOW and 0 < int(huge[1]) < 100
    at_n = _within(20, lambda: theory.smallest_window(1e-3, 1e300, 5.0, causal=causal, n=10 ** 6))
    assert 0 < int(at_n) <= 10 ** 6 - 1
    _smallest(at_n, 1e-3, 1e300, 5.0, causal=causal, n=10 ** 6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("R", [740.0, 800.0, 1e5])
def test_smallest_window_of_a_large_logit_range(R, causal):
    """e^{-R} underflows past R ~ 745: the inverse works in log space (the window grows like sigma R)."""
    sigma = torch.tensor([0.5, 10.0, 256.0], dtype=torch.float64)
    for value_range in (None, 2.0):
        w = theory.smallest_window(1e-3, sigma, R, causal=causal, value_range=value_range)
        _smallest(w, 1e-3, sigma, R, causal=causal, value_range=value_range)
        assert bool((w.double() >= sigma * R * 0.99).all())


def test_per_head_arguments_of_different_lengths_are_named():
    with pytest.raises(ValueError, match=r"tol has 3 values but sigma has 2"):
        theory.smallest_window(torch.tensor([1e-3, 1e-2, 0.1]), torch.tensor([1.0, 2.0]), 5.0)
    with pytest.raises(ValueError, match=r"sigma has 2 values but logit_range has 3"):
        theory.smallest_window(1e-3, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"w has 3 values but sigma has 2"):
        theory.window_error_bound(torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0]), 5.0)
    with pytest.raises(ValueError, match=r"w has 3 values but sigma has 2"):
        theory.window_tail_ratio(torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"w has 3 values but value_range has 2"):
        theory.window_error_bound(torch.tensor([1, 2, 3]), 2.0, 5.0, value_range=[1.0, 2.0])
    one = theory.smallest_window(torch.tensor([1e-3]), torch.tensor([1.0, 2.0]), 5.0)   # one for every head
    assert one.shape == (2,)
