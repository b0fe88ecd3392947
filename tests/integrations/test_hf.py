"""The transformers integration: registered attention implementations inside tiny
Llama / Qwen3 / Mistral models, checked against the library's own ops in float64."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh.integrations import hf  # noqa: E402
from poslsh.reference import alibi_attention_reference  # noqa: E402
from poslsh.seeding import stable_seed  # noqa: E402

H, KV, D = 4, 2, 8   # GQA: 2 query heads per key/value head
PACKED_BACKEND = "auto"


def tiny_config(family="qwen3", **kw):
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=D, max_position_embeddings=512, attention_dropout=0.0)
    common.update(kw)
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig}[family]
    return cls(**common)


def tiny_model(scheme, family="qwen3", seed=0, **params):
    torch.manual_seed(seed)
    params.setdefault("num_samples", 3)
    params.setdefault("block_size", 5)
    return hf.model_from_config(tiny_config(family), scheme, **params).to(torch.float64).eval()


def ids(B=2, n=37, seed=1):
    return torch.randint(0, 61, (B, n), generator=torch.Generator().manual_seed(seed))


def _reference_impl(name, fn):
    """Register a test-only attention implementation that calls ``fn(module, q, k, v)``."""
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        assert attention_mask is None
        out = fn(module, query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    transformers.AttentionInterface.register(name, forward)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def _logits_with(model, impl, x):
    old = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            return model(x).logits
    finally:
        model.set_attn_implementation(old)


def independent_partitions(model, layer, num_heads, step=None):
    """Partitions rebuilt from the documented seeding rule, not from the module's cache."""
    pc = hf.positional_config(model.config)
    if model.training:
        seed = stable_seed("train", pc.seed, step, layer, num_heads, pc.num_samples)
    else:
        seed = stable_seed("eval", pc.eval_seed, layer, num_heads, pc.num_samples)
    return poslsh.sample_partitions(poslsh.alibi_sigmas(num_heads), pc.num_samples, seed=seed)


def test_each_scheme_attends_with_the_kind_its_rules_name():
    """One table says what a scheme is (hf.SCHEME_RULES): every registered implementation has an entry, its layers
    attend with an object of the entry's kind, exact ALiBi keeps every key (no window) and the others drop some;
    the cache serves the schemes that drop keys and keeps per-head stores for the window's kind."""
    from poslsh.integrations.hf.cache import CACHE_SCHEMES, WINDOW_SCHEMES

    assert set(hf.SCHEME_RULES) == set(hf.IMPLEMENTATIONS) and hf.SCHEMES == ("original", *hf.IMPLEMENTATIONS)
    for scheme, rules in hf.SCHEME_RULES.items():
        model = tiny_model(scheme, **({"window_sigmas": 2.0} if scheme == "alibi-window" else {}))
        positional = hf.layer_positional(model.model.layers[0].self_attn, scheme, H)
        assert isinstance(positional, rules.kind) and positional.op == rules.kind.op, scheme
        every_key = all(b >= poslsh.window.kind.NO_WINDOW for b in positional.cache_bound(per_head=True))
        assert every_key == (not rules.near_linear) == (scheme not in CACHE_SCHEMES), scheme
    assert CACHE_SCHEMES == ("poslsh", "fixed_blocks", "alibi-window") and WINDOW_SCHEMES == ("alibi-window",)


@pytest.mark.parametrize("family", ["qwen3", "llama", "mistral"])
def test_poslsh_matches_poslsh_attention_inside_model(family):
    model = tiny_model("poslsh", family, num_samples=4, seed=3)
    ref = _reference_impl("test_poslsh_ref", lambda m, q, k, v, sc: poslsh.poslsh_attention(
        q, k, v, independent_partitions(model, m.layer_idx, q.shape[1]), causal=True, scale=sc, backend="reference"))
    x = ids()
    got, want = _logits_with(model, "poslsh", x), _logits_with(model, ref, x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_fixed_blocks_matches_poslsh_attention_inside_model():
    model = tiny_model("fixed_blocks", block_size=7)
    ref = _reference_impl("test_fixed_ref", lambda m, q, k, v, sc: poslsh.poslsh_attention(
        q, k, v, poslsh.Partitions.fixed_blocks(q.shape[1], 7), causal=True, scale=sc, backend="reference"))
    x = ids()
    torch.testing.assert_close(_logits_with(model, "fixed_blocks", x), _logits_with(model, ref, x),
                               rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_alibi_matches_exact_alibi(family):
    model = tiny_model("alibi", family)
    ref = _reference_impl("test_alibi_ref", lambda m, q, k, v, sc: alibi_attention_reference(
        q, k, v, poslsh.alibi_slopes(q.shape[1]), causal=True, scale=sc))
    x = ids()
    torch.testing.assert_close(_logits_with(model, "alibi", x), _logits_with(model, ref, x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scheme", ["alibi", "poslsh", "fixed_blocks"])
def test_rope_removed(scheme):
    model = tiny_model(scheme)
    assert isinstance(model.model.rotary_emb, hf.NoRotaryEmbedding)
    assert model.config._attn_implementation == scheme
    assert hf.positional_config(model.config).rope_removed
    assert model.config.rope_parameters["rope_type"] == hf.NO_ROTATION
    x = ids(B=1, n=20)
    shifted = torch.arange(20)[None] + 11
    with torch.no_grad():   # positions no longer matter once RoPE is gone
        torch.testing.assert_close(model(x).logits, model(x, position_ids=shifted).logits, rtol=0, atol=0)
        cos, sin = model.model.rotary_emb(x.to(torch.float64), shifted)
    assert bool((cos == 1).all()) and bool((sin == 0).all())
    shuffled = torch.randperm(20, generator=torch.Generator().manual_seed(0))[None]
    with pytest.raises(ValueError, match="position_ids: packed documents"):   # restarts mean packed documents
        model(x, position_ids=shuffled)
    original = tiny_model("original")
    assert not isinstance(original.model.rotary_emb, hf.NoRotaryEmbedding)
    with torch.no_grad():
        assert not torch.allclose(original(x).logits, original(x, position_ids=shuffled).logits)


@pytest.mark.parametrize("scheme", ["original", "alibi", "poslsh", "fixed_blocks"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_behaves_like_stock_model(scheme, side):
    """Padded batch rows give the unpadded logits at their valid positions."""
    model = tiny_model(scheme)
    x = ids(B=3, n=30)
    mask = torch.ones_like(x)
    lengths = [30, 21, 9]
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, n:] = 0
        else:
            mask[b, : 30 - n] = 0
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits
        for b, n in enumerate(lengths):
            sl = slice(0, n) if side == "right" else slice(30 - n, 30)
            alone = model(x[b: b + 1, sl]).logits[0]
            # RoPE's cos/sin are float32 at shifted absolute positions: the stock model agrees to ~1e-7 only.
            tol = 1e-6 if scheme == "original" else 1e-9
            torch.testing.assert_close(padded[b, sl], alone, rtol=tol, atol=tol)


@pytest.mark.parametrize("scheme", ["alibi", "poslsh", "fixed_blocks"])
def test_kv_cache_decoding_matches_full_forward(scheme):
    model = tiny_model(scheme)
    x = ids(B=1, n=25)
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :20], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for i in range(20, 25):
            out = model(x[:, i: i + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-9, atol=1e-9)


def test_gradients_flow():
    for scheme in ("alibi", "poslsh", "fixed_blocks"):
        model = tiny_model(scheme).train()
        x = ids()
        model(x, labels=x, poslsh_step=0).loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), (scheme, name)
        attn = model.model.layers[0].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.weight.grad.abs().sum() > 0, scheme


def test_training_partitions_follow_seed_and_step():
    model = tiny_model("poslsh", seed=0, num_samples=2).train()
    x = ids()

    def logits(step):
        with torch.no_grad():
            return model(x, poslsh_step=step).logits   # the step travels with the inputs

    a, b, a2 = logits(5), logits(6), logits(5)
    torch.testing.assert_close(a, a2, rtol=0, atol=0)          # reproducible from (seed, step)
    assert not torch.allclose(a, b)                            # resampled every step
    attn = model.model.layers[1].self_attn
    got = hf.layer_partitions(attn, H, step=5)
    want = independent_partitions(model, 1, H, step=5)
    torch.testing.assert_close(got.widths, want.widths, rtol=0, atol=0)
    model.eval()
    with torch.no_grad():
        e1, e2 = model(x).logits, model(x).logits
    torch.testing.assert_close(e1, e2, rtol=0, atol=0)         # eval partitions are fixed
    other = tiny_model("poslsh", seed=0, num_samples=2, eval_seed=7)
    with torch.no_grad():
        assert not torch.allclose(other(x).logits, e1)


def test_layers_draw_different_partitions():
    model = tiny_model("poslsh", num_samples=2)
    p0 = hf.layer_partitions(model.model.layers[0].self_attn, H)
    p1 = hf.layer_partitions(model.model.layers[1].self_attn, H)
    assert not torch.equal(p0.widths, p1.widths)
    torch.testing.assert_close(p0.sigma, poslsh.alibi_sigmas(H))


def test_sigma_from_query_heads_with_gqa():
    model = tiny_model("poslsh")
    attn = model.model.layers[0].self_attn
    assert attn.num_key_value_groups == H // KV
    assert hf.layer_partitions(attn, H).num_heads == H


def test_config_conversion_roundtrip(tmp_path):
    cfg = hf.apply_positional_scheme(tiny_config(), "poslsh", num_samples=7, seed=3)
    assert cfg.poslsh["num_samples"] == 7 and cfg._attn_implementation == "poslsh"
    cfg.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.positional_config(loaded).num_samples == 7
    model = hf.model_from_config(loaded)
    assert isinstance(model.model.rotary_emb, hf.NoRotaryEmbedding)
    mistral = hf.apply_positional_scheme(tiny_config("mistral", sliding_window=16), "alibi")
    assert mistral.sliding_window is None   # the positional scheme replaces Mistral's window
    with pytest.raises(ValueError, match="unknown positional scheme"):
        hf.apply_positional_scheme(tiny_config(), "rope2")


def test_plain_attn_implementation_runs_without_conversion():
    """A stock model with attn_implementation="poslsh" (RoPE kept) runs on defaults."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="poslsh").eval()
    with torch.no_grad():
        assert torch.isfinite(model(ids()).logits).all()


def test_unsupported_options_raise():
    model = tiny_model("poslsh").train()
    model.model.layers[0].self_attn.attention_dropout = 0.1
    with pytest.raises(NotImplementedError, match="dropout"):
        model(ids())
    model = tiny_model("alibi")
    bias_mask = torch.zeros(2, 1, 37, 37, dtype=torch.float64)
    bias_mask[..., 0] = -1.0
    with pytest.raises(ValueError, match="non-zero biases"):
        model(ids(), attention_mask=bias_mask)


# ---------------------------------------------------------------- loading, refusing, warnings
@pytest.mark.parametrize("scheme", ["poslsh", "alibi", "fixed_blocks"])
def test_from_pretrained_reapplies_the_saved_scheme(scheme, tmp_path):
    model = tiny_model(scheme, num_samples=4)
    model.save_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        got = hf.from_pretrained(tmp_path, dtype=torch.float64).eval()(x).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()(x).logits
    err, plain_err = float((got - want).abs().max()), float((plain - want).abs().max())
    print(f"{scheme}: reloaded with hf.from_pretrained {err:.1e}; plain from_pretrained (poslsh imported) {plain_err:.1e}")
    assert err < 1e-12 and plain_err < 1e-12   # test_hf_saving.py: what plain loading does, with and without poslsh


def test_models_without_rope_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match="absolute position embeddings"):
        hf.apply_positional_scheme(gpt2, "poslsh")


def test_dense_fallback_warns_once_per_model_with_the_cause(caplog):
    model = tiny_model("poslsh", backend=PACKED_BACKEND)
    x = ids(B=1, n=12)
    strided = torch.ones(12, 12, dtype=torch.bool).tril()   # causal, every other key of the past hidden: no op for it
    strided[:, 1::2] = False
    strided |= torch.eye(12, dtype=torch.bool)
    packed = torch.zeros(12, 12, dtype=torch.bool)          # two packed documents: block-diagonal causal
    packed[:5, :5] = packed[5:, 5:] = True
    packed = packed.tril()[None, None]
    with caplog.at_level("WARNING", logger="poslsh.integrations.hf"), torch.no_grad():
        for _ in range(3):
            model(x, attention_mask=strided[None, None])
        model(x, attention_mask=packed)                       # documents: the near-linear op, no warning
    warnings = [r.getMessage() for r in caplog.records if "dense" in r.getMessage()]
    print(warnings)
    assert len(warnings) == 1 and "neither causal padding nor packed causal documents" in warnings[0]


# ---------------------------------------------------------------- samplers
def test_grouped_sampler_through_config_model_and_reload(tmp_path):
    model = tiny_model("poslsh", num_samples=6, sampler="grouped", group_size=3)
    pc = hf.positional_config(model.config)
    assert (pc.sampler, pc.group_size) == ("grouped", 3)
    attn = model.model.layers[1].self_attn
    got = hf.layer_partitions(attn, H)
    assert got.groups is not None and got.num_groups == 2
    # the documented seeding rule: the i.i.d. key, plus (sampler, group_size) for other samplers
    want = poslsh.sample_partitions(poslsh.alibi_sigmas(H), 6, sampler="grouped", group_size=3,
                                    seed=stable_seed("eval", pc.eval_seed, 1, H, 6, "grouped", 3))
    assert got == want
    x = ids()
    with torch.no_grad():
        out = model(x).logits
        iid = tiny_model("poslsh", num_samples=6)(x).logits
    assert not torch.allclose(out, iid)
    model.save_pretrained(tmp_path)
    again = hf.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert hf.positional_config(again.config).sampler == "grouped"
    with torch.no_grad():
        assert float((again(x).logits - out).abs().max()) < 1e-12
    # i.i.d. stays the default and keeps the seeds it always had
    assert hf.positional_config(tiny_model("poslsh").config).sampler == "iid"
    iid_model = tiny_model("poslsh", num_samples=2)
    assert hf.layer_partitions(iid_model.model.layers[0].self_attn, H) == independent_partitions(iid_model, 0, H)


def test_bad_sampler_is_a_one_line_error():
    with pytest.raises(ValueError, match="sampler must be one of iid, stratified, grouped"):
        hf.PositionalConfig(sampler="sobol")
    with pytest.raises(ValueError, match="group_size"):
        hf.PositionalConfig(sampler="iid", group_size=4)


def test_alibi_scheme_decodes_on_an_append_cache_through_the_window_op(monkeypatch):
    """generate() of an "alibi" model appends in place (AppendCache) and its decoding steps run the window op
    (no window) instead of the dense nq x nk path: the tokens of generation without a cache, left padding too."""
    from poslsh.ops.torch import decode, ops as torch_ops
    calls = []

    def spy(*args):
        calls.append(args[0].shape[2])
        return decode.forward(*args)

    monkeypatch.setitem(torch_ops.KERNELS, "window", torch_ops.KERNELS["window"]._replace(few=spy))
    model = tiny_model("alibi")
    x = ids(B=2, n=12)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = model.generate(x, return_dict_in_generate=True, **kw)
    assert isinstance(out.past_key_values, hf.AppendCache) and len(calls) >= 9 * 2
    assert torch.equal(out.sequences, model.generate(x, use_cache=False, **kw))
