"""Loading the encoders as their original code saves them: safetensors and pytorch_model.bin, with
and without the tied decoder key, sharded; the save / load round trip; the refusals, each one line;
a tokenizer's batch through the model to pooled embeddings."""
import json

import pytest
import torch

import encoders_reference as R
from poslsh.integrations.hf.encoders import (AlibiEncoderForMaskedLM, AlibiEncoderModel, load_alibi_encoder,
                                          pool_embeddings, read_state_dict)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _refused(match, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("safetensors,tied_key", [(True, True), (True, False), (False, True), (False, False)])
def test_every_file_form_loads_the_same_model(tmp_path, safetensors, tied_key):
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", head="mlm", safetensors=safetensors, tied_key=tied_key)
    model = load_alibi_encoder(d)
    assert isinstance(model, AlibiEncoderForMaskedLM) and not model.training
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids, mask, tt = R.padded_batch([40, 9], cfg["vocab_size"])
    ref = R.reference("mosaic", cfg, st, ids, mask, tt, dtype=torch.float32)
    assert float((model(ids, mask, tt).logits - ref["logits"]).abs().max()) <= 1e-4


def test_a_sharded_checkpoint_loads(tmp_path):
    from safetensors.torch import save_file
    d, cfg, st = R.checkpoint(tmp_path, "jina")
    (d / "model.safetensors").unlink()
    names = sorted(st)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in halves.items():
        save_file({k: st[k].contiguous() for k in keys}, str(d / file))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(read_state_dict(d)) == set(st)
    assert isinstance(load_alibi_encoder(d), AlibiEncoderModel)


@pytest.mark.parametrize("safe", [True, False])
def test_save_and_load_round_trip(tmp_path, safe):
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", head="classification")
    model = load_alibi_encoder(d, dtype=torch.float64)
    assert set(model.state_dict()) == set(st)                             # the original's names
    again = load_alibi_encoder(model.save_pretrained(tmp_path / "saved", safe_serialization=safe), dtype=torch.float64)
    ids, mask, tt = R.padded_batch([30, 300], cfg["vocab_size"])
    assert torch.equal(model(ids, mask, tt).logits, again(ids, mask, tt).logits)
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == cfg


def test_the_jina_ports_unused_weights_are_ignored(tmp_path):
    """transformers' Jina port builds a position table and a BERT MLP in every layer and never calls them."""
    d, cfg, st = R.checkpoint(tmp_path, "jina-qk-norm")
    extra = {"embeddings.position_embeddings.weight": torch.ones(512, 32),
             "encoder.layer.0.intermediate.dense.weight": torch.ones(40, 32),
             "encoder.layer.1.output.LayerNorm.bias": torch.ones(32)}
    R.write_checkpoint(d, cfg, {**st, **extra})
    ids, mask, tt = R.padded_batch([30, 7], cfg["vocab_size"])
    got = load_alibi_encoder(d, dtype=torch.float64)(ids, mask, tt).last_hidden_state
    want = R.reference("jina-qk-norm", cfg, st, ids, mask, tt)["last_hidden_state"] * mask[..., None]
    assert float((got - want).abs().max()) <= 1e-10


def test_the_tied_decoder_must_be_tied(tmp_path):
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", head="mlm", safetensors=False)
    st = dict(st, **{"cls.predictions.decoder.weight": st["cls.predictions.decoder.weight"] + 1})
    R.write_checkpoint(d, cfg, st, safetensors=False)
    _refused("differs from the word embeddings", load_alibi_encoder, d)


def _plain_bert_state(H=32):
    s = {"embeddings.word_embeddings.weight": torch.zeros(50, H), "embeddings.position_embeddings.weight":
         torch.zeros(512, H), "embeddings.token_type_embeddings.weight": torch.zeros(2, H)}
    for t in ("query", "key", "value"):
        s[f"encoder.layer.0.attention.self.{t}.weight"] = torch.zeros(H, H)
    s["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(4 * H, H)
    return s


def test_refusals_are_one_line(tmp_path):
    plain = R.write_checkpoint(tmp_path / "plain", {"model_type": "bert", "hidden_size": 32}, _plain_bert_state())
    _refused("a plain BERT", load_alibi_encoder, plain)
    rope_cfg = {"model_type": "nomic_bert", "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0}
    _refused("a RoPE encoder", load_alibi_encoder, R.write_checkpoint(tmp_path / "rope", rope_cfg, _plain_bert_state()))
    _refused("unknown layout", load_alibi_encoder,
             R.write_checkpoint(tmp_path / "odd", {"model_type": "bert"}, {"embeddings.word_embeddings.weight": torch.zeros(5, 4)}))
    d, cfg, st = R.checkpoint(tmp_path, "jina")
    R.write_checkpoint(d, R.config_for("mosaic"), st)                      # DNABERT-2's config, Jina's weights
    _refused("names MosaicBERT code", load_alibi_encoder, d)
    R.write_checkpoint(d, R.config_for("jina", hidden=64), st)
    _refused("hidden_size = 64 but the weights have 32", load_alibi_encoder, d)
    R.write_checkpoint(d, {**cfg, "position_embedding_type": "absolute"}, st)
    _refused("learned positions", load_alibi_encoder, d)
    R.write_checkpoint(d, cfg, {k: v for k, v in st.items() if "layer.1.mlp.wo.bias" not in k})
    _refused("weights missing", load_alibi_encoder, d)
    R.write_checkpoint(d, cfg, dict(st, **{"encoder.layer.0.mlp.extra.weight": torch.zeros(3)}))
    _refused("weights with no place", load_alibi_encoder, d)
    R.write_checkpoint(d, cfg, dict(st, **{"decoder.weight": torch.zeros(3)}))
    _refused("no head here takes", load_alibi_encoder, d)
    R.write_checkpoint(d, cfg, st)
    _refused("window='certified' needs tol", load_alibi_encoder, d, window="certified")
    _refused("only with window='certified'", load_alibi_encoder, d, tol=1e-3)
    _refused("not a checkpoint directory", load_alibi_encoder, tmp_path / "nowhere")
    _refused("dtype: a floating torch.dtype", load_alibi_encoder, d, dtype=torch.int32)
    model = load_alibi_encoder(d)
    ids, mask, _ = R.padded_batch([5, 5], 50)
    mask[0, 2] = 0
    _refused("one contiguous run", model, ids, mask)


def test_training_with_attention_dropout_drops_probabilities_exactly(tmp_path, monkeypatch):
    """attention_probs_dropout_prob > 0 in train mode: the rows attend dense per query chunk with dropout on
    the probabilities (the original's torch path); with the dropout itself made the identity that path is the
    eval output, and with it each seed draws its own masks, reproducibly, with gradients."""
    from poslsh.integrations.hf import dense
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", config_extra={"attention_probs_dropout_prob": 0.3,
                                                                 "hidden_dropout_prob": 0.0})
    model = load_alibi_encoder(d, dtype=torch.float64)
    ids, mask, tt = R.padded_batch([7, 300, 40], cfg["vocab_size"], seed=3)
    with torch.no_grad():
        evaluated = model(ids, mask, tt).last_hidden_state
    model.train()
    with monkeypatch.context() as m:
        m.setattr(dense.torch.nn.functional, "dropout", lambda w, p=0.5, training=True, inplace=False: w)
        with torch.no_grad():
            undropped = model(ids, mask, tt).last_hidden_state
    assert (undropped - evaluated).abs().max() <= 1e-12
    torch.manual_seed(4)
    with torch.enable_grad():                       # this file's fixture runs every test without autograd
        a = model(ids, mask, tt).last_hidden_state
        a.sum().backward()
    torch.manual_seed(4)
    with torch.no_grad():
        again = model(ids, mask, tt).last_hidden_state
    assert torch.equal(a.detach(), again) and (a.detach() - evaluated).abs().max() > 1e-3
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert torch.equal(a.detach()[~mask.bool()], torch.zeros_like(a.detach()[~mask.bool()]))


def test_a_tokenizers_batch_to_pooled_embeddings(tmp_path):
    """What a user does with the checkpoint's tokenizer.json (here a tiny one built in place)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "ac", "gt", "a", "c", "g", "t"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                                   special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")
    d, cfg, st = R.checkpoint(tmp_path, "mosaic", vocab=len(vocab))
    model = load_alibi_encoder(d, dtype=torch.float64)
    batch = tokenizer(["ac gt a", "g t t ac gt gt c a"], padding=True, return_tensors="pt")
    out = model(**batch)
    ref = R.reference("mosaic", cfg, st, batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    for how in ("mean", "cls"):
        got = pool_embeddings(out.last_hidden_state, batch["attention_mask"], how=how)
        want = pool_embeddings(ref["last_hidden_state"], batch["attention_mask"], how=how)
        assert got.shape == (2, 32) and float((got - want).abs().max()) <= 1e-10
