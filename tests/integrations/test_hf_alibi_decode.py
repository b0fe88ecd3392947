"""Decoding patched BLOOM / MPT / Falcon on the caches generate() picks (poslsh.integrations.hf.alibi.cache).
Exact ALiBi on the AppendCache: tokens and float64 step logits equal the untouched model's (its float64
reference), greedy and beams, left padding, batch > 1, MPT past max_seq_len, Falcon multi-query and grouped;
the cache is appended in place (its buffer stays put below capacity, the step copies no layer's keys, the keys
reach the kernel as views of it). Certified windows on a per-head bounded cache: tokens equal exact's over 300
tokens, each KV head holds at most w_j + 1 rows, the certificate checks every step and its policies act."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poslsh.decoding import Certificate, CertificateWarning  # noqa: E402
from poslsh.integrations.hf import AppendCache, PoslshCache, alibi_cache, alibi_stats, patch_alibi  # noqa: E402
from poslsh.ops.torch import decode, ops as torch_ops  # noqa: E402

from alibi_reference import left_padded_batch, reference_model, tiny_model  # noqa: E402
from inputs import NewStorage  # noqa: E402

GEN = {"greedy": dict(do_sample=False), "beams": dict(do_sample=False, num_beams=3)}


@pytest.fixture
def made(monkeypatch):
    """The caches generate() made for patched models (MPT's output does not return its cache)."""
    from poslsh.integrations.hf.alibi import cache as alibi_cache_module

    caches = []

    def record(model):
        caches.append(original(model))
        return caches[-1]

    original = alibi_cache_module.generation_cache_of
    monkeypatch.setattr(alibi_cache_module, "generation_cache_of", record)
    return caches


@pytest.mark.parametrize("how", sorted(GEN))
@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon_mq", "falcon_gqa"])
def test_exact_decoding_equals_the_untouched_model(name, how, made):
    """A left-padded batch of 3, 80 new tokens (MPT: past its max_seq_len of 64, against a wider MPT with the same
    weights): the same tokens, on an AppendCache; every step's float64 logits to 1e-10."""
    model = tiny_model(name, pad_token_id=0)
    ref = reference_model(tiny_model(name, pad_token_id=0, **({"max_seq_len": 256} if name == "mpt" else {})))
    patch_alibi(model)
    x, mask = left_padded_batch(12, (0, 3, 5), seed=2, low=3)
    kw = dict(attention_mask=mask, max_new_tokens=80, pad_token_id=0, return_dict_in_generate=True,
              use_cache=True, **GEN[how])                             # (MptConfig's default: no cache)
    got, want = model.generate(x, **kw), ref.generate(x, **kw)
    assert len(made) == 1 and isinstance(made[0], AppendCache) and made[0].get_seq_length() == 12 + 79
    assert got.sequences.shape[1] == 12 + 80
    assert torch.equal(got.sequences, want.sequences)
    if how == "beams":
        return
    # generate() hands out float32 logits: the float64 steps, by hand, against the reference's one forward
    seq, full_mask = got.sequences, torch.cat([mask, torch.ones(3, 80, dtype=mask.dtype)], 1)
    cache, steps = AppendCache(), []
    with torch.no_grad():
        steps.append(model(seq[:, :12], attention_mask=full_mask[:, :12], cache=cache, use_cache=True).logits[:, -1:])
        for t in range(12, seq.shape[1] - 1):
            steps.append(model(seq[:, t:t + 1], attention_mask=full_mask[:, :t + 1], cache=cache,
                               use_cache=True).logits)
        want = ref(seq[:, :-1], attention_mask=full_mask[:, :-1]).logits[:, 11:]
    got = torch.cat(steps, 1)
    err = float((got - want).abs().max())
    print(f"{name}: max float64 logit difference over {got.shape[1]} steps {err:.1e}")
    assert got.dtype == torch.float64 and got.shape[1] == 80 and err < 1e-10
    assert torch.equal(got.argmax(-1), seq[:, 12:])


def _bloom(heads=8, seed=0, hidden=None):
    torch.manual_seed(seed)
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=hidden or 8 * heads, n_layer=2, n_head=heads)
    return transformers.BloomForCausalLM(cfg).double().eval()


def test_the_cache_appends_in_place_and_the_kernel_reads_it_there(monkeypatch):
    """Below capacity every layer's buffer stays where it is; a step allocates nothing of a layer's keys (a
    DynamicCache's step does: the watch sees it); the keys the window op receives are views of the buffer; past
    capacity the buffer doubles once."""
    model = patch_alibi(_bloom(heads=4, hidden=64))
    x = torch.randint(0, 64, (2, 700), generator=torch.Generator().manual_seed(3))
    seen = []

    def spy(q, k, *args):
        seen.append(k.untyped_storage().data_ptr())
        return decode.forward(q, k, *args)

    monkeypatch.setitem(torch_ops.KERNELS, "window", torch_ops.KERNELS["window"]._replace(few=spy))
    for cache in (AppendCache(), transformers.DynamicCache()):
        with torch.no_grad():
            model(x[:, :300], cache=cache, use_cache=True)
            ptrs = [layer._k.data_ptr() for layer in cache.layers] if isinstance(cache, AppendCache) else None
            with NewStorage() as watch:
                model(x[:, 300:301], cache=cache, use_cache=True)
        layer_keys = cache.layers[0].keys.numel() * 8
        print(f"{type(cache).__name__}: largest new storage in a step {watch.largest} bytes, a layer's keys "
              f"{layer_keys}")
        if isinstance(cache, AppendCache):
            assert watch.largest < layer_keys / 4
            assert [layer._k.data_ptr() for layer in cache.layers] == ptrs == seen[-2:]
            cap = cache.layers[0].capacity
            with torch.no_grad():
                for t in range(301, cap):
                    model(x[:, t:t + 1], cache=cache, use_cache=True)
                assert [layer._k.data_ptr() for layer in cache.layers] == ptrs and cache.get_seq_length() == cap
                model(x[:, cap:cap + 1], cache=cache, use_cache=True)
            assert cache.layers[0].capacity == 2 * cap
        else:
            assert watch.largest >= layer_keys


def test_beams_reorder_and_crop_the_append_cache():
    """reorder_cache / batch_select_indices / batch_repeat_interleave / crop keep the buffers' capacity and hold
    what a DynamicCache holds."""
    k, v = torch.randn(3, 2, 5, 4, dtype=torch.float64), torch.randn(3, 2, 5, 4, dtype=torch.float64)
    a, d = AppendCache(), transformers.DynamicCache()
    for c in (a, d):
        c.update(k, v, 0)
        c.batch_repeat_interleave(2)
        c.reorder_cache(torch.tensor([5, 0, 0, 2, 1, 3]))
        c.batch_select_indices(torch.tensor([0, 2, 3, 5]))
        c.crop(-2)
        c.update(k[:, :, :1].repeat(2, 1, 1, 1)[:4], v[:, :, :1].repeat(2, 1, 1, 1)[:4], 0)
    assert torch.equal(a.layers[0].keys, d.layers[0].keys) and torch.equal(a.layers[0].values, d.layers[0].values)
    assert a.get_seq_length() == 4 and a.layers[0].capacity == 5 + 256


def _prompt(n=12, B=1, seed=1):
    return torch.randint(0, 64, (B, n), generator=torch.Generator().manual_seed(seed))


def test_certified_decoding_equals_exact_over_300_tokens_in_bounded_memory(made):
    """float64, 8 heads, tol 1e-3: windows chosen from the prompt, 300 greedy tokens equal exact ALiBi's; each KV
    head holds min(tokens, w_j + 1) rows, the bytes <= 1.15 sum_j (w_j + 1) (dk + dv) 8 per layer and sequence;
    the certificate checked every step (prefill and 299 decoding steps), none over tol."""
    model = patch_alibi(_bloom())
    x = _prompt()
    exact = model.generate(x, max_new_tokens=300, do_sample=False)
    patch_alibi(model, window="certified", tol=1e-3)
    out = model.generate(x, max_new_tokens=300, do_sample=False)
    cache = made[-1]
    assert isinstance(cache, PoslshCache) and torch.equal(out, exact)
    windows = [s["window"] for s in alibi_stats(model)]
    assert all(s["decoding"] for s in alibi_stats(model))
    tokens = x.shape[1] + 300 - 1
    assert cache.kept_keys().tolist() == [[min(tokens, w + 1) for w in ws] for ws in windows]
    assert min(windows[0]) + 1 < tokens                       # the steep heads evict
    d = 8
    for layer, ws in zip(cache.layers, windows):
        assert layer.nbytes() <= 1.15 * sum(w + 1 for w in ws) * (d + d) * 8
        cert = layer.stats()["certificate"]
        assert cert["steps"] == 300 and 0 < cert["worst"] <= 1e-3 and not any(cert["exceeded"])


@pytest.mark.parametrize("name", ["mpt", "falcon_mq", "falcon_gqa"])
def test_certified_decoding_of_mpt_and_falcon(name, made):
    """MPT past max_seq_len and Falcon (multi-query, grouped keys), left padding and beams: the tokens of exact
    ALiBi, each KV head holding its widest query head's window + 1 rows at most."""
    model = tiny_model(name, pad_token_id=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.25)                          # tiny_model's larger weights back to the init: smaller windows
    x, mask = left_padded_batch(12, (0, 4), seed=2, low=3)
    kw = dict(attention_mask=mask, max_new_tokens=70, pad_token_id=0, do_sample=False, use_cache=True)
    for extra in ({}, {"num_beams": 2}):
        exact = patch_alibi(model).generate(x, **kw, **extra)
        out = patch_alibi(model, window="certified", tol=1e-3).generate(x, **kw, **extra)
        cache = made[-1]
        assert isinstance(cache, PoslshCache) and torch.equal(out, exact), extra
        g = len(alibi_stats(model)[0]["window"]) // cache.num_kv_heads
        for kept, s in zip(cache.kept_keys().tolist(), alibi_stats(model)):
            assert kept == [min(x.shape[1] + 69, max(s["window"][j * g:(j + 1) * g]) + 1) for j in range(len(kept))]
        assert not any(cache.stats()[0]["certificate"]["exceeded"])


def test_the_certificates_policies_act_on_a_window_the_prompt_underestimates():
    """A one-token prompt shows no logit spread, so its windows are too small for what follows: "raise" stops
    generate() in one line, "warn" warns and counts every step over tol, "widen" grows the heads' windows and no
    step passes tol; sinks= and the policy reach generate() through alibi_cache(model, certificate=, sinks=)."""
    model = patch_alibi(_bloom(), window="certified", tol=1e-3)
    x = _prompt(n=1)

    def generate(policy, **kw):
        cache = alibi_cache(model, certificate=Certificate(1e-3, policy), **kw)
        return cache, model.generate(x, max_new_tokens=200, do_sample=False, cache=cache)

    with pytest.raises(ValueError, match=r"certificate: head \d+ dropped up to .* above tol=0.001") as e:
        generate("raise")
    assert "\n" not in str(e.value)
    with pytest.warns(CertificateWarning, match="above tol=0.001"):
        cache, warned = generate("warn")
    assert sum(sum(s["certificate"]["exceeded"]) for s in cache.stats()) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", CertificateWarning)
        cache, widened = generate("widen", sinks=2)
    stats = cache.stats()
    assert any(sum(s["certificate"]["widened"]) for s in stats)
    assert not any(sum(s["certificate"]["exceeded"]) for s in stats)
    chosen = alibi_stats(model)[0]["window"]
    assert any(w > c for w, c in zip(cache.layers[0].store.win, chosen)) and widened.shape == warned.shape
