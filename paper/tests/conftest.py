import pytest
import torch

# Tests use small tensors: one intra-op thread avoids OpenMP overhead (and makes the
# suite insensitive to other processes sharing the CPU).
torch.set_num_threads(1)


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
