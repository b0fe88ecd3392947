"""The native ALiBi encoders against the float64 oracle of each original design
(encoders_reference: the padded dense forward with the original's float32 ALiBi table and masks):
hidden states, padded zeros, pooled embeddings, the heads' logits; float32 against the original's
own float32 arithmetic; padding invariance; a long input; windows, certified windows; nothing of
``n x n`` size."""
import pytest
import torch

import encoders_reference as R
from inputs import LargestTensor
from poslsh.integrations.hf.encoders import load_alibi_encoder, pool_embeddings

LENGTHS = [1, 2, 97, 300, 600, 37]          # solo rows (>= 256) and packed runs of short ones


def _sampled_lengths(seed=3, count=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 601, (count,), generator=g).tolist()


def _valid_diff(a, b, mask):
    v = mask.bool()
    return float((a[v] - b[v]).detach().abs().max())


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("layout,heads,head", [("mosaic", 4, "mlm"), ("mosaic", 12, "classification"),
                                               ("jina", 4, "none"), ("jina-qk-norm", 4, "mlm")])
def test_float64_equals_the_original(tmp_path, layout, heads, head):
    """1e-10 in float64, 12 heads included (slopes 2^-0.5, ...: the float32 table kept)."""
    d, cfg, st = R.checkpoint(tmp_path, layout, head=head, heads=heads, hidden=48 if heads == 12 else 32,
                              pooler=layout == "jina")
    model = load_alibi_encoder(d, dtype=torch.float64)
    lengths = LENGTHS + _sampled_lengths() if heads == 4 else [1, 97, 600, 300]
    ids, mask, tt = R.padded_batch(lengths, cfg["vocab_size"])
    out = model(ids, mask, tt)
    ref = R.reference(layout, cfg, st, ids, mask, tt)
    h = out.last_hidden_state
    assert _valid_diff(h, ref["last_hidden_state"], mask) <= 1e-10
    assert torch.equal(h[~mask.bool()], torch.zeros_like(h[~mask.bool()]))       # padded positions exactly 0
    ref_h = ref["last_hidden_state"] * mask[..., None]                             # Jina computes its padding
    for how in ("mean", "cls"):
        got, want = pool_embeddings(h, mask, how=how), pool_embeddings(ref_h, mask, how=how)
        assert float((got - want).abs().max()) <= 1e-10
    if head == "mlm":
        rows = mask.bool() if layout != "mosaic" else torch.ones_like(mask, dtype=torch.bool)   # MosaicBERT: padded too
        assert _valid_diff(out.logits, ref["logits"], rows) <= 1e-10
    if head == "classification" or layout == "jina":
        assert float((out.pooler_output - ref["pooler_output"]).abs().max()) <= 1e-10
    if head == "classification":
        assert out.logits.shape == (ids.shape[0], 3) and float((out.logits - ref["logits"]).abs().max()) <= 1e-10


@pytest.mark.parametrize("layout,heads", [("mosaic", 12), ("jina", 4), ("jina-qk-norm", 4)])
def test_float32_equals_the_originals_float32(tmp_path, layout, heads):
    d, cfg, st = R.checkpoint(tmp_path, layout, heads=heads, hidden=48 if heads == 12 else 32)
    model = load_alibi_encoder(d)
    ids, mask, tt = R.padded_batch([5, 300, 450, 120], cfg["vocab_size"], seed=1)
    h = model(ids, mask, tt).last_hidden_state
    assert h.dtype == torch.float32
    assert _valid_diff(h, R.reference(layout, cfg, st, ids, mask, tt, dtype=torch.float32)["last_hidden_state"],
                       mask) <= 1e-5
    assert _valid_diff(h.double(), R.reference(layout, cfg, st, ids, mask, tt)["last_hidden_state"], mask) <= 1e-4


def test_left_padding_and_the_default_mask(tmp_path):
    d, cfg, st = R.checkpoint(tmp_path, "mosaic")
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([3, 290, 40], cfg["vocab_size"], left=True)
    ref = R.reference("mosaic", cfg, st, ids, mask, tt)
    assert float((model(ids, mask, tt).last_hidden_state - ref["last_hidden_state"]).abs().max()) <= 1e-10
    full = model(ids[1:2]).last_hidden_state                              # no mask, no token types: defaults
    assert float((full - R.reference("mosaic", cfg, st, ids[1:2])["last_hidden_state"]).abs().max()) <= 1e-10


@pytest.mark.parametrize("layout", ["mosaic", "jina-qk-norm"])
def test_a_row_alone_equals_the_row_in_a_padded_batch(tmp_path, layout):
    d, cfg, _ = R.checkpoint(tmp_path, layout)
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([270, 1, 55, 400, 12], cfg["vocab_size"], seed=2)
    batch = model(ids, mask, tt).last_hidden_state
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        alone = model(ids[r:r + 1, :n], mask[r:r + 1, :n], tt[r:r + 1, :n]).last_hidden_state
        assert float((alone[0] - batch[r, :n]).abs().max()) <= 1e-12


@pytest.mark.parametrize("layout", ["mosaic", "jina-qk-norm"])
def test_the_feed_forward_runs_in_blocks_at_inference(tmp_path, monkeypatch, layout):
    """Eval under no_grad: the ``[nnz, 2I]`` intermediate never exists whole (blocks of FEED_FORWARD_ROWS
    tokens, one a remainder), and the answer is the original's (float64, 1e-10)."""
    from poslsh.integrations.hf.encoders import layers
    monkeypatch.setattr(layers, "FEED_FORWARD_ROWS", 50)
    d, cfg, st = R.checkpoint(tmp_path, layout, hidden=16, heads=4, intermediate=200)
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([300, 7, 120], cfg["vocab_size"], seed=5)
    with LargestTensor() as watch:
        h = model(ids, mask, tt).last_hidden_state
    assert watch.largest < 427 * 2 * 200 // 4                          # a quarter of the whole intermediate
    assert _valid_diff(h, R.reference(layout, cfg, st, ids, mask, tt)["last_hidden_state"], mask) <= 1e-10


def test_a_long_input_builds_nothing_of_n_by_n(tmp_path):
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", hidden=16, heads=4, intermediate=24)
    model = load_alibi_encoder(d)
    ids, mask, tt = R.padded_batch([2400, 3], cfg["vocab_size"], seed=4)
    with torch.no_grad(), LargestTensor() as watch:
        h = model(ids, mask, tt).last_hidden_state
    assert watch.largest <= 2400 * 100                                   # O(n): 1/24 of one 2400 x 2400 matrix
    ref = R.reference("mosaic", cfg, st, ids, mask, tt, dtype=torch.float32)
    assert _valid_diff(h, ref["last_hidden_state"], mask) <= 1e-5


def test_fixed_windows_equal_the_windowed_original(tmp_path):
    d, cfg, st = R.checkpoint(tmp_path, "jina")
    ids, mask, tt = R.padded_batch([300, 80, 7], cfg["vocab_size"], seed=5)
    for window in (0, 5, [3, 50, 1, 400]):
        model = load_alibi_encoder(d, dtype=torch.float64, window=window)
        ref = R.reference("jina", cfg, st, ids, mask, tt, window=window)
        assert _valid_diff(model(ids, mask, tt).last_hidden_state, ref["last_hidden_state"], mask) <= 1e-10
        assert model.attention_stats()[0]["window"] == ([window] * 4 if isinstance(window, int) else window)


def test_certified_windows_keep_their_tolerance(tmp_path):
    """Tight tolerance: the exact output; tol 1e-3: narrower windows, the pooled embedding close."""
    pytest.importorskip("transformers")        # the logit-range bound lives beside the decoders' (hf_alibi_layer)
    d, cfg, _ = R.checkpoint(tmp_path, "mosaic", hidden=16, intermediate=24)
    ids, mask, tt = R.padded_batch([1200, 30], cfg["vocab_size"], seed=6)
    exact = load_alibi_encoder(d, dtype=torch.float64)(ids, mask, tt).last_hidden_state
    tight = load_alibi_encoder(d, dtype=torch.float64, window="certified", tol=1e-14)
    assert float((tight(ids, mask, tt).last_hidden_state - exact).abs().max()) <= 1e-10
    loose = load_alibi_encoder(d, dtype=torch.float64, window="certified", tol=1e-3)
    pooled = pool_embeddings(loose(ids, mask, tt).last_hidden_state, mask)
    stats = loose.attention_stats()
    assert all(s["mode"] == "certified" and len(s["window"]) == 4 and len(s["logit_range"]) == 4 for s in stats)
    assert min(stats[0]["window"]) < 1199                                 # the steep heads are cut
    assert float((pooled - pool_embeddings(exact, mask)).abs().max()) <= 0.05
