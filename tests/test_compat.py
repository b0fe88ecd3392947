"""The old spellings of 0.2 (CHANGELOG 0.3.0): every one still works, gives the new answer and warns
once (PoslshDeprecationWarning, a FutureWarning); a reordered parameter refuses the old order. The
rest of the suite fails on any of them (pyproject's filterwarnings)."""
import importlib

import pytest
import torch

import poslsh
import poslsh.decoding
from poslsh._compat import PoslshDeprecationWarning, reset_warnings


@pytest.fixture(autouse=True)
def fresh():
    reset_warnings()
    yield
    reset_warnings()


def old(get):
    """``get()`` with an old spelling: it warns once (and only once), and returns what it returned."""
    with pytest.warns(PoslshDeprecationWarning, match="next release"):
        first = get()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = get()                      # the second use is silent
    return first, second


MOVED = [("poslsh.alibi", "AlibiWindow", lambda: poslsh.AlibiWindow),
         ("poslsh.alibi", "make_window", lambda: poslsh.window.make_window),
         ("poslsh.attention", "windowed_alibi_attention", lambda: poslsh.windowed_alibi_attention),
         ("poslsh.attention_nd", "poslsh_attention_2d", lambda: poslsh.attention.poslsh_attention_2d),
         ("poslsh.cost", "cost_matched_window", lambda: poslsh.window.cost_matched_window),
         ("poslsh.cost", "window_keys_per_query", lambda: poslsh.window.window_keys_per_query),
         ("poslsh.window_theory", "window_error_bound", lambda: poslsh.window.window_error_bound),
         ("poslsh.window_theory", "logit_range", lambda: poslsh.window.logit_range)]


@pytest.mark.parametrize("module,name,new", MOVED, ids=[f"{m}.{n}" for m, n, _ in MOVED])
def test_moved_names_still_import(module, name, new):
    mod = importlib.import_module(module)
    first, second = old(lambda: getattr(mod, name))
    assert first is new() and second is new()


def test_renamed_functions_and_keywords_give_the_new_answers():
    sigma = poslsh.alibi_sigmas(4)
    w_new = poslsh.window.smallest_window(1e-3, sigma, 4.0)
    w_old, _ = old(lambda: poslsh.theory.alibi_window(sigma, 1e-3, 4.0))          # its old order
    assert torch.equal(w_old, w_new)
    got, _ = old(lambda: poslsh.window.cost_matched_window(sigma, s=10))
    assert torch.equal(got, poslsh.window.cost_matched_window(sigma, num_samples=10))
    got, _ = old(lambda: poslsh.cost.poslsh_keys_per_query(sigma, s=10))
    assert torch.equal(got, poslsh.cost.poslsh_keys_per_query(sigma, 10))
    with pytest.raises(TypeError, match="pass num_samples= only"):
        poslsh.cost.poslsh_keys_per_query(sigma, s=10, num_samples=10)
    parts = poslsh.sample_partitions(sigma, 3, seed=0)
    got, _ = old(lambda: poslsh.decoding.op_of(parts))
    assert got == parts.op == "sequence"


def test_the_rate_in_either_word_exactly_once():
    """Ops, biases and modules take slopes (sigma= by keyword); samplers, cost and theory take sigma
    (slopes= by keyword); both or neither is one line."""
    slopes = poslsh.alibi_slopes(4)
    sigma = 1 / slopes
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 30, 8, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.equal(poslsh.windowed_alibi_attention(q, k, v, sigma=sigma, window=5),
                       poslsh.windowed_alibi_attention(q, k, v, slopes, window=5))
    assert torch.equal(poslsh.alibi_attention(q, k, v, sigma=sigma), poslsh.alibi_attention(q, k, v, slopes))
    assert torch.equal(poslsh.window.cost_matched_window(slopes=slopes, num_samples=5),
                       poslsh.window.cost_matched_window(sigma, 5))
    assert torch.equal(poslsh.window.smallest_window(1e-3, slopes=slopes, logit_range=2.0),
                       poslsh.window.smallest_window(1e-3, sigma, 2.0))
    with pytest.raises(TypeError, match="pass slopes= or sigma= .*not both"):
        poslsh.windowed_alibi_attention(q, k, v, slopes, sigma=sigma, window=5)
    with pytest.raises(TypeError, match="pass the per-head rate"):
        poslsh.alibi_attention(q, k, v)
    with pytest.raises(TypeError, match="not both"):
        poslsh.window.cost_matched_window(sigma, 5, slopes=slopes)


def test_stage_renames_of_the_nd_family_and_the_sampler():
    sig = poslsh.alibi_sigmas(2)
    got, _ = old(lambda: poslsh.sample_partitions(sig, 4, seed=0, method="grouped"))
    assert got == poslsh.sample_partitions(sig, 4, seed=0, sampler="grouped")
    got, _ = old(lambda: poslsh.sample_partitions_nd(sig, 4, seed=0, method="stratified"))
    assert got == poslsh.sample_partitions_nd(sig, 4, seed=0, sampler="stratified")
    boxes, _ = old(lambda: poslsh.PartitionsND.fixed_boxes(2, (2, 3)))
    assert boxes == poslsh.PartitionsND.fixed_blocks(2, (2, 3))
    coords = poslsh.partitions_nd.grid_coords(4, 6)
    (lo, hi), _ = old(lambda: boxes.box_bounds(coords, (4, 6)))
    want = boxes.block_bounds((4, 6), coords)
    assert torch.equal(lo, want[0]) and torch.equal(hi, want[1])
    got, _ = old(lambda: boxes.max_box_size(coords))
    assert got == boxes.max_block_size(coords) == 6
    q, k, v = (torch.randn(1, 2, 24, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = poslsh.poslsh_attention_nd(q, k, v, boxes, grid=(4, 6))
    fn, _ = old(lambda: poslsh.poslsh_attention_2d)                # the top-level name
    got, _ = old(lambda: fn(q, k, v, boxes, (4, 6)))               # the old name, its grid positional
    assert torch.equal(got, want)
    got, _ = old(lambda: poslsh.available_backends(op="grid"))
    assert got == poslsh.available_backends(op="nd")
    with pytest.raises(TypeError):                                 # the new name: grid= keyword-only
        poslsh.poslsh_attention_nd(q, k, v, boxes, (4, 6))


def test_reordered_theory_refuses_the_old_order():
    """A parameter that moved is keyword-only: the order of 0.2 is refused in one line, never reread."""
    from poslsh import theory
    for call, name in [(lambda: theory.block_size_bound(8.0, 10, 0.01), "block_size_bound"),
                       (lambda: theory.delta_p(0.3, 4.0, 100, 10, 0.01), "delta_p"),
                       (lambda: theory.output_error_bound(0.9, 0.3, 1.0, 4.0, 100, 10, 0.01), "output_error_bound"),
                       (lambda: theory.smallest_constant(0.1, 0.9, 0.3, 1.0, 4.0, 100, 10, 0.01), "smallest_constant"),
                       (lambda: theory.mask_error_matvec([0], [1], 1, 4.0, 1), "mask_error_matvec")]:
        with pytest.raises(TypeError, match=f"{name}: its arguments after the first .* keyword-only since poslsh 0.3"):
            call()
    got, _ = old(lambda: theory.block_size_bound(sigma=8.0, s=10, delta=0.01))
    assert got == theory.block_size_bound(num_samples=10, sigma=8.0, delta=0.01)
    got, _ = old(lambda: theory.spectral_expectation_bound(100, s=10, sigma=4.0))
    assert got == theory.spectral_expectation_bound(100, 10, 4.0) == theory.spectral_expectation_bound(
        100, 10, slopes=0.25)
    with pytest.raises(TypeError, match="not both"):
        theory.psi(4.0, slopes=0.25)


def test_modules_and_dropped_top_level_names():
    layer = poslsh.PoslshAttention(num_heads=2, num_samples=3).eval()
    q, k, v = (torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    got, _ = old(lambda: layer(q, k, v))
    assert torch.equal(got, layer.attend(q, k, v))
    sched = poslsh.PartitionSchedule(slopes=poslsh.alibi_slopes(2), num_samples=3)
    assert torch.allclose(sched.sigma, poslsh.alibi_sigmas(2))
    for name, where in [("make_window", poslsh.window), ("Documents", poslsh.documents),
                        ("grid_coords", poslsh.partitions_nd), ("alibi_bias", poslsh.alibi),
                        ("alibi_attention_nd", poslsh.reference), ("Blocks", poslsh.partitions)]:
        assert name not in poslsh.__all__
        got, _ = old(lambda: getattr(poslsh, name))
        assert got is getattr(where, name)
