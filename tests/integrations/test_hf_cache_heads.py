"""The per-head window cache inside transformers: an alibi-window Llama (apply_positional_scheme) with per-head
windows [4, 9, 17, 40] generates exactly what recomputation without a cache gives, holding w_h + 1 rows per
head; left padding, beam search, the certificate over long generations, the entry point for attentions that
call the cache themselves (attend_window), and the refusals."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh.decoding import Certificate, CertificateWarning, HeadWindows, certified_window  # noqa: E402
from poslsh.integrations import hf  # noqa: E402
from poslsh.integrations.hf import cache as hf_cache  # noqa: E402
from poslsh.integrations.hf.config import positional_config  # noqa: E402
from poslsh.integrations.hf.schemes.convert import attention_modules  # noqa: E402
from poslsh.integrations.hf.schemes.state import layer_state  # noqa: E402
from poslsh.reference import alibi_attention_reference  # noqa: E402
from poslsh.window import make_window  # noqa: E402

WINDOWS = [4, 9, 17, 40]


def set_windows(model, windows):
    """Give every layer of an alibi-window model these per-head windows (what layer_window would build)."""
    pc = positional_config(model.config)
    H = model.config.num_attention_heads
    win = make_window(poslsh.alibi_slopes(H), torch.tensor(windows))
    for m in attention_modules(model):
        layer_state(m).window = ((False, H, pc.window_sigmas, pc.window_cost_samples, torch.device("cpu")), win)
    return model


def window_model(windows=WINDOWS, KV=4, layers=2, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=KV, head_dim=8,
                                   max_position_embeddings=1 << 16, attention_dropout=0.0, pad_token_id=0,
                                   bos_token_id=None, eos_token_id=None)
    model = hf.apply_positional_scheme(transformers.LlamaForCausalLM(cfg), "alibi-window", window_sigmas=1.0)
    with torch.no_grad():                  # attention that matters: logits of order 1, outputs of the residual's size
        for m in attention_modules(model):
            for proj in (m.q_proj, m.k_proj, m.v_proj, m.o_proj):
                proj.weight.mul_(6.0)
    return set_windows(model.to(dtype).eval(), windows)


def tokens(n, seed=1, B=1):
    return torch.randint(1, 61, (B, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, x, steps, mask=None, **kw):
    out = model.generate(x, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out, torch.stack(out.logits, 1)


def left_pad(prompts):
    N = max(len(p) for p in prompts)
    x, mask = torch.zeros(len(prompts), N, dtype=torch.long), torch.zeros(len(prompts), N, dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, N - len(p):], mask[b, N - len(p):] = p, 1
    return x, mask


def generation_equals_recomputation(steps):
    model, x = window_model(), tokens(20)
    cached, lc = greedy(model, x, steps)
    cache = cached.cache
    assert isinstance(cache, hf.PoslshCache)                    # generate() picked it by itself
    plain, lp = greedy(model, x, steps, use_cache=False)
    # generate() hands out float32 logits: the float64 ones, step by step through a cache and in one forward
    seq = cached.sequences
    with torch.no_grad():
        full = model(seq).logits[0]
        by_step, c = [], hf.generation_cache(model)
        by_step.append(model(seq[:, :20], cache=c, use_cache=True).logits[0])
        for t in range(20, seq.shape[1]):
            by_step.append(model(seq[:, t:t + 1], cache=c, use_cache=True).logits[0])
    by_step = torch.cat(by_step)
    assert by_step.dtype == torch.float64 and float((by_step - full).abs().max()) < 1e-10
    err = float((by_step[-1] - full[-1]).abs().max())
    rows = sum(w + 1 for w in WINDOWS)
    limit = 1.15 * rows * (8 + 8) * 8 * 2                       # 1.15 x sum_h (w_h + 1) (dk + dv) 8 bytes x layers
    print(f"{steps} tokens: equal {torch.equal(cached.sequences, plain.sequences)}, last logits differ by {err:.1e}, "
          f"kept {cache.kept_keys().tolist()}, {cache.nbytes()} bytes (limit {limit:.0f})")
    assert torch.equal(cached.sequences, plain.sequences) and err < 1e-10
    assert cache.kept_keys().tolist() == [[w + 1 for w in WINDOWS]] * 2
    assert cache.nbytes() <= limit


def test_generate_300_tokens_equals_recomputation_holding_w_plus_one_rows_per_head():
    generation_equals_recomputation(300)


@pytest.mark.slow
def test_generate_2k_tokens_equals_recomputation():
    generation_equals_recomputation(2000)


def test_gqa_left_padding_and_beam_search():
    """Two KV heads (rows max(4, 9) + 1 and max(17, 40) + 1): a left-padded batch's rows equal each prompt
    alone, and beam search equals beam search over a full DynamicCache."""
    model = window_model(KV=2)
    prompts = [tokens(n, seed=n)[0] for n in (30, 17, 6)]
    x, mask = left_pad(prompts)
    out, logits = greedy(model, x, 25, mask)
    assert out.cache.kept_keys().tolist() == [[10, 41]] * 2
    N = x.shape[1]
    for b, p in enumerate(prompts):
        alone, la = greedy(model, p[None], 25, use_cache=False)
        err = float((logits[b] - la[0]).abs().max())
        assert torch.equal(out.sequences[b, N:], alone.sequences[0, len(p):]) and err < 1e-10
    a = model.generate(x, attention_mask=mask, num_beams=3, max_new_tokens=12, do_sample=False, pad_token_id=0)
    b = model.generate(x, attention_mask=mask, num_beams=3, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       cache=transformers.DynamicCache(config=model.config))
    assert torch.equal(a, b)


def record_layer0(monkeypatch, every):
    """Keep layer 0's keys and values, and its output and bounds every ``every`` positions."""
    log = {"k": [], "v": [], "checks": []}
    attend = HeadWindows.attend

    def spy(self, q, k, v, **kw):
        out = attend(self, q, k, v, **kw)
        if self.name == "layer 0":
            log["k"].append(k)
            log["v"].append(v)
            p = self.total - 1
            if q.shape[2] == 1 and p % every == 0:
                log["checks"].append((p, q[:, :, 0], out[:, :, 0], self.last_error_bound[:, :, 0]))
        return out
    monkeypatch.setattr(HeadWindows, "attend", spy)
    return log


def certified_generation(monkeypatch, steps, every):
    """Certified windows (tol 1e-3, policy "raise"): at sampled steps layer 0's output is within the
    certificate's bound of exact ALiBi over every past key."""
    slopes = poslsh.alibi_slopes(4)
    win = certified_window(1e-3, 8.0, slopes=slopes)      # an assumed logit range of 8
    model = window_model(win.window.tolist())
    log = record_layer0(monkeypatch, every)
    cache = hf.PoslshCache(model, certificate=Certificate(1e-3, "raise"))
    with torch.no_grad():
        model.generate(tokens(16), max_new_tokens=steps, do_sample=False, pad_token_id=0, cache=cache)
    K, V = torch.cat(log["k"], 2), torch.cat(log["v"], 2)
    worst = 0.0
    for p, q, out, bound in log["checks"]:
        s = torch.einsum("bhd,bhjd->bhj", q, K[:, :, :p + 1]) * 8 ** -0.5 - slopes[None, :, None] * (p - torch.arange(p + 1))
        exact = torch.einsum("bhj,bhjd->bhd", torch.softmax(s, -1), V[:, :, :p + 1])
        err = (out - exact).abs()
        assert bool((err <= bound + 1e-13).all()), f"position {p}"
        worst = max(worst, float(err.max()))
    st = cache.stats()[0]["certificate"]
    print(f"{steps} tokens, windows {win.window.tolist()}: {len(log['checks'])} steps checked, worst |error| "
          f"{worst:.1e}, worst bound on the mass {st['worst']:.1e}")
    assert len(log["checks"]) >= 10 and st["steps"] >= steps and sum(st["exceeded"]) == 0 and worst > 0


def test_certified_generation_stays_within_its_bound(monkeypatch):
    certified_generation(monkeypatch, 1500, 97)


@pytest.mark.slow
def test_certified_20k_token_generation_stays_within_its_bound(monkeypatch):
    certified_generation(monkeypatch, 20000, 997)


def test_too_small_windows_trip_the_certificate_and_refusals_are_one_line():
    model, x = window_model([1, 1, 1, 1]), tokens(12)
    with pytest.raises(ValueError, match="certificate: head .* above tol=1e-06") as e:
        model.generate(x, max_new_tokens=3, pad_token_id=0, cache=hf.PoslshCache(model, certificate=Certificate(1e-6, "raise")))
    assert "\n" not in str(e.value)
    with pytest.warns(CertificateWarning, match="above tol=1e-06"):
        model.generate(x, max_new_tokens=3, pad_token_id=0, cache=hf.PoslshCache(model, certificate=Certificate(1e-6)))
    model = window_model()
    with pytest.raises(ValueError, match="head 3 needs a window of 40 keys, more than cap=10") as e:
        model.generate(x, max_new_tokens=3, pad_token_id=0,
                       cache=hf.PoslshCache(model, certificate=Certificate(1e-3, "raise", cap=10)))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="only per-head window caches") as e:
        hf.PoslshCache(model, certificate=Certificate(1e-3), per_head=False)


def test_attend_window_is_the_entry_point_of_an_attention_with_per_head_windows():
    """What a patched model's attention does: for every layer, cache.attend_window(layer_idx, q, k, v, window,
    valid=...) stores the step's keys and returns its output; it equals the dense oracle row by row, the cache
    API answers (length, mask sizes, beam reordering), and a query on another device is refused."""
    model = window_model()
    cache = hf.PoslshCache.for_windows(model)
    win = make_window(poslsh.alibi_slopes(4), torch.tensor(WINDOWS))
    g = torch.Generator().manual_seed(0)
    n, pads = 60, [0, 11]
    q, k, v = (torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    valid = torch.arange(n)[None] >= torch.tensor(pads)[:, None]
    outs, pos = [], 0
    for c in (13, 1, 1, 30, 1, 14):
        for layer in range(2):
            o = cache.attend_window(layer, q[:, :, pos:pos + c], k[:, :, pos:pos + c], v[:, :, pos:pos + c], win,
                                    valid=valid[:, pos:pos + c])
        outs.append(o)
        pos += c
        assert cache.get_seq_length() == pos and cache.get_mask_sizes(1, 0) == (1, pos)
    got = torch.cat(outs, 2)
    for b, p in enumerate(pads):
        want = alibi_attention_reference(q[b:b + 1, :, p:], k[b:b + 1, :, p:], v[b:b + 1, :, p:], win.slopes,
                                      window=win.window, causal=True)
        assert float((got[b:b + 1, :, p:] - want).abs().max()) < 1e-12
    assert cache.kept_keys().tolist() == [[w + 1 for w in WINDOWS]] * 2
    more = [torch.randn(1, 4, 1, 8, dtype=torch.float64).expand(2, -1, -1, -1) for _ in range(3)]
    before = cache.attend_window(0, *more, win)                  # the same new token in both rows ...
    assert not torch.allclose(before[0], before[1])              # ... sees different pasts
    cache.reorder_cache(torch.tensor([1, 1]))                    # beam search: both rows continue row 1
    step = cache.attend_window(0, *more, win)
    assert torch.equal(step[0], step[1])
    with pytest.raises(ValueError, match="holds its keys on cpu but the model runs on meta") as e:
        cache.attend_window(1, *(t.to("meta") for t in more), win)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="another window"):
        cache.attend_window(1, *more, make_window(poslsh.alibi_slopes(4), 3))
