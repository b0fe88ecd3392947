"""Decoding patched BLOOM / MPT / Falcon models with fixed windows on the per-head window cache
(poslsh.integrations.hf.alibi.cache): the same tokens and float64 logits as without a cache, each KV
head holding its own window (w_h + 1 rows), beams and left padding, the certificate, refusals."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from poslsh.decoding import Certificate  # noqa: E402
from poslsh.integrations.hf import AppendCache, PoslshCache, alibi_cache, patch_alibi  # noqa: E402

WINDOWS = [4, 9, 17, 40]


def _bloom(heads=4, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=8 * heads, n_layer=layers, n_head=heads)
    return transformers.BloomForCausalLM(cfg).double().eval()


def _mpt(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=32)
    return transformers.MptForCausalLM(cfg).double().eval()


def _falcon(seed=0, **extra):
    torch.manual_seed(seed)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, **extra)
    return transformers.FalconForCausalLM(cfg).double().eval()


def test_bloom_generates_300_tokens_as_without_a_cache_holding_each_heads_window():
    """float64 greedy generation of 300 tokens on the per-head window cache = use_cache=False; each KV
    head keeps w_h + 1 rows; the bytes are within 1.15x sum_h (w_h + 1) (dk + dv) 8 per layer."""
    model = patch_alibi(_bloom(), window=WINDOWS)
    x = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    out = model.generate(x, max_new_tokens=300, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, PoslshCache)
    ref = model.generate(x, max_new_tokens=300, do_sample=False, use_cache=False)
    assert torch.equal(out.sequences, ref)
    assert cache.kept_keys().tolist() == [[w + 1 for w in WINDOWS]] * 2
    d = 8
    assert cache.nbytes() <= 1.15 * sum(w + 1 for w in WINDOWS) * (d + d) * 8 * 2


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon", "falcon-grouped"])
def test_stepwise_float64_logits_equal_one_forward_without_cache(family):
    """Prefill then one token at a time on alibi_cache(model): every step's float64 logits equal the
    windowed model's one forward over the whole sequence (1e-10); MPT goes past its max_seq_len."""
    model = {"bloom": _bloom, "mpt": _mpt, "falcon": _falcon,
             "falcon-grouped": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2)}[family]()
    patch_alibi(model, window=WINDOWS)
    seq = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(seq).logits
        cache = alibi_cache(model)
        steps = [model(seq[:, :20], cache=cache, use_cache=True).logits]
        for t in range(20, seq.shape[1]):
            steps.append(model(seq[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-10
    assert cache.kept_keys().max().item() == max(WINDOWS) + 1


def test_left_padded_batch_and_beams_decode_as_without_a_cache():
    model = patch_alibi(_bloom(seed=3), window=WINDOWS)
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
        got = model.generate(x, attention_mask=mask, max_new_tokens=60, **kw)
        ref = model.generate(x, attention_mask=mask, max_new_tokens=60, use_cache=False, **kw)
        assert torch.equal(got, ref), kw
    one = model.generate(x[1:, 4:], max_new_tokens=60, do_sample=False)
    assert torch.equal(model.generate(x, attention_mask=mask, max_new_tokens=60, do_sample=False)[1, 4:], one[0])


def test_each_mode_decodes_on_its_cache():
    """Exact ALiBi, positional LSH and Falcon's bfloat16 bias decode on the AppendCache (every key) and
    alibi_cache says why in one line; fixed and certified windows on the per-head window cache (certified: with
    the certificate of patch_alibi's tol); re-patching changes the cache."""
    x = torch.randint(0, 64, (1, 8))
    model = _bloom()
    for kw in (dict(), dict(num_samples=3)):
        patch_alibi(model, **kw)
        out = model.generate(x, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert isinstance(out.past_key_values, AppendCache), kw
        with pytest.raises(ValueError, match="no per-head window cache"):
            alibi_cache(model)
    for kw in (dict(window=8), dict(window="certified", tol=1e-3)):
        patch_alibi(model, **kw)
        out = model.generate(x, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert isinstance(out.past_key_values, PoslshCache), kw
    assert out.past_key_values.layers[0].certificate == Certificate(1e-3, "warn")
    model.train()
    out = model.generate(x, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert type(out.past_key_values) is transformers.DynamicCache
    falcon = patch_alibi(_falcon(), window=8, falcon_bias="bfloat16")
    with pytest.raises(ValueError, match="bfloat16"):
        alibi_cache(falcon)
    assert isinstance(falcon.generate(x, max_new_tokens=2, return_dict_in_generate=True).past_key_values, AppendCache)
    with pytest.raises(ValueError, match="not patched"):
        alibi_cache(_bloom())


def test_a_too_small_window_trips_the_certificate():
    """A window of one key per head on a tolerance of 1e-9: the per-step certificate raises (policy
    'raise'), in one line naming the tolerance."""
    model = patch_alibi(_bloom(), window=1)
    cache = alibi_cache(model, certificate=Certificate(1e-9, "raise"))
    x = torch.randint(0, 64, (1, 30))
    with pytest.raises(ValueError, match="tol"), torch.no_grad():
        for t in range(30):
            model(x[:, t:t + 1], cache=cache, use_cache=True)
