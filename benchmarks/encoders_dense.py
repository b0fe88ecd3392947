"""The ALiBi encoders' own torch path, written from their design (torch only, no poslsh): the
padded dense forward ``softmax(q k^T / sqrt(d) + bias) v`` with the dense ``[B, H, n, n]`` bias, and
random checkpoints in the original layout. The float64 oracle of tests/integrations/encoders and the
baseline of bench_encoders.py.

``"mosaic"`` (MosaicBERT, DNABERT-2; ``bert_layers.py`` without Triton): embeddings
``LN(word + token_type)``; the real tokens gathered to ``[nnz, H]`` before layer 0; per layer the
fused ``Wqkv`` re-padded with zeros to ``[B, n, 3H]`` and split ``(t h d)``, scores plus
``(1 - mask) * -10000`` plus the ALiBi table built in float32 (``torch.Tensor(slopes) * -|i - j|``,
upcast by the addition), softmax, the context of the real tokens, ``LN(dense + x)``, the GLU
``gelu(g[:, :I]) * g[:, I:]``, ``LN(wo + a)``; zeros at the padded positions after the last layer.
``"jina"`` / ``"jina-qk-norm"`` (Jina-BERT-v2 as transformers' port of the qk-post-norm code reads,
and the en layout as ports describe it): padded throughout, the mask ``(1 - mask) * finfo.min``,
``softmax(q k^T / sqrt(d) + mask + alibi)`` with the float32 table cast to the model dtype.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F

__all__ = ["original_slopes", "alibi_table", "dense_forward", "random_state", "write_checkpoint"]


def original_slopes(n: int):
    """The models' ``_get_alibi_head_slopes`` (Python floats)."""
    def power_of_2(k):
        start = 2 ** (-(2 ** -(math.log2(k) - 3)))
        return [start * start ** i for i in range(k)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + original_slopes(2 * c)[0::2][: n - c]


@functools.lru_cache(maxsize=1)
def alibi_table(heads: int, size: int) -> torch.Tensor:
    """``[1, H, size, size]`` float32: ``torch.Tensor(slopes) * -|i - j|``, as the models build it (and
    keep: the last one is cached, as the model keeps it until a longer input comes)."""
    pos = torch.arange(size)
    rel = (pos[None, :] - pos[:, None]).abs().view(1, size, size).expand(heads, -1, -1)
    return (torch.Tensor(original_slopes(heads)).unsqueeze(1).unsqueeze(1) * -rel).unsqueeze(0)


def _ln(x, state, name, eps):
    return F.layer_norm(x, x.shape[-1:], state[name + ".weight"], state[name + ".bias"], eps)


def _lin(x, state, name):
    return F.linear(x, state[name + ".weight"], state.get(name + ".bias"))


def _act(name):
    return {"gelu": F.gelu, "relu": F.relu}.get(name, lambda x: F.gelu(x, approximate="tanh"))


def dense_forward(layout: str, config: dict, state: Dict[str, torch.Tensor], input_ids: torch.Tensor,
                  attention_mask: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                  window=None):
    """The original forward in the state's dtype: ``{"last_hidden_state" [B, n, H], "pooler_output",
    "logits"}`` (None where the checkpoint has no pooler / head). Jina rows keep their computed padded
    positions, as the original returns them. ``window`` (tests only: an int or one per head): keys
    with ``|i - j| > window`` get no weight."""
    prefix = next(k for k in state if k.endswith("embeddings.word_embeddings.weight"))[: -len("embeddings.word_embeddings.weight")]
    s = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    B, n = input_ids.shape
    heads = int(config["num_attention_heads"])
    eps = float(config.get("layer_norm_eps", 1e-12))
    W = s["embeddings.word_embeddings.weight"]
    H, dtype = W.shape[1], W.dtype
    d = H // heads
    layers = len({k.split(".")[2] for k in s if k.startswith("encoder.layer.")})
    mask = torch.ones(B, n, dtype=torch.long) if attention_mask is None else attention_mask
    tt = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    x = _ln(W[input_ids] + s["embeddings.token_type_embeddings.weight"][tt], s, "embeddings.LayerNorm", eps)
    table = alibi_table(heads, max(n, int(config.get("alibi_starting_size", n))))[:, :, :n, :n]
    if window is not None:
        w = torch.as_tensor(window, dtype=torch.float32).reshape(-1, 1, 1)
        pos = torch.arange(n, dtype=torch.float32)
        table = table.masked_fill((pos[:, None] - pos[None]).abs() > w, float("-inf"))
    if layout == "mosaic":
        ext = (1.0 - mask[:, None, None, :].to(dtype)) * -10000.0
        bias = ext + table                                               # [B, H, n, n]
        idx = mask.reshape(-1).bool().nonzero().squeeze(1)
        h = x.reshape(B * n, H)[idx]
        I = s["encoder.layer.0.mlp.gated_layers.weight"].shape[0] // 2
        for i in range(layers):
            p = f"encoder.layer.{i}."
            qkv = _lin(h, s, p + "attention.self.Wqkv")
            qkv = qkv.new_zeros(B * n, 3 * H).index_copy(0, idx, qkv).view(B, n, 3, heads, d)
            q, k, v = qkv[:, :, 0].permute(0, 2, 1, 3), qkv[:, :, 1].permute(0, 2, 3, 1), qkv[:, :, 2].permute(0, 2, 1, 3)
            scores = torch.matmul(q, k) / math.sqrt(d)
            scores = scores + bias
            probs = torch.softmax(scores, dim=-1)
            ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(B * n, H)[idx]
            a = _ln(_lin(ctx, s, p + "attention.output.dense") + h, s, p + "attention.output.LayerNorm", eps)
            g = _lin(a, s, p + "mlp.gated_layers")
            h = _ln(_lin(F.gelu(g[:, :I]) * g[:, I:], s, p + "mlp.wo") + a, s, p + "mlp.layernorm", eps)
        hidden = h.new_zeros(B * n, H).index_copy(0, idx, h).view(B, n, H)
    else:
        ext = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        alibi = table.to(dtype)
        act = F.gelu if config.get("feed_forward_type", "geglu") == "geglu" else F.relu
        h = x
        for i in range(layers):
            p = f"encoder.layer.{i}."
            q, k, v = (_lin(h, s, p + "attention.self." + t) for t in ("query", "key", "value"))
            if layout == "jina-qk-norm":
                q, k = _ln(q, s, p + "attention.self.layer_norm_q", eps), _ln(k, s, p + "attention.self.layer_norm_k", eps)
            q, k, v = (t.view(B, n, heads, d).permute(0, 2, 1, 3) for t in (q, k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d) + ext
            ctx = torch.matmul(torch.softmax(scores + alibi, dim=-1), v).permute(0, 2, 1, 3).reshape(B, n, H)
            a = _ln(_lin(ctx, s, p + "attention.output.dense") + h, s, p + "attention.output.LayerNorm", eps)
            if layout == "jina":
                g = _lin(a, s, p + "mlp.gated_layers")
                I = g.shape[-1] // 2
                h = _ln(_lin(act(g[..., :I]) * g[..., I:], s, p + "mlp.wo") + a, s, p + "mlp.layernorm", eps)
            else:
                r = _ln(h + a, s, p + "layer_norm_1", eps)
                u = _lin(r, s, p + "mlp.up_gated_layer")
                I = u.shape[-1] // 2
                h = _ln(r + _lin(u[..., :I] * act(u[..., I:]), s, p + "mlp.down_layer"), s, p + "layer_norm_2", eps)
        hidden = h
    out = {"last_hidden_state": hidden, "pooler_output": None, "logits": None}
    if "pooler.dense.weight" in s:
        out["pooler_output"] = torch.tanh(_lin(hidden[:, 0], s, "pooler.dense"))
    if "classifier.weight" in s:
        out["logits"] = _lin(out["pooler_output"], s, "classifier")
    if "cls.predictions.transform.dense.weight" in s:
        t = _act(config.get("hidden_act", "gelu"))(_lin(hidden, s, "cls.predictions.transform.dense"))
        t = _ln(t, s, "cls.predictions.transform.LayerNorm", 1e-12 if layout == "mosaic" else eps)
        bias = s.get("cls.predictions.decoder.bias", s.get("cls.predictions.bias"))
        out["logits"] = F.linear(t, s.get("cls.predictions.decoder.weight", W), bias)
    return out


def random_state(layout: str, *, hidden: int, heads: int, layers: int, intermediate: int, vocab: int,
                 head: str = "none", pooler: bool = False, labels: int = 3, seed: int = 0,
                 bert_init: bool = False) -> Dict[str, torch.Tensor]:
    """A random float32 state dict in the original layout (names and shapes of the facts sheet):
    ``head`` ``"none"`` (base model keys, ``pooler.*`` with ``pooler``), ``"mlm"`` (``bert.`` + ``cls.*``,
    the decoder weight the word embeddings' values) or ``"classification"`` (``bert.`` with its pooler,
    ``classifier.*``). For tests, LayerNorms get random gains and biases too and the projections larger
    scales, so every parameter and the positions matter; ``bert_init``: BERT's initialisation instead
    (every matrix N(0, 0.02), LayerNorms 1 and 0: what a benchmark of speed needs)."""
    g = torch.Generator().manual_seed(seed)
    H, I = hidden, intermediate

    def rnd(*shape, scale=0.02):
        return torch.randn(*shape, generator=g) * (0.02 if bert_init else scale)

    def norm(name):
        if bert_init:
            return {name + ".weight": torch.ones(H), name + ".bias": torch.zeros(H)}
        return {name + ".weight": 1 + rnd(H, scale=0.1), name + ".bias": rnd(H, scale=0.1)}

    s = {"embeddings.word_embeddings.weight": rnd(vocab, H, scale=1.0),
         "embeddings.token_type_embeddings.weight": rnd(2, H, scale=1.0), **norm("embeddings.LayerNorm")}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        if layout == "mosaic":
            s.update({p + "attention.self.Wqkv.weight": rnd(3 * H, H, scale=0.3), p + "attention.self.Wqkv.bias": rnd(3 * H)})
        else:
            for t in ("query", "key", "value"):
                s.update({p + f"attention.self.{t}.weight": rnd(H, H, scale=0.3), p + f"attention.self.{t}.bias": rnd(H)})
        if layout == "jina-qk-norm":
            s.update({**norm(p + "attention.self.layer_norm_q"), **norm(p + "attention.self.layer_norm_k")})
        s.update({p + "attention.output.dense.weight": rnd(H, H, scale=0.2), p + "attention.output.dense.bias": rnd(H),
                  **norm(p + "attention.output.LayerNorm")})
        if layout == "jina-qk-norm":
            s.update({**norm(p + "layer_norm_1"), **norm(p + "layer_norm_2"),
                      p + "mlp.up_gated_layer.weight": rnd(2 * I, H, scale=0.2),
                      p + "mlp.down_layer.weight": rnd(H, I, scale=0.2), p + "mlp.down_layer.bias": rnd(H)})
        else:
            s.update({p + "mlp.gated_layers.weight": rnd(2 * I, H, scale=0.2), p + "mlp.wo.weight": rnd(H, I, scale=0.2),
                      p + "mlp.wo.bias": rnd(H), **norm(p + "mlp.layernorm")})
    if pooler or head == "classification":
        s.update({"pooler.dense.weight": rnd(H, H, scale=0.2), "pooler.dense.bias": rnd(H)})
    if head == "none":
        return s
    s = {"bert." + k: v for k, v in s.items()}
    if head == "mlm":
        s.update({"cls.predictions.transform.dense.weight": rnd(H, H, scale=0.2),
                  "cls.predictions.transform.dense.bias": rnd(H), **norm("cls.predictions.transform.LayerNorm"),
                  "cls.predictions.decoder.weight": s["bert.embeddings.word_embeddings.weight"],
                  "cls.predictions.decoder.bias": rnd(vocab)})
    else:
        s.update({"classifier.weight": rnd(labels, H, scale=0.2), "classifier.bias": rnd(labels)})
    return s


def write_checkpoint(directory, config: dict, state: Dict[str, torch.Tensor], *, safetensors: bool = True,
                     tied_key: bool = True) -> Path:
    """``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``) as the original code writes
    them; ``tied_key=False`` leaves ``cls.predictions.decoder.weight`` out (safetensors conversions)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    state = dict(state)
    if not tied_key:
        state.pop("cls.predictions.decoder.weight", None)
    if safetensors:                                   # safetensors stores no shared tensors: a copy
        from safetensors.torch import save_file
        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(state, directory / "pytorch_model.bin")
    return directory
