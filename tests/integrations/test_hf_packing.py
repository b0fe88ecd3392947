"""Packed batches through the registered attention functions: a packed forward of a tiny float64
Llama (GQA, causal) equals each document run alone, logits and gradients, whether the documents
come from position ids that restart (one row or per row), from DataCollatorWithFlattening's
cu_seq_lens keyword arguments, or from a block-diagonal 4-D mask; contradictions raise one line."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from poslsh.integrations import hf  # noqa: E402

BACKEND = "auto"
H, KV, D, VOCAB = 4, 2, 8, 61
LENGTHS = [1, 7, 1, 13, 2, 9]        # awkward: 1-token documents, odd lengths
SCHEMES = {"poslsh": dict(num_samples=3), "fixed_blocks": dict(block_size=5), "alibi": {},
           "alibi-window": dict(window_sigmas=0.75)}


def tiny_llama(scheme, seed=0, **params):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=KV, head_dim=D, attention_dropout=0.0,
                                   max_position_embeddings=256)
    torch.manual_seed(seed)
    return hf.model_from_config(cfg, scheme, backend=BACKEND, **{**SCHEMES[scheme], **params}).to(torch.float64)


def documents(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def restart_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def logits_and_grads(model, batches, weights):
    """``sum_b (logits_b * weights_b).sum()``'s gradient w.r.t. every parameter, and the logits."""
    model.zero_grad()
    outs = []
    for kwargs, w in zip(batches, weights):
        logits = model(**kwargs).logits
        (logits * w).sum().backward()
        outs.append(logits.detach())
    return outs, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_packed_equals_alone(model, lengths, packed_kwargs, **call):
    docs = documents(lengths)
    n = sum(lengths)
    weights = torch.randn(1, n, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    packed, g_packed = logits_and_grads(model, [dict(input_ids=torch.cat(docs)[None], **packed_kwargs, **call)],
                                        [weights])
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    alone, g_alone = logits_and_grads(model, [dict(input_ids=d[None], **call) for d in docs],
                                      [weights[:, a:b] for a, b in zip(starts, starts[1:])])
    torch.testing.assert_close(packed[0], torch.cat(alone, 1), rtol=1e-10, atol=1e-10)
    for name, g in g_alone.items():
        torch.testing.assert_close(g_packed[name], g, rtol=1e-9, atol=1e-10, msg=name)
    return packed[0]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_packed_position_ids_equal_each_document_alone(scheme):
    model = tiny_llama(scheme).eval()
    assert_packed_equals_alone(model, LENGTHS, dict(position_ids=restart_positions(LENGTHS)[None]))


def test_packed_training_step_equals_each_document_alone():
    """Training mode: the partitions of the step, laid over every document from its start."""
    model = tiny_llama("poslsh").train()
    assert_packed_equals_alone(model, LENGTHS, dict(position_ids=restart_positions(LENGTHS)[None]), poslsh_step=4)


@pytest.mark.parametrize("scheme", ["poslsh", "alibi-window"])
def test_data_collator_with_flattening(scheme):
    """DataCollatorWithFlattening's batch (position ids and cu_seq_lens / max_length kwargs)."""
    docs = documents(LENGTHS)
    for kwargs in ({}, {"return_flash_attn_kwargs": True}):
        batch = transformers.DataCollatorWithFlattening(**kwargs)([{"input_ids": d.tolist()} for d in docs])
        assert ("cu_seq_lens_q" in batch) == bool(kwargs)
        model = tiny_llama(scheme).eval()
        packed = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
        assert_packed_equals_alone(model, LENGTHS, packed)


def test_cu_seq_lens_alone_describe_the_documents():
    """cu_seq_lens_q/k without restarting position ids (the model's default positions)."""
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    model = tiny_llama("poslsh").eval()
    assert_packed_equals_alone(model, LENGTHS, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13,
                                                    max_length_k=13))


@pytest.mark.parametrize("scheme", ["poslsh", "alibi"])
def test_rows_packed_differently(scheme):
    """B = 2, every row its own documents (per-row position ids): each row equals its documents alone."""
    rows = [[3, 1, 8, 4], [5, 11]]
    model = tiny_llama(scheme).eval()
    x = torch.stack([torch.cat(documents(r, seed=i)) for i, r in enumerate(rows)])
    pos = torch.stack([restart_positions(r) for r in rows])
    with torch.no_grad():
        packed = model(x, position_ids=pos).logits
        for i, r in enumerate(rows):
            alone = torch.cat([model(d[None]).logits[0] for d in documents(r, seed=i)])
            torch.testing.assert_close(packed[i], alone, rtol=1e-10, atol=1e-10)


def test_block_diagonal_mask_is_read_as_documents(caplog):
    lengths = [4, 1, 6]
    n = sum(lengths)
    mask = torch.zeros(n, n, dtype=torch.bool)
    a = 0
    for m in lengths:
        mask[a:a + m, a:a + m] = True
        a += m
    model = tiny_llama("poslsh").eval()
    with caplog.at_level("WARNING", logger="poslsh.integrations.hf"):
        assert_packed_equals_alone(model, lengths, dict(attention_mask=mask.tril()[None, None]))
    assert not [r for r in caplog.records if "dense" in r.getMessage()]


def test_use_cache_false_builds_no_mask():
    """transformers builds sdpa's n x n packed mask only with use_cache=False; here it builds none
    (the documents come from the position ids) and the result is the same."""
    model = tiny_llama("poslsh").eval()
    seen = []
    real = hf.poslsh_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(attention_mask)
        return real(module, query, key, value, attention_mask, *args, **kwargs)

    transformers.AttentionInterface.register("poslsh", spy)
    try:
        x, pos = torch.cat(documents(LENGTHS))[None], restart_positions(LENGTHS)[None]
        with torch.no_grad():
            a = model(x, position_ids=pos, use_cache=False).logits
            b = model(x, position_ids=pos, use_cache=True).logits
    finally:
        hf.register()
    assert seen and all(m is None for m in seen)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_contradictions_raise_one_line():
    model = tiny_llama("poslsh").eval()
    x = torch.cat(documents(LENGTHS))[None]
    n = x.shape[1]
    cu = torch.tensor([0, 5, n], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q / cu_seq_lens_k"):
        model(x, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 6, n], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_q and position_ids describe different"):
        model(x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, position_ids=restart_positions(LENGTHS)[None])
    with pytest.raises(ValueError, match="cu_seq_lens_q with an attention mask"):
        model(x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, attention_mask=torch.ones(1, 1, n, n, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="must each count from 0"):
        model(x, position_ids=torch.cat([torch.arange(10), torch.arange(3, n - 7)])[None])
