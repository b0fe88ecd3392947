"""Masked query rows of a patched BLOOM, MPT and Falcon are the model's own: transformers masks keys, not
queries, so a query whose token is padding still attends to the real keys before it, and one with no real
key before it weighs every key equally (the float32 model's softmax of a row at the dtype's minimum).
Models read those rows: a classifier's pooled token, the causal-LM shift from the last left pad."""
import pytest
import torch

pytest.importorskip("transformers")

from poslsh.integrations.hf import patch_alibi  # noqa: E402

from alibi_reference import reference_model, tiny_model  # noqa: E402

FAMILIES = ["bloom4", "bloom6", "mpt", "mpt_scaled", "falcon", "falcon_mq", "falcon_gqa"]


def _mixed_batch(n=23, seed=5):
    """Rows: no padding, left padding, right padding, a gap, a masked last token, every token masked."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 61, (6, n), generator=g)
    mask = torch.ones(6, n, dtype=torch.long)
    mask[1, :7] = 0
    mask[2, 15:] = 0
    mask[3, 8:12] = 0
    mask[4, -1] = 0
    mask[5] = 0
    return x, mask


@pytest.mark.parametrize("name", FAMILIES)
def test_every_row_equals_the_untouched_float32_model(name):
    model = tiny_model(name, dtype=torch.float32)
    x, mask = _mixed_batch()
    with torch.no_grad():
        want = model(x, attention_mask=mask).logits              # transformers' own, every row
        ref = reference_model(model)(x, attention_mask=mask).logits
        got = patch_alibi(model)(x, attention_mask=mask).logits
    scale = want.abs().max().item()
    assert (ref - want).abs().max() <= 2e-5 * scale               # the float64 reference is the model
    assert (got - want).abs().max() <= 2e-5 * scale


@pytest.mark.parametrize("name", FAMILIES)
def test_every_row_equals_the_float64_reference(name):
    model = tiny_model(name)
    x, mask = _mixed_batch()
    with torch.no_grad():
        want = reference_model(model, bias64=True)(x, attention_mask=mask).logits
        got = patch_alibi(model)(x, attention_mask=mask).logits
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon"])
def test_a_pooled_token_whose_mask_is_zero(name):
    model = tiny_model(name, "ForSequenceClassification", pad_token_id=0, num_labels=3)
    x, mask = _mixed_batch()                                       # no pad id: the last token is pooled
    with torch.no_grad():
        want = reference_model(model, bias64=True)(x, attention_mask=mask).logits
        f32 = model.float()(x, attention_mask=mask).logits.double()
        got = patch_alibi(model.double())(x, attention_mask=mask).logits
    assert (got - want).abs().max() <= 1e-10
    assert (got - f32).abs().max() <= 1e-4 * max(1.0, f32.abs().max().item())


@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon_mq"])
def test_left_padded_loss_and_gradients_read_the_last_pad_row(name):
    model = tiny_model(name)
    x, mask = _mixed_batch()
    x, mask = x[:2], mask[:2]                                      # unpadded and left-padded rows
    labels = x.masked_fill(mask == 0, -100)                       # the shift predicts row 1's first token
    ref = reference_model(model, bias64=True).train()             # from its last pad query
    patch_alibi(model).train()
    losses, grads = [], []
    for m in (ref, model):
        m.zero_grad()
        loss = m(x, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) <= 1e-10
    assert (grads[0] - grads[1]).abs().max() <= 1e-8 * grads[0].abs().max()


@pytest.mark.parametrize("name", ["bloom4", "mpt", "falcon_gqa"])
def test_the_per_head_cache_prefill_gives_the_same_rows(name):
    from poslsh.integrations.hf import alibi_cache
    model = patch_alibi(tiny_model(name), window=[3, 5, 9, 40])
    x, mask = _mixed_batch()
    x, mask = x[:2], mask[:2]                                      # left padding: what the cache serves
    with torch.no_grad():
        want = model(x, attention_mask=mask).logits
        got = model(x, attention_mask=mask, cache=alibi_cache(model), use_cache=True).logits
    assert (got - want).abs().max() <= 1e-12
