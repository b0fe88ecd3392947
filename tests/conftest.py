import pytest
import torch

import poslsh

# Tests use small tensors: one intra-op thread avoids OpenMP overhead (and makes the
# suite insensitive to other processes sharing the CPU).
torch.set_num_threads(1)


def make_qkv(B, Hq, Hkv, n, d, *, dtype=torch.float64, seed=0, dv=None, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, n, dv or d, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def alibi_partitions(H, s, seed=0, stretch=1.0):
    return poslsh.sample_partitions(poslsh.alibi_sigmas(H) * stretch, s, seed=seed)


@pytest.fixture
def qkv_factory():
    return make_qkv


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A randomly initialised 2-layer Llama (6 query / 2 key-value heads) with a word-level
    tokenizer, saved with ``save_pretrained``: stands in for SmolLM2 in end-to-end CLI tests."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      rope_theta=100.0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(path))
    return path
