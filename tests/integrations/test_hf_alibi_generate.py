"""Generation and the transformers testers' self-consistency checks on patched BLOOM, MPT and Falcon:
greedy, beam and sampled generation equal the float64 reference's; past vs no past, a masked stretch
before the cached step (the testers' "attention mask past"), left padding, batched vs one by one."""
import pytest
import torch

pytest.importorskip("transformers")

from poslsh.integrations.hf import patch_alibi  # noqa: E402

from alibi_reference import reference_model, tiny_model  # noqa: E402

FAMILIES = ["bloom4", "mpt", "falcon"]


def _prompts(B=3, n=9, pads=(0, 3, 5), seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, 61, (B, n), generator=g)
    mask = torch.ones(B, n, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        x[b, :p] = 0
    return x, mask


GEN = {"greedy": dict(do_sample=False), "beam": dict(do_sample=False, num_beams=3),
       "sampled": dict(do_sample=True, top_k=0, temperature=1.5)}


@pytest.mark.parametrize("how", sorted(GEN))
@pytest.mark.parametrize("name", FAMILIES)
def test_generation_equals_the_reference(name, how):
    model = tiny_model(name, pad_token_id=0)
    ref = reference_model(model)
    patch_alibi(model)
    x, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=7, pad_token_id=0, **GEN[how])
    outs = []
    for m in (ref, model):
        torch.manual_seed(11)
        outs.append(m.generate(x, **kw))
    assert torch.equal(outs[0], outs[1])
    assert outs[1].shape[1] == x.shape[1] + 7


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_generation_equals_one_by_one_and_no_cache(name):
    model = patch_alibi(tiny_model(name, pad_token_id=0))
    x, mask = _prompts()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    batched = model.generate(x, attention_mask=mask, **kw)
    uncached = model.generate(x, attention_mask=mask, use_cache=False, **kw)
    assert torch.equal(batched, uncached)
    for b in range(x.shape[0]):
        real = x[b:b + 1, mask[b].bool()]
        alone = model.generate(real, attention_mask=torch.ones_like(real), **kw)
        assert torch.equal(alone[0], batched[b, -alone.shape[1]:])


def _last(out):
    return out.last_hidden_state[:, -1]


@pytest.mark.parametrize("name", FAMILIES)
def test_past_vs_no_past_with_padding_and_a_masked_stretch(name):
    model = patch_alibi(tiny_model(name, "Model"))
    ref = reference_model(tiny_model(name, "Model"))
    for case in ("past", "left_padding", "attention_mask_past"):
        x, mask = _prompts()
        if case == "past":
            mask = torch.ones_like(mask)
        if case == "attention_mask_past":           # the testers' check: the second half masked, then a step
            mask = torch.ones_like(mask)
            mask[:, x.shape[1] // 2:] = 0
        out = model(x, attention_mask=mask, use_cache=True)
        nxt = torch.randint(3, 61, (x.shape[0], 3), generator=torch.Generator().manual_seed(5))
        x2 = torch.cat([x, nxt], 1)
        m2 = torch.cat([mask, torch.ones_like(nxt)], 1)
        full = model(x2, attention_mask=m2).last_hidden_state[:, -3:]
        step = model(nxt, cache=out.cache, attention_mask=m2).last_hidden_state
        want = ref(x2, attention_mask=m2).last_hidden_state[:, -3:]
        assert (full - step).abs().max() <= 1e-10, case
        assert (full - want).abs().max() <= 1e-10, case


@pytest.mark.parametrize("name", FAMILIES)
def test_a_left_padded_batch_equals_each_row_alone(name):
    model = patch_alibi(tiny_model(name))
    x, mask = _prompts(n=20, pads=(0, 4, 11))
    with torch.no_grad():
        batched = model(x, attention_mask=mask).logits
        for b in range(x.shape[0]):
            real = x[b:b + 1, mask[b].bool()]
            alone = model(real).logits[0]
            assert (batched[b, mask[b].bool()] - alone).abs().max() <= 1e-10


@pytest.mark.parametrize("mode", [dict(window=[1, 4, 9, 30]), dict(num_samples=4)])
@pytest.mark.parametrize("name", ["bloom4", "falcon"])
def test_windows_and_positional_lsh_decode_as_they_prefill(name, mode):
    model = patch_alibi(tiny_model(name, "Model"), **mode)
    x, mask = _prompts(n=30, pads=(0, 3, 12))
    out = model(x, attention_mask=mask, use_cache=True)
    nxt = torch.randint(3, 61, (x.shape[0], 4), generator=torch.Generator().manual_seed(6))
    m2 = torch.cat([mask, torch.ones_like(nxt)], 1)
    full = model(torch.cat([x, nxt], 1), attention_mask=m2).last_hidden_state[:, -4:]
    step = model(nxt, cache=out.cache, attention_mask=m2).last_hidden_state
    assert (full - step).abs().max() <= 1e-10
