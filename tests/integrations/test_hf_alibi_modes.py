"""patch_alibi's other modes against the float64 oracle with the same windows / partitions: fixed
windows, certified windows (and their guarantee), positional LSH; Falcon's bfloat16 bias; packed
documents; attention dropout; refusals; the save / load round trip."""
import pytest
import torch

pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh.integrations.hf import alibi_cache, alibi_stats, patch_alibi  # noqa: E402
from poslsh.reference import alibi_attention_reference  # noqa: E402
from poslsh.theory import logit_range, logit_range_bound, smallest_window  # noqa: E402
from poslsh.window import make_window  # noqa: E402

from alibi_reference import left_padded_batch, real_tokens, reference_model, tiny_model  # noqa: E402


def _batch(n=41, pads=(0, 6), seed=1):
    return left_padded_batch(n, pads, seed, low=1)


_real = real_tokens


def _windows_oracle(model):
    stats = alibi_stats(model)
    return lambda layer: make_window(torch.tensor(stats[layer]["slopes"], dtype=torch.float64),
                                     torch.tensor(stats[layer]["window"]))


@pytest.mark.parametrize("name", ["bloom6", "mpt", "falcon_mq"])
def test_fixed_windows_equal_the_oracle_with_the_same_windows(name):
    model = tiny_model(name)
    H = alibi_stats(patch_alibi(tiny_model(name)))[0]["heads"]
    x, mask = _batch()
    with torch.no_grad():
        exact = patch_alibi(tiny_model(name))(x, attention_mask=mask).logits
        for window in (4, list(range(1, 2 * H, 2)), torch.arange(H) * 3):
            got = patch_alibi(model, window=window)(x, attention_mask=mask).logits
            want = reference_model(tiny_model(name), positional=_windows_oracle(model))(x, attention_mask=mask).logits
            assert (_real(got, mask) - _real(want, mask)).abs().max() <= 1e-10
            assert (_real(got, mask) - _real(exact, mask)).abs().max() > 1e-6     # the windows cut something


def test_certified_windows_equal_the_oracle_and_keep_the_guarantee():
    model = patch_alibi(tiny_model("bloom4"), window="certified", tol=1e-3)
    x, mask = _batch()
    with torch.no_grad():
        got = model(x, attention_mask=mask).logits
    stats = alibi_stats(model)
    assert [s["mode"] for s in stats] == ["certified"] * 2 and stats[0]["tol"] == 1e-3
    for s in stats:     # the reported windows are the bound's at the reported range
        sigma = 1 / torch.tensor(s["slopes"], dtype=torch.float64)
        want = smallest_window(1e-3, sigma, torch.tensor(s["logit_range"]), n=s["keys"])
        assert s["window"] == want.tolist() and min(s["window"]) >= 1
    with torch.no_grad():
        want = reference_model(tiny_model("bloom4"), positional=_windows_oracle(model))(x, attention_mask=mask).logits
    assert (_real(got, mask) - _real(want, mask)).abs().max() <= 1e-10


def test_the_certified_logit_range_bounds_the_measured_one_and_the_dropped_mass():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 8, generator=g, dtype=torch.float64) * 0.5 for _ in range(3))
    R = logit_range_bound(q, k, 0.35)
    assert (R >= logit_range(q, k, scale=0.35)).all()
    slopes = poslsh.alibi_slopes(4)
    for tol in (1e-2, 1e-4):
        w = smallest_window(tol, 1 / slopes, R, n=300)
        assert (w < 299).any()
        cut = alibi_attention_reference(q, k, v, slopes, causal=True, scale=0.35, window=w)
        full = alibi_attention_reference(q, k, v, slopes, causal=True, scale=0.35)
        vrange = (v.amax(2) - v.amin(2)).amax()
        assert (cut - full).abs().max() <= tol * vrange      # |T* - T^w| <= delta (max v - min v)


@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon"])
def test_positional_lsh_equals_the_oracle_with_the_layers_partitions(name):
    model = patch_alibi(tiny_model(name), num_samples=6, seed=3)
    parts = [m._poslsh_alibi.positional for m in model.modules() if hasattr(m, "_poslsh_alibi")]
    stats = alibi_stats(model)
    assert isinstance(parts[0], poslsh.Partitions) and parts[0].num_samples == 6
    assert torch.allclose(parts[0].sigma, 1 / torch.tensor(stats[0]["slopes"], dtype=torch.float64))
    assert not torch.equal(parts[0].widths, parts[1].widths)              # one draw per layer
    x, mask = _batch()
    with torch.no_grad():
        got = model(x, attention_mask=mask).logits
        want = reference_model(tiny_model(name), positional=lambda layer: parts[layer])(x, attention_mask=mask).logits
        again = patch_alibi(tiny_model(name), num_samples=6, seed=3)(x, attention_mask=mask).logits
    assert (_real(got, mask) - _real(want, mask)).abs().max() <= 1e-10
    assert torch.equal(got, again)


@pytest.mark.parametrize("name", ["falcon", "falcon_mq", "falcon_gqa"])
def test_falcon_bfloat16_bias_reproduces_transformers_and_exact_does_not(name):
    x, mask = _batch(n=700, pads=(0, 40))
    with torch.no_grad():
        want_bf16 = reference_model(tiny_model(name), falcon_bias="bfloat16")(x, attention_mask=mask).logits
        want_exact = reference_model(tiny_model(name))(x, attention_mask=mask).logits
        bf16 = patch_alibi(tiny_model(name), falcon_bias="bfloat16")(x, attention_mask=mask).logits
        exact = patch_alibi(tiny_model(name))(x, attention_mask=mask).logits
    assert (_real(bf16, mask) - _real(want_bf16, mask)).abs().max() <= 1e-10
    assert (_real(exact, mask) - _real(want_exact, mask)).abs().max() <= 1e-10
    assert (_real(exact, mask) - _real(want_bf16, mask)).abs().max() > 1e-3     # the rounding shows at p > 256


@pytest.mark.parametrize("name", ["bloom4", "falcon"])
def test_packed_documents_equal_each_document_alone(name):
    model = patch_alibi(tiny_model(name))
    lengths = [5, 9, 4]
    x = torch.randint(1, 61, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(x, position_ids=pos).logits[0]
        alone, start = [], 0
        for n in lengths:
            alone.append(model(x[:, start:start + n]).logits[0])
            start += n
        unpacked = model(x).logits[0]
    assert (packed - torch.cat(alone)).abs().max() <= 1e-10
    assert (packed - unpacked).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["bloom4", "mpt"])
def test_attention_dropout_in_training_is_the_models_own(name):
    model = tiny_model(name, **({"attention_dropout": 0.3} if name.startswith("bloom") else {})).train()
    for m in model.modules():       # MptAttentionConfig types attn_pdrop as an int: set the module's rate
        if hasattr(m, "attn_dropout_p"):
            m.attn_dropout_p = 0.3
    ref = reference_model(model, dropout=True).train()
    patch_alibi(model)
    x, _ = _batch(n=30, pads=(0, 0))
    outs, grads = [], []
    for m in (ref, model):
        torch.manual_seed(7)
        out = m(x).logits
        m.zero_grad()
        out.sum().backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert (outs[0] - outs[1]).abs().max() <= 1e-10
    assert (grads[0] - grads[1]).abs().max() <= 1e-8 * grads[0].abs().max()
    with torch.no_grad():
        assert (model.eval()(x).logits - outs[1]).abs().max() > 1e-3          # the dropout did something


def _refused(match, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError), match=match):
        fn(*args, **kwargs)


def test_refusals_in_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    _refused("not an ALiBi model", patch_alibi, llama)
    _refused("alibi=False", patch_alibi, tiny_model("falcon", alibi=False))
    _refused("alibi_bias_max", patch_alibi, tiny_model("mpt", attn_config={"alibi_bias_max": 4}))
    _refused("output_attentions", patch_alibi, tiny_model("bloom4", output_attentions=True))
    bloom = tiny_model("bloom4")
    _refused("windows must be >= 0", patch_alibi, bloom, window=-1)
    _refused("is not a window", patch_alibi, bloom, window="wide")
    _refused("needs tol", patch_alibi, bloom, window="certified")
    _refused("tol must be", patch_alibi, bloom, window="certified", tol=0)
    _refused("pass window='certified'", patch_alibi, bloom, tol=1e-3)
    _refused("not both", patch_alibi, bloom, num_samples=4, window=8)
    _refused("num_samples must be", patch_alibi, bloom, num_samples=0)
    _refused("only Falcon", patch_alibi, bloom, falcon_bias="bfloat16")
    _refused("falcon_bias must be", patch_alibi, tiny_model("falcon"), falcon_bias="float16")
    _refused("3 windows for 4 heads", patch_alibi, bloom, window=[1, 2, 3])
    _refused("unknown backend 'fast'", patch_alibi, bloom, backend="fast")
    patch_alibi(bloom)
    x, _ = _batch(n=8, pads=(0,))
    _refused("output_attentions", bloom, x, output_attentions=True)
    _refused("head_mask", bloom, x, head_mask=torch.ones(2, 4))
    _refused("DynamicCache", bloom.generate, x, max_new_tokens=2, do_sample=False, cache_implementation="static")
    for name in ("bloom4", "mpt", "falcon"):
        model = patch_alibi(tiny_model(name))
        _refused("not a prepared 4-D one", model, x, attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool))
    _refused("whole numbers", patch_alibi, tiny_model("bloom4"), window=16.5)
    with pytest.raises(ValueError, match="a patched ALiBi model never forms"):
        bloom.config.output_attentions = True
    windowed = patch_alibi(tiny_model("bloom4"), window=4)
    other = patch_alibi(tiny_model("bloom4", seed=3), window=4)
    _refused("made for another model", windowed.generate, x, max_new_tokens=2, do_sample=False,
             cache=alibi_cache(other))
    _refused("eval mode", windowed.train(), x, cache=alibi_cache(windowed), use_cache=True)
    for line in ("not an ALiBi model", ):
        with pytest.raises(ValueError) as e:
            patch_alibi(llama)
        assert "\n" not in str(e.value) and line in str(e.value)


@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon"])
def test_save_load_round_trip_then_patch_again(name, tmp_path):
    import transformers
    model = patch_alibi(tiny_model(name), window=[2, 3, 5, 7])
    x, mask = _batch()
    with torch.no_grad():
        want = model(x, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    assert "poslsh" not in (tmp_path / "config.json").read_text()      # a plain checkpoint
    cls = getattr(transformers, type(model).__name__)
    loaded = cls.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert not hasattr(next(m for m in loaded.modules() if "Attention" in type(m).__name__), "_poslsh_alibi")
    with torch.no_grad():
        got = patch_alibi(loaded, window=[2, 3, 5, 7])(x, attention_mask=mask).logits
    assert (got - want).abs().max() <= 1e-12


def test_gradient_checkpointing_gives_the_same_gradients():
    x, mask = _batch()
    grads = []
    for checkpointed in (False, True):
        model = patch_alibi(tiny_model("bloom4"), window=[3, 5, 9, 40]).train()
        if checkpointed:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            assert model.transformer.h[0].gradient_checkpointing
        model(x, attention_mask=mask, labels=x).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max() <= 1e-12 * grads[0].abs().max()


@pytest.mark.parametrize("window", [None, "certified", 5])
def test_one_layer_equals_poslsh_alibi_attention_with_its_windows(window):
    model = patch_alibi(tiny_model("bloom6"), window=window, tol=1e-3 if window == "certified" else None)
    attn = model.transformer.h[1].self_attention
    h = torch.randn(2, 50, 24, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    with torch.no_grad():
        got = attn(h, torch.zeros_like(h), None, None)[0]
        q, k, v = attn._reshape(attn.query_key_value(h))
        stats = alibi_stats(model)[1]
        w = stats["window"] if window is not None else None
        slopes = torch.tensor(stats["slopes"], dtype=torch.float64)
        ctx = alibi_attention_reference(q, k, v, slopes, causal=True, scale=attn.inv_norm_factor,
                                     window=None if w is None else torch.tensor(w))
        want = attn.dense(ctx.transpose(1, 2).reshape(2, 50, 24))
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("window", [2.0, float("inf")])
def test_whole_float_and_infinite_windows_are_windows(window):
    x, mask = _batch()
    with torch.no_grad():
        got = patch_alibi(tiny_model("bloom4"), window=window)(x, attention_mask=mask).logits
        want = patch_alibi(tiny_model("bloom4"), window=None if window == float("inf") else int(window))(
            x, attention_mask=mask).logits
    assert torch.equal(got, want)


def test_the_reported_mode_is_asked_of_the_layers_positional_object():
    """alibi_stats()'s "mode" is derived from each layer's object: windows that cut no key are exact ALiBi
    (window=None and window=inf alike), windows that cut one head's keys are windows, partitions positional LSH,
    no fixed object (chosen per call) certified; fixed windows that cut keys and certified ones decode on the
    per-head cache."""
    inf = float("inf")
    for kw, mode in [(dict(), "exact"), (dict(window=inf), "exact"), (dict(window=[inf, inf, 3, inf]), "window"),
                     (dict(num_samples=2), "positional_lsh"), (dict(window="certified", tol=1e-3), "certified")]:
        model = patch_alibi(tiny_model("bloom4"), **kw)
        layers = [m._poslsh_alibi for m in model.modules() if hasattr(m, "_poslsh_alibi")]
        assert [s["mode"] for s in alibi_stats(model)] == [mode] * len(layers), kw
        assert all(st.fixed_windows == (mode == "window") for st in layers), kw
        assert (alibi_stats(model)[0].get("window") is None) == (mode != "window"), kw    # certified: after a call
        assert all(st.per_head_cache == (mode in ("window", "certified")) for st in layers), kw
        if mode in ("window", "certified"):
            alibi_cache(model)
        else:
            with pytest.raises(ValueError, match=f"attends with {mode}"):
                alibi_cache(model)


def test_the_unread_alibi_tensors_keep_their_shapes_in_no_memory():
    """The base model's own ALiBi tensor, which the patched layers never read, has the shape the model's code
    expects (whatever it does with it) and holds one element."""
    bloom, mpt = patch_alibi(tiny_model("bloom4")), patch_alibi(tiny_model("mpt"))
    mask = torch.ones(3, 50, dtype=torch.long)
    a = bloom.transformer.build_alibi_tensor(mask, 4, dtype=torch.float64)
    b = mpt.transformer.build_mpt_alibi_tensor(4, 64, device=torch.device("cpu"))
    assert a.shape == (12, 1, 50) and a.dtype == torch.float64 and b.shape == (4, 1, 64)
    assert a.stride() == (0, 0, 0) and b.stride() == (0, 0, 0) and not a.any() and not b.any()
