"""The encoders' modules, named as the original checkpoints name their weights (so a state dict
loads as it is and saves back in the original layout). Every layer works on the unpadded tokens
``[nnz, hidden]``; attention goes through :class:`~.attention.EncoderAlibi`.

One layer, MosaicBERT / DNABERT-2 and Jina-v2 (post-LN, BERT order)::

    a = LN_attn(dropout(dense(attention(x))) + x)
    g = gated_layers(a);  y = act(g[:, :I]) * g[:, I:]          # first half gated
    out = LN_mlp(wo(dropout(y)) + a)

Jina's qk-post-norm variant: ``q = LN_q(query(x))``, ``k = LN_k(key(x))`` before the head split,
``r = layer_norm_1(x + a)``, ``u = up_gated_layer(r)``, ``y = u[:, :I] * act(u[:, I:])`` (second half
gated), ``out = layer_norm_2(r + down_layer(dropout(y)))``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import EncoderAlibi
from .family import EncoderConfig
from .tokens import Tokens

__all__ = ["Embeddings", "EncoderLayer", "Encoder", "Pooler", "activation", "FEED_FORWARD_ROWS"]

# Tokens per block of the feed-forward at inference. Its ``[nnz, 2I]`` intermediate is the largest tensor a
# layer makes (float32, DNABERT-2: 24 KiB a token, 0.8 GB at 32k tokens); a block of 1024 is 25 MB, and a
# product of 1024 rows runs at the full-size product's rate.
FEED_FORWARD_ROWS = 1024


def activation(name: str):
    """``hidden_act`` as transformers' ACT2FN reads it: ``"gelu"`` is the exact erf GELU."""
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return functools.partial(F.gelu, approximate="tanh")
    return F.relu


class Embeddings(nn.Module):
    """``LN(word[ids] + token_type[tt])`` and dropout; no position embedding (ALiBi)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """``[nnz]`` ids and token types -> ``[nnz, hidden]``."""
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    """q, k, v projections (MosaicBERT's fused ``Wqkv``: q, k, v thirds, heads contiguous in each;
    or Jina's ``query`` / ``key`` / ``value``, with ``layer_norm_q`` / ``layer_norm_k`` in the
    qk-post-norm variant) and the layer's :class:`EncoderAlibi` (``alibi``, a plain attribute)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        H = cfg.hidden_size
        self.num_heads, self.head_dim, self.layout = cfg.num_heads, cfg.head_dim, cfg.layout
        self.config = cfg                   # its attention_dropout is read at each call (a user may change it)
        if cfg.layout == "mosaic":
            self.Wqkv = nn.Linear(H, 3 * H)
        else:
            self.query, self.key, self.value = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        if cfg.layout == "jina-qk-norm":
            self.layer_norm_q = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
            self.layer_norm_k = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.alibi = EncoderAlibi.build(cfg.num_heads, cfg.head_dim)

    def forward(self, x: Tensor, tokens: Tokens) -> Tensor:
        """``[nnz, hidden]`` -> the attention context ``[nnz, hidden]`` (heads concatenated)."""
        nnz, heads = x.shape[0], (self.num_heads, self.head_dim)
        if self.layout == "mosaic":
            q, k, v = self.Wqkv(x).view(nnz, 3, *heads).unbind(1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
            if self.layout == "jina-qk-norm":
                q, k = self.layer_norm_q(q), self.layer_norm_k(k)
            q, k, v = (t.view(nnz, *heads) for t in (q, k, v))
        p = float(self.config.attention_dropout) if self.training else 0.0
        return self.alibi.attend(q, k, v, tokens, dropout=p).reshape(nnz, -1)


class SelfOutput(nn.Module):
    """``LN(dropout(dense(context)) + x)``."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, context: Tensor, x: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(context)) + x)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = SelfOutput(cfg)

    def forward(self, x: Tensor, tokens: Tokens) -> Tensor:
        return self.output(self.self(x, tokens), x)


class GatedMLP(nn.Module):
    """MosaicBERT / Jina-v2's GLU with its residual and LayerNorm: ``gated_layers [2I, H]`` (no bias),
    the first ``I`` columns through the activation times the last ``I``, dropout, ``wo``,
    ``layernorm(wo(.) + x)``."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gated_layers = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.act = activation(cfg.glu_activation)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        g = self.gated_layers(x)
        y = self.act(g[:, :self.intermediate]) * g[:, self.intermediate:]
        return self.layernorm(self.wo(self.dropout(y)) + x)


class UpGatedMLP(nn.Module):
    """Jina qk-post-norm's GLU (no residual inside): ``up_gated_layer [2I, H]`` (no bias), the first
    ``I`` columns linear times the activation of the last ``I``, dropout, ``down_layer``."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.up_gated_layer = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.act = activation(cfg.glu_activation)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.down_layer = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        u = self.up_gated_layer(x)
        return self.down_layer(self.dropout(u[:, :self.intermediate] * self.act(u[:, self.intermediate:])))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.qk_norm = cfg.layout == "jina-qk-norm"
        self.attention = Attention(cfg)
        if self.qk_norm:
            self.layer_norm_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
            self.mlp = UpGatedMLP(cfg)
            self.layer_norm_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        else:
            self.mlp = GatedMLP(cfg)

    def forward(self, x: Tensor, tokens: Tokens) -> Tensor:
        """``[nnz, hidden]`` -> ``[nnz, hidden]``."""
        a = self.attention(x, tokens)
        if not self.qk_norm:
            return self._by_rows(self.mlp, a)
        r = self.layer_norm_1(x + a)
        return self._by_rows(lambda rows: self.layer_norm_2(rows + self.mlp(rows)), r)

    def _by_rows(self, feed_forward, x: Tensor) -> Tensor:
        """``feed_forward(x)`` (row by row, token-wise), in blocks of :data:`FEED_FORWARD_ROWS` tokens when
        nothing is kept for a backward and no dropout draws (eval under ``no_grad``): each block's intermediate
        is freed before the next. With autograd the blocks' intermediates would all be kept anyway, and a
        compiled graph plans its own buffers, so there the whole runs at once."""
        n = x.shape[0]
        if n <= FEED_FORWARD_ROWS or self.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return feed_forward(x)
        out = torch.empty_like(x)
        for i in range(0, n, FEED_FORWARD_ROWS):
            out[i:i + FEED_FORWARD_ROWS] = feed_forward(x[i:i + FEED_FORWARD_ROWS])
        return out


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: Tensor, tokens: Tokens) -> Tensor:
        for layer in self.layer:
            x = layer(x, tokens)
        return x


class Pooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h[:, 0]))`` (the first position of each padded row)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))
