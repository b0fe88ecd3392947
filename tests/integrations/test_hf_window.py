"""The alibi-window scheme (exact ALiBi cut at a per-head window, positional LSH's honest rival)
in a tiny float64 Llama, against the same model under the dense "alibi" implementation given the
window as a 4-D mask: logits and gradients, padding, decoding against a DynamicCache, and the
windows of both rules (window_sigmas, the cost-matched window)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh.cost import cost_matched_window  # noqa: E402
from poslsh.integrations import hf  # noqa: E402
from poslsh.integrations.hf.schemes import attention as hf_attention  # noqa: E402

BACKEND = "auto"        # the window op on the fastest backend that serves it (torch on CPU)
H, KV, D, VOCAB = 4, 2, 8, 61
RULES = {"sigmas": dict(window_sigmas=0.75), "cost": dict(window_cost_samples=2)}


def tiny_llama(seed=0, **params):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=D, attention_dropout=0.0,
                                   max_position_embeddings=256)
    torch.manual_seed(seed)
    return hf.model_from_config(cfg, "alibi-window", backend=BACKEND, **params).to(torch.float64).eval()


def ids(B=2, n=61, seed=1):
    return torch.randint(0, VOCAB, (B, n), generator=torch.Generator().manual_seed(seed))


def window_mask(window, nq, nk, pad=None):
    """The dense oracle's mask ``[B|1, H, nq, nk]``: causal, ``|i - j| <= w_h``, and a 2-D padding mask."""
    q = torch.arange(nk - nq, nk)[:, None]
    k = torch.arange(nk)[None]
    m = ((q - k).abs()[None] <= window[:, None, None]) & (k <= q)[None]
    m = m[None]
    return m if pad is None else m & pad.bool()[:, None, None, :]


def with_dense_oracle(model, fn):
    """``fn()`` with the model's attention switched to the dense "alibi" implementation."""
    model.set_attn_implementation("alibi")
    try:
        return fn()
    finally:
        model.set_attn_implementation("alibi-window")


def banned(*args, **kwargs):
    raise AssertionError("the dense O(nq * nk) path ran")


def test_windows_follow_the_rule():
    sigma = poslsh.alibi_sigmas(H)
    w = hf.PositionalConfig(scheme="alibi-window", window_sigmas=0.75).alibi_window(H)
    assert w.window.tolist() == [3, 12, 48, 192] and torch.equal(w.slopes, poslsh.alibi_slopes(H))
    assert hf.PositionalConfig(scheme="alibi-window", window_sigmas=2).alibi_window(H).window.tolist() == \
        (2 * sigma).to(torch.int64).tolist()
    cost = hf.PositionalConfig(scheme="alibi-window", window_cost_samples=5).alibi_window(H).window
    assert torch.equal(cost, cost_matched_window(sigma, 5))
    model = tiny_llama(**RULES["cost"])
    assert torch.equal(hf.layer_window(model.model.layers[1].self_attn, H).window, cost_matched_window(sigma, 2))


@pytest.mark.parametrize("rule", list(RULES))
def test_logits_and_gradients_equal_the_dense_windowed_alibi_model(rule, monkeypatch):
    model = tiny_llama(**RULES[rule])
    window = hf.layer_window(model.model.layers[0].self_attn, H).window
    x = ids()
    weights = torch.randn(*x.shape, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def run(**kw):
        model.zero_grad()
        logits = model(x, **kw).logits
        (logits * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, g_want = with_dense_oracle(model, lambda: run(attention_mask=window_mask(window, 61, 61)))
    with torch.no_grad():
        full = with_dense_oracle(model, lambda: model(x).logits)    # exact ALiBi, no window
    monkeypatch.setattr(hf_attention, "dense_attention", banned)        # the window op, near-linear: no dense path
    got, g_got = run()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-9, atol=1e-10, msg=name)
    assert float((full - got).abs().max()) > 1e-4


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_behaves_like_stock_model(side, monkeypatch):
    model = tiny_llama(**RULES["sigmas"])
    x = ids(B=3, n=30)
    mask = torch.ones_like(x)
    lengths = [30, 21, 9]
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, n:] = 0
        else:
            mask[b, : 30 - n] = 0
    monkeypatch.setattr(hf_attention, "dense_attention", banned)
    with torch.no_grad():
        padded = model(x, attention_mask=mask).logits
        for b, n in enumerate(lengths):
            sl = slice(0, n) if side == "right" else slice(30 - n, 30)
            torch.testing.assert_close(padded[b, sl], model(x[b: b + 1, sl]).logits[0], rtol=1e-10, atol=1e-10)


def test_decoding_against_a_dynamic_cache_with_left_padding(monkeypatch):
    """Prefill, then chunks of 1 and 3 tokens: every real position equals the full forward."""
    model = tiny_llama(**RULES["sigmas"])
    x = ids(B=2, n=40)
    mask = torch.ones_like(x)
    mask[1, :9] = 0
    with torch.no_grad():
        full = model(x, attention_mask=mask).logits
        monkeypatch.setattr(hf_attention, "dense_attention", banned)    # spans per group of rows, no dense path
        out = model(x[:, :30], attention_mask=mask[:, :30], use_cache=True)
        cache, steps, pos = out.past_key_values, [out.logits], 30
        assert isinstance(cache, transformers.DynamicCache)
        for c in (1, 3, 1, 5):
            out = model(x[:, pos:pos + c], attention_mask=mask[:, :pos + c], cache=cache, use_cache=True)
            steps.append(out.logits)
            pos += c
    got = torch.cat(steps, 1)
    real = mask.bool()
    torch.testing.assert_close(got[real], full[real], rtol=1e-10, atol=1e-10)


def test_generate_uses_the_bounded_cache_holding_exactly_the_widest_window():
    model = tiny_llama(**RULES["cost"])
    cache = hf.generation_cache(model)
    x = ids(B=1, n=40)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))
    cached = model.generate(x, cache=cache, **kw)
    plain = model.generate(x, use_cache=False, **kw)
    assert torch.equal(cached, plain)
    widest = int(hf.positional_config(model.config).alibi_window(H).window.max())
    print(cache.stats())
    assert all(row["kept"] == min(45, widest) for row in cache.stats())


def test_configuration_errors_are_one_line():
    with pytest.raises(ValueError, match="exactly one of window_sigmas"):
        hf.PositionalConfig(scheme="alibi-window")
    with pytest.raises(ValueError, match="exactly one of window_sigmas"):
        hf.PositionalConfig(scheme="alibi-window", window_sigmas=2.0, window_cost_samples=5)
    with pytest.raises(ValueError, match="window_sigmas must be a finite number > 0"):
        hf.PositionalConfig(scheme="alibi-window", window_sigmas=0)
    with pytest.raises(ValueError, match="window_cost_samples must be an int >= 1"):
        hf.PositionalConfig(scheme="alibi-window", window_cost_samples=2.5)
    with pytest.raises(ValueError, match="are for the alibi-window scheme"):
        hf.PositionalConfig(scheme="poslsh", window_sigmas=2.0)
    model = tiny_llama(**RULES["sigmas"])
    # switching scheme or rule drops the other window field instead of carrying it over
    hf.apply_positional_scheme(model, "alibi-window", window_cost_samples=3)
    pc = hf.positional_config(model.config)
    assert (pc.window_sigmas, pc.window_cost_samples) == (None, 3)
    hf.apply_positional_scheme(model, "poslsh")
    assert hf.positional_config(model.config).window_cost_samples is None
    stock = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=H, num_key_value_heads=KV, head_dim=D)
    with pytest.raises(ValueError, match="needs its window"):
        transformers.AutoModelForCausalLM.from_config(stock, attn_implementation="alibi-window")(ids(B=1, n=4))


def test_context_parallel_shard_of_one_rank_equals_the_model(tmp_path):
    """The one attention function hands the layer's window to context-parallel attention as it hands
    partitions: on a world of one rank (the whole sequence is the shard) the logits and gradients are
    the model's own. (Shards over several ranks: tests/distributed, the window kind included.)"""
    import torch.distributed as dist
    from poslsh.distributed import ContextShard

    model, x = tiny_llama(window_sigmas=0.75), ids(B=1, n=37)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        outs = []
        for context in (None, ContextShard(None, 0, 37)):
            model.zero_grad()
            logits = model(x, poslsh_context=context).logits if context else model(x).logits
            logits.square().sum().backward()
            outs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    finally:
        dist.destroy_process_group()
    err = max([float((outs[0][0] - outs[1][0]).abs().max())] +
              [float((a - b).abs().max()) for a, b in zip(outs[0][1], outs[1][1])])
    print(f"alibi-window, one-rank context-parallel vs the model: max error {err:.1e}")
    assert err < 1e-12


def test_windows_past_int64_from_the_config_are_exact_alibi():
    """window_sigmas = 1e300 (windows far past int64) and window_cost_samples = 10^30 (s past int64):
    the config builds its windows (the widest window for the first: exact ALiBi, as the alibi scheme)."""
    from poslsh.window.kind import NO_WINDOW
    wide = hf.PositionalConfig(scheme="alibi-window", window_sigmas=1e300)
    assert wide.alibi_window(H).window.tolist() == [NO_WINDOW] * H
    many = hf.PositionalConfig(scheme="alibi-window", window_cost_samples=10 ** 30).alibi_window(H).window
    assert bool((many > cost_matched_window(poslsh.alibi_sigmas(H), 10 ** 6)).all())
    model = tiny_llama(window_sigmas=1e300)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=D, attention_dropout=0.0,
                                   max_position_embeddings=256)
    alibi = hf.model_from_config(cfg, "alibi").to(torch.float64).eval()
    alibi.load_state_dict(model.state_dict())
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, alibi(x).logits, rtol=1e-10, atol=1e-10)
