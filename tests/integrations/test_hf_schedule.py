"""Every attention layer of a converted model draws its partitions by poslsh.PartitionSchedule:
the same partitions as a schedule built by hand, cached on the device, and the step travelling
with the inputs so gradient-checkpoint recomputation draws the same masks."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import poslsh  # noqa: E402
from poslsh.integrations import hf  # noqa: E402

H, KV, D, VOCAB = 4, 2, 8, 61


def tiny_llama(**params):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=D, attention_dropout=0.0,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    return hf.model_from_config(cfg, "poslsh", **{"num_samples": 3, **params}).to(torch.float64)


def ids(B=2, n=29):
    return torch.randint(0, VOCAB, (B, n), generator=torch.Generator().manual_seed(1))


def grads(model, x, **kw):
    model.zero_grad()
    model(x, labels=x, use_cache=False, **kw).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_layers_use_the_partition_schedule():
    model = tiny_llama(num_samples=4, seed=2, eval_seed=9, sampler="stratified")
    for layer in (0, 1):
        attn = model.model.layers[layer].self_attn
        schedule = poslsh.PartitionSchedule(poslsh.alibi_sigmas(H), 4, layer=layer, seed=2, eval_seed=9,
                                            sampler="stratified")
        model.train()
        assert hf.layer_partitions(attn, H, step=11) == schedule.partitions(True, 11)
        model.eval()
        got = hf.layer_partitions(attn, H)
        assert got == schedule.partitions(False)
        assert hf.layer_partitions(attn, H) is got                      # cached: no redraw, no copy
        assert isinstance(hf.layer_state(attn).schedule[1], poslsh.PartitionSchedule)


def test_gradient_checkpointing_recomputes_with_the_same_partitions():
    model = tiny_llama().train()
    x = ids()
    want = grads(model, x, poslsh_step=5)
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    got = grads(model, x, poslsh_step=5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-13, msg=name)
    other = grads(model, x, poslsh_step=6)
    assert any(not torch.allclose(other[n], want[n]) for n in want)   # another step, other partitions


def test_the_step_may_be_any_integer_scalar():
    model = tiny_llama().train()
    x = ids(B=1, n=9)
    with torch.no_grad():
        want = model(x, poslsh_step=3).logits
        for step in (np.int64(3), torch.tensor(3)):
            torch.testing.assert_close(model(x, poslsh_step=step).logits, want, rtol=0, atol=0)
        with pytest.raises(ValueError, match="poslsh_step must be an int >= 0"):
            model(x, poslsh_step=True)
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            model(x, poslsh_step=-1)
        with pytest.raises(ValueError, match="poslsh_step must be an int >= 0"):
            model(x, poslsh_step=2.5)
