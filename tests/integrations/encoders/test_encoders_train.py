"""Training the encoders: gradients equal the float64 oracle's (fine-tuning DNABERT-2 for
classification is its main use), dropout acts in train mode only and is reproducible under a seed,
torch.compile of forward and backward equals eager."""
import pytest
import torch
import torch.nn.functional as F

import encoders_reference as R
from inputs import assert_compiles_like_eager
from poslsh.integrations.hf.encoders import load_alibi_encoder


@pytest.mark.parametrize("layout,heads", [("mosaic", 12), ("jina-qk-norm", 4)])
def test_gradients_equal_the_originals(tmp_path, layout, heads):
    d, cfg, st = R.checkpoint(tmp_path, layout, head="classification", heads=heads, hidden=48 if heads == 12 else 32)
    model = load_alibi_encoder(d, dtype=torch.float64)                   # eval: no dropout, as the oracle
    ids, mask, tt = R.padded_batch([3, 260, 40], cfg["vocab_size"], seed=7)
    labels = torch.tensor([0, 2, 1])
    F.cross_entropy(model(ids, mask, tt).logits, labels).backward()
    leaves = {k: v.double().requires_grad_() for k, v in st.items()}
    F.cross_entropy(R.dense_forward(layout, cfg, leaves, ids, mask, tt)["logits"], labels).backward()
    for name, p in model.named_parameters():
        assert float((p.grad - leaves[name].grad).abs().max()) <= 1e-9 * max(1.0, float(leaves[name].grad.abs().max())), name


def test_dropout_in_train_mode_only_and_seeded(tmp_path):
    d, cfg, _ = R.checkpoint(tmp_path, "jina")
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([20, 300], cfg["vocab_size"])
    with torch.no_grad():
        evaluated = model(ids, mask, tt).last_hidden_state
        model.train()
        torch.manual_seed(1)
        a = model(ids, mask, tt).last_hidden_state
        b = model(ids, mask, tt).last_hidden_state
        torch.manual_seed(1)
        again = model(ids, mask, tt).last_hidden_state
        model.eval()
        assert torch.equal(model(ids, mask, tt).last_hidden_state, evaluated)
    assert not torch.equal(a, b) and not torch.equal(a, evaluated) and torch.equal(a, again)
    assert torch.equal(a[~mask.bool()], torch.zeros_like(a[~mask.bool()]))


def test_compiled_forward_and_backward_equal_eager(tmp_path):
    d, cfg, _ = R.checkpoint(tmp_path, "mosaic", head="classification", hidden=16, intermediate=24)
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([5, 270, 31], cfg["vocab_size"], seed=8)
    params = [p for p in model.parameters()]

    def logits(*weights):
        return model(ids, mask, tt).logits
    assert_compiles_like_eager(logits, *params, fullgraph=False, out_tol=1e-12, grad_tol=1e-10)
