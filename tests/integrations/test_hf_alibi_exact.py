"""patch_alibi in exact mode on tiny BLOOM (4, 6, 12 heads), MPT (with and without softmax_scale /
clip_qkv) and Falcon (alibi=True, multi-query too): float64 logits and gradients equal the float64
reference of the unpatched model (tests/integrations/alibi_reference.py), which itself equals the
untouched model at float32 precision; every head class; MPT past max_seq_len."""
import pytest
import torch

pytest.importorskip("transformers")

from poslsh.integrations.hf import alibi_stats, patch_alibi  # noqa: E402

from alibi_reference import NAMES, left_padded_batch, real_tokens, reference_model, tiny_model  # noqa: E402

N, B, PAD = 37, 3, (0, 9, 20)

# power-of-two slopes: the float64 product is exact; BLOOM's 6 and 12 heads have float32 slopes whose
# product with the position transformers rounds in float32 (its alibi tensor), the reference keeps it
TOL = {"bloom6": 1e-5, "bloom12": 1e-5}


def _batch(vocab=61, n=N, pads=PAD, seed=1):
    return left_padded_batch(n, pads, seed, vocab=vocab)


_real = real_tokens


@pytest.mark.parametrize("name", NAMES)
def test_reference_is_the_untouched_model_at_float32_precision(name):
    model = tiny_model(name, dtype=torch.float32)
    x, mask = _batch()
    with torch.no_grad():
        got = reference_model(model)(x, attention_mask=mask).logits
        want = model(x, attention_mask=mask).logits
    assert torch.allclose(_real(got, mask), _real(want, mask), atol=2e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_float64_logits_equal_the_reference_on_a_left_padded_batch(name):
    model = tiny_model(name)
    ref = reference_model(model)
    x, mask = _batch()
    with torch.no_grad():
        want = ref(x, attention_mask=mask).logits
        untouched = model(x, attention_mask=mask).logits
        patch_alibi(model)
        got = model(x, attention_mask=mask).logits
        plain = model(x).logits
    tol = TOL.get(name, 1e-10)
    assert (_real(got, mask) - _real(want, mask)).abs().max() <= tol
    assert torch.isfinite(got).all()                             # the patched padded rows are finite
    if name.startswith(("bloom", "mpt")):
        assert not torch.isfinite(untouched).all()               # transformers' own are NaN in float64
    with torch.no_grad():
        want_plain = ref(x).logits
    assert (plain - want_plain).abs().max() <= tol
    if name in TOL:                     # with the product in float64 too, every slope is exact
        with torch.no_grad():
            want64 = reference_model(model, bias64=True)(x, attention_mask=mask).logits
        assert (_real(got, mask) - _real(want64, mask)).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["bloom4", "bloom6", "mpt_scaled", "falcon", "falcon_mq"])
def test_parameter_gradients_equal_the_reference(name):
    model = tiny_model(name)
    ref = reference_model(model, bias64=True)
    patch_alibi(model)
    x, mask = _batch()
    w = torch.randn(B, N, 61, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * mask[..., None]
    grads = []
    for m in (ref, model):
        m.zero_grad()
        (m(x, attention_mask=mask).logits * w).sum().backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    tol = 1e-8
    for k in grads[0]:
        scale = max(1.0, grads[0][k].abs().max().item())
        assert (grads[0][k] - grads[1][k]).abs().max() <= tol * scale, k


HEADS = ["ForCausalLM", "Model", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"]


def _outputs(out):
    names = ["logits", "start_logits", "end_logits", "last_hidden_state"]
    return [getattr(out, k) for k in names if getattr(out, k, None) is not None]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("family", ["bloom4", "mpt", "falcon"])
def test_every_head_class(family, head):
    model = tiny_model(family, head, pad_token_id=0)
    ref = reference_model(model)
    x, mask = _batch(pads=(0, 5))
    x[1, :5] = 0
    x[x == 0] = 1
    x[1, :5] = 0
    with torch.no_grad():
        want = _outputs(ref(x, attention_mask=mask))
        assert patch_alibi(model) is model
        got = _outputs(model(x, attention_mask=mask))
    assert len(got) == len(want) >= 1
    for g, w in zip(got, want):
        if g.dim() >= 2 and g.shape[:2] == mask.shape:
            g, w = _real(g, mask), _real(w, mask)
        assert (g - w).abs().max() <= 1e-10


def test_mpt_runs_past_max_seq_len_as_a_widened_mpt():
    short = tiny_model("mpt", max_seq_len=16)
    wide = tiny_model("mpt", max_seq_len=4096)
    wide.load_state_dict(short.state_dict())
    x, mask = _batch(n=50, pads=(0, 7))
    with pytest.raises(RuntimeError):
        short(x)                                                   # transformers' MPT stops at max_seq_len
    with torch.no_grad():
        want = reference_model(wide)(x, attention_mask=mask).logits
        got = patch_alibi(short)(x, attention_mask=mask).logits
    assert (_real(got, mask) - _real(want, mask)).abs().max() <= 1e-10


def test_patching_again_reconfigures_and_the_same_arguments_give_the_same_model():
    model = tiny_model("bloom4")
    x, _ = _batch(pads=(0,))
    with torch.no_grad():
        exact = patch_alibi(model)(x).logits
        windowed = patch_alibi(model, window=3)(x).logits
        again = patch_alibi(model)(x).logits
    assert alibi_stats(model)[0]["mode"] == "exact"
    assert torch.equal(exact, again)
    assert (exact - windowed).abs().max() > 1e-6
    assert len(model._poslsh_alibi_hooks) == 2                      # hooks installed once


def test_float32_and_bfloat16_forward_and_backward():
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = tiny_model("falcon", dtype=dtype)
        ref = reference_model(model.double())
        model = model.to(dtype)
        x, mask = _batch(pads=(0, 4))
        with torch.no_grad():
            want = ref(x, attention_mask=mask).logits
        patch_alibi(model)
        out = model(x, attention_mask=mask).logits
        out.float().sum().backward()
        assert out.dtype == dtype and torch.isfinite(out).all()
        err = (_real(out.double(), mask) - _real(want, mask)).abs().max() / want.abs().max()
        assert err <= tol, (dtype, err)
