"""The float64 oracle of the ALiBi encoders and their test checkpoints: the padded dense forward of
each layout written from the designs (``benchmarks/encoders_dense.py``, torch only: nothing from
poslsh), configs as the original checkpoints write them, random weights in the original layout."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from encoders_dense import dense_forward, original_slopes, random_state, write_checkpoint  # noqa: E402,F401

LAYOUTS = ("mosaic", "jina", "jina-qk-norm")
TINY = dict(hidden=32, heads=4, layers=2, intermediate=40, vocab=50)


def config_for(layout: str, *, hidden=32, heads=4, layers=2, intermediate=40, vocab=50, **extra) -> dict:
    """``config.json`` as each original writes it (DNABERT-2's for ``"mosaic"``; Jina-v2's auto_map)."""
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": layers,
             "intermediate_size": intermediate, "vocab_size": vocab, "model_type": "bert", "layer_norm_eps": 1e-12,
             "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "type_vocab_size": 2, "max_position_embeddings": 512}
    if layout == "mosaic":
        cfg = {"_name_or_path": "zhihan1996/DNABERT-2-117M", "architectures": ["BertForMaskedLM"],
               "auto_map": {"AutoConfig": "configuration_bert.BertConfig", "AutoModel": "bert_layers.BertModel",
                            "AutoModelForMaskedLM": "bert_layers.BertForMaskedLM",
                            "AutoModelForSequenceClassification": "bert_layers.BertForSequenceClassification"},
               "alibi_starting_size": 512, "attention_probs_dropout_prob": 0.0, "position_embedding_type": "absolute"}
    else:
        repo = "jinaai/jina-bert-v2-qk-post-norm" if layout == "jina-qk-norm" else "jinaai/jina-bert-implementation"
        cfg = {"architectures": ["JinaBertForMaskedLM"],
               "auto_map": {"AutoConfig": f"{repo}--configuration_bert.JinaBertConfig",
                            "AutoModel": f"{repo}--modeling_bert.JinaBertModel",
                            "AutoModelForMaskedLM": f"{repo}--modeling_bert.JinaBertForMaskedLM"},
               "position_embedding_type": "alibi", "feed_forward_type": "geglu", "emb_pooler": "mean",
               "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 8192}
    return {**cfg, **sizes, **extra}


def checkpoint(tmp_path, layout: str = "mosaic", *, head: str = "none", pooler: bool = False, seed: int = 0,
               safetensors: bool = True, tied_key: bool = True, config_extra=None, **sizes):
    """A checkpoint directory in the original layout: ``(directory, config, state)``."""
    dims = {**TINY, **sizes}
    config = config_for(layout, **dims, **(config_extra or {}))
    state = random_state(layout, **dims, head=head, pooler=pooler, seed=seed)
    d = write_checkpoint(Path(tmp_path) / f"{layout}-{head}-{seed}", config, state, safetensors=safetensors,
                         tied_key=tied_key)
    return d, config, state


def reference(layout: str, config: dict, state: dict, input_ids, attention_mask=None, token_type_ids=None,
              dtype=torch.float64, window=None):
    """The dense forward of ``state`` cast to ``dtype``."""
    cast = {k: v.to(dtype) for k, v in state.items()}
    return dense_forward(layout, config, cast, input_ids, attention_mask, token_type_ids, window=window)


def padded_batch(lengths, vocab: int, *, left: bool = False, seed: int = 0):
    """``(input_ids, attention_mask, token_type_ids)`` of rows with these real lengths, padded to the
    longest (right padding, or left), pad id 0, random token types."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for r, length in enumerate(lengths):
        if left:
            mask[r, n - length:] = 1
        else:
            mask[r, :length] = 1
    tt = torch.randint(0, 2, (len(lengths), n), generator=g) * mask
    return ids * mask, mask, tt
