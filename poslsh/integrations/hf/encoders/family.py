"""Which ALiBi encoder a checkpoint holds, read from its ``config.json`` and its weight names, never
from ``model_type`` (MosaicBERT, DNABERT-2 and Jina-v2 all say ``"bert"``, as a plain BERT does).

Three layouts (the names of their weights decide; the config cross-checks):

* ``"mosaic"``: MosaicBERT and DNABERT-2 (``bert_layers.py``): a fused ``attention.self.Wqkv``
  (q, k, v thirds), ``mlp.gated_layers`` (first half gated through exact GELU), ``mlp.wo``,
  ``mlp.layernorm``; ``auto_map`` names ``bert_layers.*`` and the config has ``alibi_starting_size``.
* ``"jina"``: Jina-BERT-v2 (small/base-en): separate ``query`` / ``key`` / ``value`` and the same
  GLU block as MosaicBERT (``feed_forward_type`` ``"geglu"`` or ``"reglu"``).
* ``"jina-qk-norm"``: the qk-post-norm variant (base-code): ``layer_norm_q`` / ``layer_norm_k`` on
  the projected q and k, ``layer_norm_1`` / ``layer_norm_2`` around ``mlp.up_gated_layer`` (first
  half linear, second half gated) and ``mlp.down_layer``.

A plain BERT (learned positions), a RoPE encoder and anything else are refused in one line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["EncoderConfig", "recognise", "encoder_config", "split_prefix", "LAYOUTS"]

LAYOUTS = ("mosaic", "jina", "jina-qk-norm")
_ACTIVATIONS = ("gelu", "relu", "gelu_new", "gelu_pytorch_tanh")
# weights some checkpoints carry that no layout uses: buffers of older saves, and the Jina port's
# unconditional position table and BERT MLP (its layers build them and never call them)
_UNUSED = (re.compile(r"embeddings\.(position_ids|token_type_ids)$"),)
_JINA_UNUSED = (re.compile(r"embeddings\.position_embeddings\.weight$"),
                re.compile(r"encoder\.layer\.\d+\.(intermediate\.dense|output\.dense|output\.LayerNorm)\.(weight|bias)$"))


@dataclass
class EncoderConfig:
    """What the modules need, from ``config.json`` and the weights' shapes.

    ``head_norm_eps``: the MLM transform's LayerNorm eps (MosaicBERT hard-codes 1e-12; Jina uses
    ``layer_norm_eps``). ``glu_activation``: the GLU gate (``"gelu"``: exact erf GELU, or
    ``"relu"``). ``head_activation``: ``hidden_act`` of the MLM transform. ``attention_dropout``: the
    checkpoint's ``attention_probs_dropout_prob`` (in training, dropout on the probabilities: the
    rows then attend dense per query chunk, as the original's torch path). ``raw``: ``config.json`` as read (written back on save)."""

    layout: str
    hidden_size: int
    num_heads: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    type_vocab_size: int
    pad_token_id: Optional[int]
    layer_norm_eps: float
    head_norm_eps: float
    hidden_dropout: float
    attention_dropout: float
    classifier_dropout: float
    glu_activation: str
    head_activation: str
    num_labels: int = 0
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _ends(keys: Iterable[str], suffix: str) -> bool:
    return any(k.endswith(suffix) for k in keys)


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"{where}: {what}")


def recognise(config: dict, keys: Iterable[str], where: str = "checkpoint") -> str:
    """The layout (one of :data:`LAYOUTS`) of a checkpoint with this ``config.json`` and these weight
    names, or a one-line ``ValueError`` saying what it is and what to do."""
    keys = list(keys)
    rope = [k for k in config if "rope" in k.lower() or "rotary" in k.lower()]
    if rope or str(config.get("position_embedding_type", "")).lower() in ("rotary", "rope"):
        raise _refuse(where, f"a RoPE encoder (config.json: {(rope or ['position_embedding_type'])[0]}), not ALiBi; "
                      "load it with transformers")
    auto = " ".join(str(v) for v in (config.get("auto_map") or {}).values())
    names_mosaic = "bert_layers." in auto or "alibi_starting_size" in config
    names_jina = "jina" in auto.lower() or str(config.get("position_embedding_type", "")).lower() == "alibi"
    fused, gated = _ends(keys, "attention.self.Wqkv.weight"), _ends(keys, "mlp.gated_layers.weight")
    separate, up_gated = _ends(keys, "attention.self.query.weight"), _ends(keys, "mlp.up_gated_layer.weight")
    qk_norm = _ends(keys, "attention.self.layer_norm_q.weight")
    if fused and gated:
        layout = "mosaic"
    elif separate and gated and not qk_norm:
        layout = "jina"
    elif separate and up_gated and qk_norm:
        layout = "jina-qk-norm"
    elif separate and _ends(keys, "intermediate.dense.weight") and _ends(keys, "position_embeddings.weight"):
        raise _refuse(where, "a plain BERT (learned absolute positions, no ALiBi: no Wqkv or gated_layers weights); "
                      "load it with transformers.AutoModel")
    else:
        raise _refuse(where, "unknown layout: neither MosaicBERT/DNABERT-2 (attention.self.Wqkv + mlp.gated_layers) "
                      "nor Jina-BERT-v2 (query/key/value + mlp.gated_layers or up_gated_layer) weights")
    if layout == "mosaic" and names_jina and not names_mosaic:
        raise _refuse(where, "config.json names Jina-BERT code but the weights have the MosaicBERT layout (Wqkv)")
    if layout != "mosaic" and names_mosaic and not names_jina:
        raise _refuse(where, f"config.json names MosaicBERT code (auto_map bert_layers / alibi_starting_size) but "
                      f"the weights have the {layout} layout")
    if layout != "mosaic" and str(config.get("position_embedding_type", "alibi")).lower() != "alibi":
        raise _refuse(where, f"position_embedding_type {config.get('position_embedding_type')!r}: this Jina "
                      "checkpoint adds learned positions to ALiBi; only 'alibi' is supported")
    return layout


def split_prefix(keys: Iterable[str], where: str = "checkpoint") -> Tuple[str, str]:
    """``(prefix, head)`` of a state dict: the prefix of the encoder's weights (``""`` for a base
    model, ``"bert."`` in MosaicBERT's heads) and the head its other weights form (``"none"``,
    ``"mlm"``, ``"classification"``)."""
    keys = list(keys)
    found = [k for k in keys if k.endswith("embeddings.word_embeddings.weight")]
    if len(found) != 1:
        raise _refuse(where, f"expected one embeddings.word_embeddings.weight, found {len(found)}")
    prefix = found[0][: -len("embeddings.word_embeddings.weight")]
    own = tuple(prefix + part for part in ("embeddings.", "encoder.", "pooler."))
    rest = {k.split(".")[0] for k in keys if not k.startswith(own)}
    if rest == {"cls"}:
        return prefix, "mlm"
    if rest == {"classifier"}:
        return prefix, "classification"
    if rest:
        raise _refuse(where, f"weights outside the encoder that no head here takes: {sorted(rest)} "
                      "(heads: cls.predictions = masked LM, classifier = sequence classification)")
    return prefix, "none"


def unused_key(name: str, layout: str) -> bool:
    """A weight some checkpoints carry that this layout never uses (ignored on load)."""
    pats = _UNUSED + (_JINA_UNUSED if layout != "mosaic" else ())
    return any(p.search(name) for p in pats)


def _activation(name, what: str, where: str) -> str:
    name = str(name)
    if name not in _ACTIVATIONS:
        raise _refuse(where, f"{what} {name!r} is not supported (one of {list(_ACTIVATIONS)})")
    return name


def encoder_config(config: dict, layout: str, shapes: Dict[str, Tuple[int, ...]], prefix: str,
                   where: str = "checkpoint") -> EncoderConfig:
    """The :class:`EncoderConfig` of a recognised checkpoint: sizes from the weights' ``shapes``
    (by name, ``prefix`` stripped), checked against ``config.json``; the rest from the config with
    transformers' BertConfig defaults (MosaicBERT's configs leave them out)."""
    def shape(name: str) -> Tuple[int, ...]:
        return tuple(shapes[prefix + name])

    vocab, hidden = shape("embeddings.word_embeddings.weight")
    layers = sorted({int(m.group(1)) for k in shapes for m in [re.match(re.escape(prefix) + r"encoder\.layer\.(\d+)\.", k)]
                     if m})
    if not layers or layers != list(range(len(layers))):
        raise _refuse(where, f"encoder.layer.N weights expected for N = 0, 1, ...; found layers {layers[:8]}")
    gate = "mlp.gated_layers.weight" if layout != "jina-qk-norm" else "mlp.up_gated_layer.weight"
    inter = shape(f"encoder.layer.0.{gate}")[0] // 2
    heads = int(config.get("num_attention_heads", 12))
    for name, got in (("hidden_size", hidden), ("num_hidden_layers", len(layers)), ("intermediate_size", inter),
                      ("vocab_size", vocab)):
        if name in config and int(config[name]) != got:
            raise _refuse(where, f"config.json says {name} = {config[name]} but the weights have {got}")
    if heads < 1 or hidden % heads:
        raise _refuse(where, f"num_attention_heads = {heads} does not divide hidden_size = {hidden}")
    if layout == "mosaic":
        glu = "gelu"                                      # nn.GELU(approximate='none'), whatever hidden_act says
    else:
        kind = str(config.get("feed_forward_type", "geglu"))
        if kind not in ("geglu", "reglu"):
            raise _refuse(where, f"feed_forward_type {kind!r}: only the GLU blocks 'geglu' and 'reglu' are supported")
        glu = "gelu" if kind == "geglu" else "relu"
    eps = float(config.get("layer_norm_eps", 1e-12))
    hidden_dropout = float(config.get("hidden_dropout_prob", 0.1))
    cls_dropout = config.get("classifier_dropout")
    labels = shapes.get("classifier.weight", (0,))[0]
    return EncoderConfig(
        layout=layout, hidden_size=hidden, num_heads=heads, num_layers=len(layers), intermediate_size=inter,
        vocab_size=vocab, type_vocab_size=shape("embeddings.token_type_embeddings.weight")[0],
        pad_token_id=config.get("pad_token_id", 0), layer_norm_eps=eps,
        head_norm_eps=1e-12 if layout == "mosaic" else eps, hidden_dropout=hidden_dropout,
        attention_dropout=float(config.get("attention_probs_dropout_prob", 0.0 if layout == "mosaic" else 0.1)),
        classifier_dropout=hidden_dropout if cls_dropout is None else float(cls_dropout), glu_activation=glu,
        head_activation=_activation(config.get("hidden_act", "gelu"), "hidden_act", where), num_labels=labels,
        raw=dict(config))

