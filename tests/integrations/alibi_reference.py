"""A float64 reference of transformers' BLOOM, MPT and Falcon (alibi=True): each model's own attention
modules and its own bias, with the softmax in float64 (transformers runs it in float32 even in a
float64 model), every query row computed (a masked query attends to the unmasked keys, as in the
model), a query with no unmasked key weighing every key equally (what the float32 model's softmax of a
row at the dtype's minimum gives; float64 BLOOM and MPT give NaN there), and Falcon's bias product
``m_h * p`` in float64 (transformers rounds it to bfloat16; ``falcon_bias="bfloat16"`` keeps that).
Falcon is the sdpa path's arithmetic (the bias added once; the explicit eager path of old releases adds
it twice); its fused projection is split as the checkpoint lays it out.

``positional(layer) -> Positional`` replaces the ALiBi bias by that object's dense bias (windows,
positional LSH) at positions counted from each row's first real token: the oracle of the other modes.
"""
from __future__ import annotations

import copy
import math
from types import MethodType

import torch
import torch.nn.functional as F


def _softmax64(scores, allowed):
    allowed = allowed.expand(scores.shape)
    s = scores.to(torch.float64).masked_fill(~allowed, float("-inf"))
    none = ~allowed.any(-1, keepdim=True)                    # no key: every key weighs the same
    return torch.where(none, 1.0 / scores.shape[-1], torch.softmax(s.masked_fill(none, 0.0), -1))


def _positions(state, B, kv, rule="cumsum"):
    """Per row the position of each of the kv tokens: the mask's cumulative sum minus 1 (BLOOM, Falcon: a
    masked token sits on the last real one before it) or the index from the first real token (MPT)."""
    mask = state.get("mask")
    if mask is None:
        return torch.arange(kv).expand(B, kv)
    mask = mask[:, :kv].to(torch.int64)
    if rule == "cumsum":
        return mask.cumsum(-1) - 1
    return torch.arange(kv)[None] - mask.argmax(-1, keepdim=True)


def _bias(self, state, B, H, nq, kv, model_bias, rule="cumsum"):
    """[B, H, nq, kv] float64: the model's bias, or the positional object's dense bias."""
    positional = state["positional"]
    if positional is None:
        return model_bias
    pos = _positions(state, B, kv, rule)
    rows = []
    for b in range(B):
        p = pos[b]
        rows.append(positional(self.layer_idx).dense_bias(p[kv - nq:], p))
    return torch.stack(rows)


def _allowed(attention_mask, B, nq, kv, masked_is_true=False):
    if attention_mask is None:
        i = torch.arange(kv - nq, kv)[:, None]
        return (torch.arange(kv)[None] <= i)[None, None].expand(B, 1, nq, kv)
    if attention_mask.dtype == torch.bool:
        return ~attention_mask if masked_is_true else attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def _bloom(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
           output_attentions=False, **kwargs):
    from transformers.models.bloom.modeling_bloom import dropout_add
    state = self._ref_state
    B, nq, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    kv = k.shape[2]
    H = self.num_heads
    if state["bias64"]:          # the product m_h p in float64 (transformers: in float32)
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
        m = _get_alibi_slopes(H, torch.device("cpu")).to(torch.float64)
        own = m[None, :, None, None] * _positions(state, B, kv).clamp_min(0)[:, None, None, :].to(torch.float64)
    else:
        own = alibi.view(B, H, 1, kv).to(torch.float64)
    bias = _bias(self, state, B, H, nq, kv, self.beta * own)
    scores = self.inv_norm_factor * (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2)) + bias
    probs = _softmax64(scores, _allowed(attention_mask, B, nq, kv)).to(q.dtype)
    if state["dropout"]:
        probs = self.attention_dropout(probs)
    ctx = (probs @ v).transpose(1, 2).reshape(B, nq, H * self.head_dim)
    return dropout_add(self.dense(ctx), residual, self.hidden_dropout, self.training), None


def _mpt(self, hidden_states, position_bias=None, cache=None, attention_mask=None, **kwargs):
    state = self._ref_state
    B, nq = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, nq, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    kv = k.shape[2]
    model_bias = position_bias[:, -1:, -kv:].to(torch.float64)[None] if state["positional"] is None else None
    bias = _bias(self, state, B, self.n_heads, nq, kv, model_bias, rule="index")
    scores = (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2)) * self.softmax_scale + bias
    probs = _softmax64(scores, _allowed(attention_mask, B, nq, kv, masked_is_true=True)).to(q.dtype)
    if state["dropout"]:
        probs = F.dropout(probs, p=self.attn_dropout_p, training=self.training)
    return self.out_proj((probs @ v).transpose(1, 2).reshape(B, nq, -1)), None


def _falcon_qkv(self, hidden_states):
    cfg, d = self.config, self.head_dim
    H = cfg.num_attention_heads
    Hkv = cfg.num_kv_heads if cfg.new_decoder_architecture else 1 if cfg.multi_query else H
    B, n = hidden_states.shape[:2]
    fused = self.query_key_value(hidden_states)
    if cfg.new_decoder_architecture:
        g = fused.view(B, n, Hkv, H // Hkv + 2, d)
        q, k, v = g[..., :-2, :].flatten(2, 3), g[..., -2, :], g[..., -1, :]
    elif cfg.multi_query:
        q, k, v = fused.view(B, n, H + 2, d).split([H, 1, 1], dim=2)
    else:
        q, k, v = fused.view(B, n, H, 3, d).unbind(3)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _falcon(self, hidden_states, attention_mask=None, *args, layer_past=None, **kwargs):
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor
    state = self._ref_state
    q, k, v = _falcon_qkv(self, hidden_states)
    B, nq = hidden_states.shape[:2]
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    kv = k.shape[2]
    k, v = (t.repeat_interleave(self.num_heads // t.shape[1], dim=1) for t in (k, v))
    root = math.sqrt(self.head_dim)
    if state["falcon_bias"] == "bfloat16":        # transformers' own tensor: bf16(bf16(m) p)
        mask2d = state.get("mask")
        mask2d = torch.ones(B, kv, dtype=torch.long) if mask2d is None else mask2d[:, :kv]
        alibi = build_alibi_tensor(mask2d, self.num_heads, dtype=torch.float32)
        model_bias = alibi.view(B, self.num_heads, 1, kv).to(torch.float64) / root
    else:                                          # the product in float64
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
        m = _get_alibi_slopes(self.num_heads, torch.device("cpu")).to(torch.float64)
        pos = _positions(state, B, kv).clamp_min(0)
        model_bias = (m[None, :, None, None] * pos[:, None, None, :].to(torch.float64)) / root
    bias = _bias(self, state, B, self.num_heads, nq, kv, model_bias)
    scores = (q.to(torch.float64) @ k.to(torch.float64).transpose(-1, -2)) / root + bias
    probs = _softmax64(scores, _allowed(attention_mask, B, nq, kv)).to(q.dtype)
    return self.dense((probs @ v).transpose(1, 2).reshape(B, nq, self.num_heads * self.head_dim)), None


FORWARDS = {"BloomAttention": _bloom, "MptAttention": _mpt, "FalconAttention": _falcon}


def reference_model(model, *, falcon_bias="exact", positional=None, bias64=False, dropout=False):
    """A deep copy of the *untouched* ``model`` computing the float64 reference (see the module);
    ``bias64``: BLOOM's product ``m_h p`` in float64 too (transformers forms it in float32); ``dropout``:
    BLOOM's and MPT's dropout on the probabilities in training (Falcon's is inside sdpa)."""
    ref = copy.deepcopy(model)
    state = {"mask": None, "positional": positional, "falcon_bias": falcon_bias, "bias64": bias64,
             "dropout": dropout}
    # eager masks, materialised (Falcon: its sdpa branch builds the 4-D mask we read the allowed keys from)
    ref.config._attn_implementation = "sdpa" if ref.config.model_type == "falcon" else "eager"
    for m in ref.modules():
        name = type(m).__name__
        if name in FORWARDS:
            m._ref_state = state
            m.forward = MethodType(FORWARDS[name], m)
        if name in ("BloomModel", "MptModel", "FalconModel"):
            def hook(module, args, kwargs):
                state["mask"] = kwargs.get("attention_mask")
            m.register_forward_pre_hook(hook, with_kwargs=True)
    return ref


# ------------------------------------------------------------------ tiny random-init models of each family
def tiny_config(name: str, **overrides):
    """Tiny configs of the real classes: ``bloom4``, ``bloom6``, ``bloom12``, ``mpt``, ``mpt_scaled``
    (softmax_scale and clip_qkv), ``falcon``, ``falcon_mq`` (multi-query), ``falcon_gqa`` (the new
    decoder architecture, 2 key/value heads)."""
    from transformers import BloomConfig, FalconConfig, MptConfig
    if name.startswith("bloom"):
        H = int(name[5:])
        cfg = dict(vocab_size=61, hidden_size=4 * H, n_layer=2, n_head=H)
        return BloomConfig(**{**cfg, **overrides})
    if name.startswith("mpt"):
        cfg = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
        if name == "mpt_scaled":
            cfg.update(d_model=48, n_heads=6, attn_config=dict(softmax_scale=0.31, clip_qkv=0.8))
        return MptConfig(**{**cfg, **overrides})
    cfg = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
               new_decoder_architecture=name == "falcon_gqa", multi_query=name == "falcon_mq", bias=True)
    if name == "falcon_gqa":
        cfg["num_kv_heads"] = 2
    return FalconConfig(**{**cfg, **overrides})


PREFIX = {"bloom": "Bloom", "mpt": "Mpt", "falcon": "Falcon"}
NAMES = ["bloom4", "bloom6", "bloom12", "mpt", "mpt_scaled", "falcon", "falcon_mq", "falcon_gqa"]


def tiny_model(name: str, head: str = "ForCausalLM", seed: int = 0, dtype=torch.float64, **overrides):
    import transformers
    cfg = tiny_config(name, **overrides)
    torch.manual_seed(seed)
    cls = getattr(transformers, PREFIX[cfg.model_type] + head)
    model = cls(cfg).eval().to(dtype)
    with torch.no_grad():            # larger weights than the init: logits that move (a test that could fail)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def left_padded_batch(n: int, pads, seed: int = 1, *, low: int = 0, vocab: int = 61):
    """Token ids ``[len(pads), n]`` in ``[low, vocab)`` and the attention mask with ``pads[b]`` leading
    zeros in row ``b`` (left padding)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(low, vocab, (len(pads), n), generator=g)
    mask = torch.ones(len(pads), n, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    return x, mask


def real_tokens(t, mask):
    """The entries of ``t [B, n, ...]`` at real (unpadded) tokens."""
    return t[mask.bool()]
