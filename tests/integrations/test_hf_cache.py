"""The bounded KV cache inside transformers: generate() with it equals recomputation without
it, left-padded rows equal their prompt alone, chunked prefill equals one shot, eviction
equals the dense float64 oracle, and bad use fails with one line."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh import partitions as partitions_mod  # noqa: E402
from poslsh import reference  # noqa: E402
from poslsh.window import make_window  # noqa: E402
from poslsh.decoding import attend  # noqa: E402
from poslsh.integrations import hf  # noqa: E402
from poslsh.integrations.hf import cache as hf_cache, masks as hf_masks  # noqa: E402
from poslsh.integrations.hf.schemes import attention as hf_attention  # noqa: E402
from poslsh.integrations.hf.schemes.convert import attention_modules  # noqa: E402

SCHEMES = ["poslsh", "fixed_blocks"]
WINDOW_AND_DOCUMENTS_BACKEND = "torch"


def tiny(scheme, H=4, KV=2, layers=2, dtype=torch.float32, seed=0, **params):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=8,
                                   max_position_embeddings=4096, attention_dropout=0.0, pad_token_id=0)
    params.setdefault("num_samples", 3)
    params.setdefault("block_size", 5)
    return hf.model_from_config(cfg, scheme, **params).to(dtype).eval()


def tokens(n, seed=1, B=1):
    return torch.randint(1, 61, (B, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, x, mask=None, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out, torch.stack(out.logits, 1)        # [B, steps, vocab]


def left_pad(prompts):
    N = max(len(p) for p in prompts)
    x = torch.zeros(len(prompts), N, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, p in enumerate(prompts):
        x[b, N - len(p):], mask[b, N - len(p):] = p, 1
    return x, mask


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------- generate
@pytest.mark.parametrize("scheme", SCHEMES)
def test_generate_with_the_cache_equals_recomputation(scheme):
    model = tiny(scheme)
    x = tokens(30)
    cached, lc = greedy(model, x)
    assert isinstance(cached.cache, hf.PoslshCache)            # generate() picked it by itself
    plain, lp = greedy(model, x, use_cache=False)
    err = float((lc - lp).abs().max())
    print(f"{scheme}: tokens equal {torch.equal(cached.sequences, plain.sequences)}, max logit diff {err:.1e}, "
          f"cache {cached.cache.stats()}")
    assert torch.equal(cached.sequences, plain.sequences) and err < 1e-5


@pytest.mark.parametrize("scheme", SCHEMES)
def test_left_padded_batch_rows_equal_each_prompt_alone(scheme):
    model = tiny(scheme)
    prompts = [tokens(n, seed=n)[0] for n in (30, 17, 6)]
    x, mask = left_pad(prompts)
    out, logits = greedy(model, x, mask)
    N = x.shape[1]
    for b, p in enumerate(prompts):
        alone, la = greedy(model, p[None], use_cache=False)
        err = float((logits[b] - la[0]).abs().max())
        print(f"{scheme} row {b} ({len(p)} tokens): max logit diff to the prompt alone {err:.1e}")
        assert torch.equal(out.sequences[b, N:], alone.sequences[0, len(p):]) and err < 1e-5


def test_full_cache_decoding_has_no_dense_path(monkeypatch):
    """A DynamicCache (no eviction) decodes with spans too: no n x n count or dense attention."""
    model = tiny("poslsh")
    prompts = [tokens(n, seed=n)[0] for n in (25, 9)]
    x, mask = left_pad(prompts)
    want, lw = greedy(model, x, mask, use_cache=False)

    def banned(*a, **k):
        raise AssertionError("dense O(nq * nk) path used while decoding")
    monkeypatch.setattr(partitions_mod.Partitions, "dense_count", banned)
    monkeypatch.setattr(hf_attention, "dense_attention", banned)
    monkeypatch.setattr(reference, "dense_attention", banned)
    got, lg = greedy(model, x, mask, cache=transformers.DynamicCache(config=model.config))
    assert torch.equal(got.sequences, want.sequences) and float((lg - lw).abs().max()) < 1e-5


# -------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("scheme", SCHEMES)
def test_chunked_prefill_equals_one_shot(scheme):
    model = tiny(scheme, dtype=torch.float64)
    prompts = [tokens(n, seed=n)[0] for n in (40, 23)]
    x, mask = left_pad(prompts)
    with torch.no_grad():
        want = model(x, attention_mask=mask).logits
        cache, got, pos = hf.generation_cache(model), [], 0
        for c in (7, 1, 13, 1, 1, 17):
            got.append(model(x[:, pos:pos + c], attention_mask=mask[:, :pos + c], cache=cache, use_cache=True).logits)
            pos += c
    got = torch.cat(got, 1)
    real = mask.bool()
    err = float((got - want)[real].abs().max())
    print(f"{scheme}: chunked vs one-shot prefill, max logit diff at real tokens {err:.1e}")
    assert err < 1e-10
    a, _ = greedy(model, x, mask, prefill_chunk_size=8)
    b, _ = greedy(model, x, mask)
    assert torch.equal(a.sequences, b.sequences)


# --------------------------------------------------------------- eviction
def _reference_logits(model, x):
    """Full forward with the dense float64 oracle in every layer (the module's own partitions)."""
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        parts = hf.layer_partitions(module, query.shape[1], "poslsh", device=query.device)
        out = poslsh.poslsh_attention(query, key, value, parts, causal=True, scale=scaling, backend="reference")
        return out.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register("test_cache_oracle", forward)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    ALL_MASK_ATTENTION_FUNCTIONS.register("test_cache_oracle", sdpa_mask)
    model.set_attn_implementation("test_cache_oracle")
    try:
        with torch.no_grad():
            return model(x).logits
    finally:
        model.set_attn_implementation("poslsh")


def test_long_sequence_eviction_equals_dense_oracle_within_the_bound():
    """Two heads (sigma 16 and 256), 1200 tokens fed in chunks of 1..40: the logits at every
    position equal the dense float64 oracle, and no layer ever keeps more than its bound."""
    model = tiny("poslsh", H=2, KV=1, dtype=torch.float64, num_samples=4)
    x = tokens(1200)
    want = _reference_logits(model, x)
    cache, got, pos, i, chunks = hf.generation_cache(model), [], 0, 0, [1, 1, 40, 3, 1, 25]
    worst = 0.0
    with torch.no_grad():
        while pos < x.shape[1]:
            c = min(chunks[i % len(chunks)], x.shape[1] - pos)
            got.append(model(x[:, pos:pos + c], cache=cache, use_cache=True).logits)
            for st in cache.stats():
                assert st["kept"] <= st["bound"] and st["peak"] <= st["bound"] + max(chunks)
                worst = max(worst, st["kept"] / st["bound"])
            pos, i = pos + c, i + 1
    err = float((torch.cat(got, 1) - want).abs().max())
    print(f"max |cached - dense oracle| = {err:.2e}; stats {cache.stats()}; most kept / bound = {worst:.2f}")
    assert err < 1e-9
    assert all(st["kept"] < 1200 // 2 for st in cache.stats())      # keys were really dropped


def test_beam_search_reorders_the_cache():
    model = tiny("fixed_blocks", block_size=6)
    x, mask = left_pad([tokens(n, seed=n)[0] for n in (14, 9)])
    a = model.generate(x, attention_mask=mask, num_beams=3, max_new_tokens=8, do_sample=False, pad_token_id=0)
    b = model.generate(x, attention_mask=mask, num_beams=3, max_new_tokens=8, do_sample=False, pad_token_id=0,
                       cache=transformers.DynamicCache(config=model.config))
    assert torch.equal(a, b)


# ----------------------------------------------------------------- errors
def test_cache_for_another_model_scheme_or_seed_is_refused():
    model, x = tiny("poslsh"), tokens(10)
    with torch.no_grad():
        with pytest.raises(ValueError, match="another model instance") as e:
            tiny("poslsh")(x, cache=hf.generation_cache(model), use_cache=True)
        print(one_line(e))
        for scheme, change, word in (("poslsh", dict(eval_seed=5), "eval_seed=0.* eval_seed=5"),
                                     ("poslsh", dict(num_samples=7), "num_samples=3.* num_samples=7"),
                                     ("fixed_blocks", {}, "built for poslsh .* runs fixed_blocks")):
            cache = hf.generation_cache(model)
            hf.apply_positional_scheme(model, scheme, **change)          # in place: same config object
            with pytest.raises(ValueError, match=word) as e:
                model(x, cache=cache, use_cache=True)
            print(one_line(e))
            hf.apply_positional_scheme(model, "poslsh", num_samples=3, eval_seed=0)
    with pytest.raises(ValueError, match="serves attn_implementation") as e:
        hf.generation_cache(tiny("alibi"))
    print(one_line(e))


def test_bad_positions_padding_batch_and_mode_are_refused():
    model, x = tiny("poslsh"), tokens(12, B=2)
    with torch.no_grad():
        cache = hf.generation_cache(model)
        model(x[:, :8], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="position_ids: row 0 token 0 has position 0 .* expects 8") as e:
            model(x[:, 8:9], cache=cache, use_cache=True, position_ids=torch.tensor([[0], [0]]))
        one_line(e)
        with pytest.raises(ValueError, match="pending|never attended"):
            model(x[:, 8:9], cache=cache, use_cache=True)       # the failed step left the cache unusable
        cache = hf.generation_cache(model)
        right = torch.ones(2, 8, dtype=torch.long)
        right[1, 5:] = 0
        with pytest.raises(ValueError, match="left padding only") as e:
            model(x[:, :8], attention_mask=right, cache=cache, use_cache=True)
        one_line(e)
        cache = hf.generation_cache(model)
        model(x[:, :8], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="one cache per batch") as e:
            model(x[:1, 8:9], cache=cache, use_cache=True)
        one_line(e)
        with pytest.raises(NotImplementedError, match="cannot be cropped"):
            cache.crop(-1)
        model.train()
        with pytest.raises(ValueError, match="model.eval()") as e:
            model(x[:, :4], cache=hf.generation_cache(model), use_cache=True)
        one_line(e)


def test_cache_api_bits():
    model = tiny("fixed_blocks", block_size=4)
    cache = hf.generation_cache(model)
    assert isinstance(cache, transformers.Cache) and len(cache.layers) == 2
    assert cache.stats()[0]["bound"] is None and cache.nbytes() == 0
    with torch.no_grad():
        model(tokens(10), cache=cache, use_cache=True)
    st = cache.stats()
    assert st[0] == {"layer": 0, "tokens": 10, "kept": 2, "peak": 10, "bound": 3, "bound_per_head": [3] * 4}
    assert cache.get_seq_length() == 10 and cache.get_mask_sizes(1, 0) == (3, 8)
    assert cache.nbytes() == 2 * 2 * (1 * 2 * 2 * 8 * 4)       # layers x (k, v) x [1, 2, 2, 8] fp32
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats()[0]["kept"] == 0
    assert isinstance(hf_cache.CacheSpec.of(model.config), hf_cache.CacheSpec)


# ------------------------------------------- the window scheme and packed prefills
# What poslsh.integrations.hf will register for the "alibi-window" scheme, in miniature: the
# layer's positional object goes to hf_cache.attend with a cache layer, to the op without one
# (one sequence, or one packed row with ``test_cu_seqlens``).
WINDOWS = [2, 5, 9, 13]            # per query head of the 4-head model: a layer keeps 13 keys
TEST_IMPL = "test_positional_scheme"


def layer_positional(module, H):
    if module.config.test_scheme == "alibi-window":
        return make_window(poslsh.alibi_slopes(H), torch.tensor(WINDOWS[:H]))
    return hf.layer_partitions(module, H, "poslsh")


def _test_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scheme, H = module.config.test_scheme, query.shape[1]
    layer, cu = kwargs.pop(hf_cache.CACHE_KWARG, None), kwargs.get("test_cu_seqlens")
    steps = WINDOW_AND_DOCUMENTS_BACKEND if scheme == "alibi-window" else "torch"
    if layer is not None:
        out = hf_cache.attend(layer, module, scheme, query, key, value, hf_masks.allowed_mask(attention_mask),
                              layer_positional(module, H), scaling, steps, kwargs.get("position_ids"))
    else:
        assert query.shape[0] == 1 and query.shape[2] == key.shape[2], "one unpadded sequence or packed row"
        out = attend(query, key, value, layer_positional(module, H), causal=True, scale=scaling, cu_seqlens=cu,
                     backend=WINDOW_AND_DOCUMENTS_BACKEND if cu is not None else steps)
    return out.transpose(1, 2).contiguous(), None


def scheme_model(scheme, dtype=torch.float64):
    """A tiny model whose attention is ``_test_attention`` for ``scheme`` ("poslsh": the eval
    partitions hf.py uses; "alibi-window": ALiBi slopes cut at WINDOWS)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    transformers.AttentionInterface.register(TEST_IMPL, _test_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(TEST_IMPL, sdpa_mask)
    model = tiny("poslsh", dtype=dtype)
    model.config.test_scheme = scheme
    model.set_attn_implementation(TEST_IMPL)
    return model


def run(model, x, steps, cache=None):
    """Greedy decoding by hand: logits of the prompt's last token and of ``steps`` more, the tokens."""
    with torch.no_grad():
        logits = [model(x, cache=cache, use_cache=cache is not None).logits[:, -1]]
        toks = [logits[-1].argmax(-1, keepdim=True)]
        for _ in range(steps):
            seq = toks[-1] if cache is not None else torch.cat([x] + toks, 1)
            logits.append(model(seq, cache=cache, use_cache=cache is not None).logits[:, -1])
            toks.append(logits[-1].argmax(-1, keepdim=True))
    return torch.stack(logits, 1), torch.cat(toks, 1)


def test_window_scheme_generate_with_the_cache_equals_recomputation_holding_exactly_w_keys():
    model = scheme_model("alibi-window", dtype=torch.float32)
    x = tokens(30)
    cache = hf_cache.PoslshCache(model, scheme="alibi-window")
    cached, lc = greedy(model, x, cache=cache)
    plain, lp = greedy(model, x, use_cache=False)
    err = float((lc - lp).abs().max())
    print(f"alibi-window: tokens equal {torch.equal(cached.sequences, plain.sequences)}, max logit diff {err:.1e}, "
          f"cache {cache.stats()}")
    assert torch.equal(cached.sequences, plain.sequences) and err < 1e-5
    for st in cache.stats():     # per KV head: the widest window of its query heads + 1 (query heads 2, 5 | 9, 13)
        assert st["kept"] == st["bound"] == 14 and st["bound_per_head"] == WINDOWS and st["tokens"] == 30 + 11
        assert st["kept_per_head"] == [6, 14]
    assert cache.kept_keys().tolist() == [[6, 14], [6, 14]]
    assert cache.nbytes() == 2 * 2 * (6 + 14) * 8 * 4          # layers x (k, v) x rows x d x fp32


def test_window_scheme_chunked_decoding_equals_recomputation_at_every_position():
    """200 tokens in chunks of 1..25 through the window cache: the logits at every position
    equal one full forward, and every layer holds exactly min(tokens, 13) keys after each step."""
    model, x = scheme_model("alibi-window"), tokens(200)
    with torch.no_grad():
        want = model(x).logits
        cache, got, pos, i, chunks = hf_cache.PoslshCache(model, scheme="alibi-window"), [], 0, 0, [1, 1, 25, 3, 1]
        while pos < x.shape[1]:
            c = min(chunks[i % len(chunks)], x.shape[1] - pos)
            got.append(model(x[:, pos:pos + c], cache=cache, use_cache=True).logits)
            pos, i = pos + c, i + 1
            assert all(st["kept_per_head"] == [min(pos, 6), min(pos, 14)] for st in cache.stats())
    err = float((torch.cat(got, 1) - want).abs().max())
    print(f"alibi-window: max |cached - full forward| over 200 positions = {err:.1e}")
    assert err < 1e-10


@pytest.mark.parametrize("scheme", ["poslsh", "alibi-window"])
def test_packed_prefill_cache_continues_every_document_as_if_alone(scheme):
    """Four documents (23, 1, 40 and 9 tokens) prefilled as one packed row, turned into a cache
    of four rows, then 6 greedy steps for all of them at once: every row's logits and tokens
    equal its document run alone, with its own cache and without any (recomputation). The
    poslsh scheme decodes with hf.py's own "poslsh" attention."""
    model = scheme_model(scheme)
    docs = [tokens(n, seed=n)[0] for n in (23, 1, 40, 9)]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0)
    with torch.no_grad():
        prefill = transformers.DynamicCache(config=model.config)
        packed = model(torch.cat(docs)[None], cache=prefill, use_cache=True, test_cu_seqlens=cu).logits[0]
    positionals = [layer_positional(m, 4) for m in attention_modules(model)]
    cache = hf_cache.packed_prefill_cache(model, prefill, positionals, cu_seqlens=cu, scheme=scheme)
    if scheme == "poslsh":
        model.set_attn_implementation("poslsh")
    first = packed[cu[1:] - 1]                                           # [D, vocab]: each document's last token
    steps, toks = [first], [first.argmax(-1, keepdim=True)]
    with torch.no_grad():
        for _ in range(6):
            steps.append(model(toks[-1], cache=cache, use_cache=True).logits[:, -1])
            toks.append(steps[-1].argmax(-1, keepdim=True))
    got, got_toks = torch.stack(steps, 1), torch.cat(toks, 1)
    for d, doc in enumerate(docs):
        alone = run(model, doc[None], 6, hf_cache.PoslshCache(model, scheme=scheme))
        recomputed = run(model, doc[None], 6)
        errs = [float((got[d] - want[0]).abs().max()) for want, _ in (alone, recomputed)]
        print(f"{scheme} document {d} ({len(doc)} tokens): max logit diff to the document alone {errs[0]:.1e}, to "
              f"recomputation {errs[1]:.1e}; tokens {got_toks[d].tolist()}")
        assert torch.equal(got_toks[d], alone[1][0]) and torch.equal(got_toks[d], recomputed[1][0])
        assert max(errs) < 1e-10
    for st in cache.stats():
        assert st["kept"] <= st["bound"] and (scheme == "poslsh" or st["kept_per_head"] == [6, 14])


def test_packed_prefill_cache_refuses_mismatched_positionals():
    model = scheme_model("alibi-window")
    docs = [tokens(n, seed=n)[0] for n in (20, 5)]
    cu = torch.tensor([0, 20, 25])
    with torch.no_grad():
        prefill = transformers.DynamicCache(config=model.config)
        model(torch.cat(docs)[None], cache=prefill, use_cache=True, test_cu_seqlens=cu)
    narrow = [make_window(poslsh.alibi_slopes(4), 1)] * 2
    cache = hf_cache.packed_prefill_cache(model, prefill, narrow, cu_seqlens=cu, scheme="alibi-window")
    with pytest.raises(ValueError, match="evicted its keys for other partitions / another window") as e:
        with torch.no_grad():
            model(torch.ones(2, 1, dtype=torch.long), cache=cache, use_cache=True)
    print(one_line(e))
    with pytest.raises(ValueError, match="2 layers of keys and 1 positional objects") as e:
        hf_cache.packed_prefill_cache(model, prefill, narrow[:1], cu_seqlens=cu, scheme="alibi-window")
    with pytest.raises(ValueError, match="serves attn_implementation") as e:
        hf_cache.PoslshCache(model)                      # the test implementation is no cache scheme
    print(one_line(e))
