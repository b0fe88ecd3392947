"""The encoder and its heads: ``forward(input_ids, attention_mask=None, token_type_ids=None)``
returns an :class:`EncoderOutput` (``last_hidden_state [B, n, hidden]``, zero at padded positions;
``pooler_output [B, hidden]`` where the checkpoint has a pooler; ``logits`` for a head).

Module and weight names are the original checkpoints' (``embeddings.*``, ``encoder.layer.N.*``,
``pooler.*``; the heads put the encoder under ``bert.`` beside ``cls.predictions.*`` or
``classifier.*``), so ``state_dict()`` is in the original layout and :meth:`save_pretrained` writes
a directory the original code (and :func:`~.load.load_alibi_encoder`) reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from .attention import EncoderAlibi
from .family import EncoderConfig
from .layers import Embeddings, Encoder, Pooler, activation
from .tokens import repad, unpad

__all__ = ["EncoderOutput", "AlibiEncoderModel", "AlibiEncoderForMaskedLM", "AlibiEncoderForSequenceClassification"]


@dataclass
class EncoderOutput:
    """``last_hidden_state [B, n, hidden]`` (0 at padded positions), ``pooler_output [B, hidden]`` or
    None, ``logits`` (``[B, n, vocab]`` masked LM, ``[B, labels]`` classification) or None."""

    last_hidden_state: Tensor
    pooler_output: Optional[Tensor] = None
    logits: Optional[Tensor] = None


class _Saving(nn.Module):
    """What every model here shares: the config, the attention mode, saving."""

    config: EncoderConfig

    def set_attention(self, *, window=None, tol=None, backend: str = "auto") -> None:
        """Every layer's attention: exact ALiBi (``window=None``), fixed windows (an int or ``[H]``), or
        ``window="certified"`` with ``tol`` (per call the smallest windows whose dropped softmax mass
        per query is ``<= tol``); ``backend`` of the window op."""
        cfg = self.config
        for layer in self._base().encoder.layer:
            layer.attention.self.alibi = EncoderAlibi.build(cfg.num_heads, cfg.head_dim, window=window, tol=tol,
                                                            backend=backend)

    def attention_stats(self) -> list:
        """Per layer the mode and the windows of the last forward (certified: the logit-range bounds)."""
        return [{"layer": i, "mode": layer.attention.self.alibi.mode, **layer.attention.self.alibi.last}
                for i, layer in enumerate(self._base().encoder.layer)]

    def _base(self) -> "AlibiEncoderModel":
        return self if isinstance(self, AlibiEncoderModel) else self.bert

    def save_pretrained(self, path, *, safe_serialization: bool = True) -> Path:
        """Write ``config.json`` (the checkpoint's own, as read) and the weights in the original layout:
        ``model.safetensors`` (the tied decoder weight left out: safetensors stores no shared tensors)
        or, with ``safe_serialization=False``, ``pytorch_model.bin`` with both keys, as the Hub's are."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.raw, indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if safe_serialization:
            from safetensors.torch import save_file
            state.pop("cls.predictions.decoder.weight", None)
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(state, path / "pytorch_model.bin")
        return path

class AlibiEncoderModel(_Saving):
    """The base encoder (``embeddings``, ``encoder``, ``pooler`` where the checkpoint has one)."""

    def __init__(self, cfg: EncoderConfig, pooler: bool = False):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg) if pooler else None

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None) -> EncoderOutput:
        """``input_ids [B, n]``; ``attention_mask [B, n]`` (1 = real token, each row's ones contiguous;
        default all ones); ``token_type_ids [B, n]`` (default zeros)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: [batch, seq_len] expected, got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} differs from input_ids' "
                             f"{tuple(input_ids.shape)}")
        tokens = unpad(attention_mask)
        ids = input_ids.reshape(-1).index_select(0, tokens.indices)
        tt = (torch.zeros_like(ids) if token_type_ids is None
              else token_type_ids.reshape(-1).index_select(0, tokens.indices))
        x = self.encoder(self.embeddings(ids, tt), tokens)
        hidden = repad(x, tokens)
        return EncoderOutput(hidden, self.pooler(hidden) if self.pooler is not None else None)


class _Transform(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.head_norm_eps)
        self.act = activation(cfg.head_activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class _Predictions(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.transform = _Transform(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)


class _Cls(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.predictions = _Predictions(cfg)


class AlibiEncoderForMaskedLM(_Saving):
    """``bert`` and the MLM head ``cls.predictions``: ``decoder(LN(act(dense(h))))``, the decoder's
    weight the word embeddings' (one Parameter). ``logits [B, n, vocab]`` (padded positions included:
    the head of a zero state, as the original computes them)."""

    def __init__(self, cfg: EncoderConfig, pooler: bool = False):
        super().__init__()
        self.config = cfg
        self.bert = AlibiEncoderModel(cfg, pooler)
        self.cls = _Cls(cfg)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None) -> EncoderOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        p = self.cls.predictions
        out.logits = p.decoder(p.transform(out.last_hidden_state))
        return out


class AlibiEncoderForSequenceClassification(_Saving):
    """``bert`` (with its pooler), dropout, ``classifier``: ``logits [B, labels]`` from the pooled first
    position."""

    def __init__(self, cfg: EncoderConfig, pooler: bool = True):
        super().__init__()
        self.config = cfg
        self.bert = AlibiEncoderModel(cfg, pooler=True)
        self.dropout = nn.Dropout(cfg.classifier_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None) -> EncoderOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids)
        out.logits = self.classifier(self.dropout(out.pooler_output))
        return out
