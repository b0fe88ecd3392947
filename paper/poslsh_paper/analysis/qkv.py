"""Capture a pretrained model's own queries, keys and values, per layer and head.

Forward hooks on ``self_attn.q_proj / k_proj / v_proj`` of the chosen decoder
layers record the projections of one input sequence:

* ``rope="pre"`` (default): the vectors that enter the rotary embedding, i.e. the
  projections (after ``q_norm`` / ``k_norm`` for models that have them, such as
  Qwen3). This is what an ALiBi model would attend with: in the convergence
  experiment ALiBi replaces the positional encoding.
* ``rope="post"``: the same vectors after the model's own rotary embedding
  (``model.model.rotary_emb`` and its module's ``apply_rotary_pos_emb``): what the
  model really attends with.

Shapes: ``q [Hq, n, d]``, ``k / v [Hkv, n, d]``. Under grouped-query attention
query head ``h`` uses key/value head ``h // (Hq / Hkv)`` (:meth:`LayerQKV.kv_head`).
The forward pass stops right after the last requested layer's projections, so
asking for early layers costs only those layers.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["LayerQKV", "Segment", "capture_qkv", "decoder_layers", "attention_geometry", "corpus_segments",
           "random_segments", "RealQKV", "real_qkv_or_none"]

ROPE_CHOICES = ("pre", "post")


@dataclass
class LayerQKV:
    """Queries, keys and values of one layer for one input (float32, CPU)."""

    layer: int
    q: Tensor   # [Hq, n, d]
    k: Tensor   # [Hkv, n, d]
    v: Tensor   # [Hkv, n, dv]
    rope: str = "pre"

    @property
    def q_heads(self) -> int:
        return self.q.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    def kv_head(self, h: int) -> int:
        """Key/value head used by query head ``h`` (GQA): ``h // (Hq / Hkv)``."""
        if not 0 <= h < self.q_heads:
            raise IndexError(f"query head {h} out of range [0, {self.q_heads})")
        return h // self.group

    def head(self, h: int):
        """``(q_h, k_h, v_h)`` of query head ``h``, each ``[n, d]``."""
        g = self.kv_head(h)
        return self.q[h], self.k[g], self.v[g]


class _StopForward(Exception):
    pass


def decoder_layers(model):
    """The list of decoder layers of a Llama-like causal LM."""
    for path in ("model.layers", "model.model.layers", "layers", "transformer.h"):
        obj = model
        try:
            for name in path.split("."):
                obj = getattr(obj, name)
        except AttributeError:
            continue
        if len(obj) and all(hasattr(getattr(layer, "self_attn", None), p) for layer in obj[:1]
                            for p in ("q_proj", "k_proj", "v_proj")):
            return obj
    raise ValueError(f"{type(model).__name__}: no Llama-style decoder layers with self_attn.q_proj/k_proj/v_proj")


def attention_geometry(model):
    """``(Hq, Hkv, head_dim)`` from the model config."""
    cfg = model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    return int(hq), int(hkv), int(d)


def _rotary(model):
    for path in ("model.rotary_emb", "rotary_emb", "model.model.rotary_emb"):
        obj = model
        try:
            for name in path.split("."):
                obj = getattr(obj, name)
            return obj
        except AttributeError:
            continue
    raise ValueError(f"{type(model).__name__} has no rotary embedding module: use rope='pre'")


@torch.no_grad()
def capture_qkv(model, input_ids: Tensor, layers: Iterable[int], *, rope: str = "pre") -> Dict[int, LayerQKV]:
    """Run ``model`` on one sequence and return ``{layer: LayerQKV}``.

    Args:
        model: a Hugging Face Llama-like causal LM (``model.model.layers[i].self_attn``
            with ``q_proj``, ``k_proj``, ``v_proj``).
        input_ids: ``[n]`` or ``[1, n]`` token ids.
        layers: decoder layer indices (0-based).
        rope: ``"pre"`` (projections, before the rotary embedding) or ``"post"``.
    """
    if rope not in ROPE_CHOICES:
        raise ValueError(f"rope must be one of {ROPE_CHOICES}, got {rope!r}")
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ValueError(f"capture_qkv takes one sequence, got input_ids of shape {tuple(input_ids.shape)}")
    blocks = decoder_layers(model)
    layers = sorted({int(i) for i in layers})
    if not layers:
        raise ValueError("no layers requested")
    for i in layers:
        if not 0 <= i < len(blocks):
            raise ValueError(f"layer {i} out of range: the model has {len(blocks)} layers")
    hq, hkv, d = attention_geometry(model)
    heads = {"q": hq, "k": hkv, "v": hkv}
    store: Dict[int, Dict[str, Tensor]] = {i: {} for i in layers}
    last = layers[-1]

    def make_hook(i, name):
        attn = blocks[i].self_attn
        norm = getattr(attn, f"{name}_norm", None) if name in ("q", "k") else None

        def hook(mod, inp, out):
            x = out.detach().reshape(1, ids.shape[1], heads[name], -1)   # [1, n, H, d]
            if norm is not None:
                x = norm(x)
            store[i][name] = x.transpose(1, 2)                         # [1, H, n, d]
            if i == last and len(store[i]) == 3:
                raise _StopForward
        return hook

    handles = []
    try:
        for i in layers:
            attn = blocks[i].self_attn
            for name in ("q", "k", "v"):
                handles.append(getattr(attn, f"{name}_proj").register_forward_hook(make_hook(i, name)))
        try:
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
        except _StopForward:
            pass
    finally:
        for h in handles:
            h.remove()

    out: Dict[int, LayerQKV] = {}
    n = ids.shape[1]
    for i in layers:
        q, k, v = store[i]["q"], store[i]["k"], store[i]["v"]
        if rope == "post":
            q, k = _apply_model_rope(model, blocks[i].self_attn, q, k, n)
        out[i] = LayerQKV(i, q[0].float().cpu().contiguous(), k[0].float().cpu().contiguous(),
                          v[0].float().cpu().contiguous(), rope)
    return out


def _apply_model_rope(model, attn, q: Tensor, k: Tensor, n: int):
    """The model's own rotary embedding, as its attention module applies it."""
    module = sys.modules[type(attn).__module__]
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb: use rope='pre'")
    pos = torch.arange(n, device=q.device)[None]
    cos, sin = _rotary(model)(q, pos)
    return apply(q, k, cos, sin)


# ------------------------------------------------------------------ inputs
@dataclass
class Segment:
    """One input sequence: ``n`` token ids cut from a document."""

    ids: Tensor                # [n] int64
    source: str                # "corpus:document" (or "random:<seed>")
    start: int = 0             # token offset of the segment in its document


def corpus_segments(tokenizer, num: int, n: int, *, seed: int = 0,
                    corpora: Sequence[str] = ("linux-doc", "python-doc")) -> List[Segment]:
    """``num`` segments of exactly ``n`` tokens, each the first ``n`` tokens of a
    different whole document that is at least ``n`` tokens long.

    Documents of the given corpora (see :mod:`poslsh_paper.data.corpus`) are visited in
    an order shuffled with ``seed`` (deterministic); no document is concatenated
    with another, so each segment is contiguous natural text. Raises
    :class:`poslsh_paper.data.corpus.CorpusNotFound` when a corpus is missing and
    ``ValueError`` when too few documents are long enough.
    """
    from poslsh_paper.data.corpus import iter_documents

    docs = [d for d in iter_documents(tuple(corpora)) if len(d.text) >= n]
    docs.sort(key=lambda d: (d.corpus, d.name))
    random.Random(seed).shuffle(docs)
    out: List[Segment] = []
    for d in docs:
        text = d.text[: 16 * n]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < n and len(text) < len(d.text):
            ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            out.append(Segment(torch.tensor(ids[:n], dtype=torch.long), f"{d.corpus}:{d.name}", 0))
            if len(out) == num:
                return out
    raise ValueError(f"only {len(out)} documents of corpora {list(corpora)} have >= {n} tokens; asked for {num}")


def random_segments(vocab_size: int, num: int, n: int, *, seed: int = 0) -> List[Segment]:
    """Seeded uniformly random token ids (tests and machines without a corpus)."""
    g = torch.Generator().manual_seed(seed)
    return [Segment(torch.randint(0, vocab_size, (n,), generator=g), f"random:{seed}:{i}") for i in range(num)]


# --------------------------------------------------------- demo entry point
class RealQKV(NamedTuple):
    """Real queries/keys/values of chosen query heads, ready for
    :func:`poslsh.poslsh_attention`: ``q, k, v`` are ``[1, len(heads), n, d]`` (keys
    and values already mapped to each query head's GQA key/value head)."""

    q: Tensor
    k: Tensor
    v: Tensor
    heads: List[int]          # query head indices
    sigmas: Tensor            # [len(heads)] ALiBi bandwidths for the model's head count
    layer: int
    source: str               # document the segment was cut from


_MODEL_CACHE: dict = {}


def real_qkv_or_none(n: int = 4096, layer: int = 2, heads: Optional[Sequence[int]] = None, *,
                     rope: str = "pre", index: int = 0, seed: int = 0) -> Optional[RealQKV]:
    """SmolLM2's Q/K/V on a real ``n``-token text segment, or ``None`` when the
    model package or the corpus is not installed (checked before anything heavy is
    imported, so the miss costs milliseconds).

    Args:
        n: tokens in the segment (the first ``n`` tokens of a long document).
        layer: decoder layer (0-based).
        heads: query heads to return (default: all 9).
        rope: ``"pre"`` (default) or ``"post"``, see :func:`capture_qkv`.
        index: which segment (``index``-th document of the seeded order).
        seed: document-order seed.
    """
    from poslsh_paper.data.corpus import CorpusNotFound, available_corpora
    from poslsh_paper.models.smollm2 import ModelNotAvailable, smollm2_available

    corpora = available_corpora()
    if not corpora or not smollm2_available():
        return None
    try:
        if "smollm2" not in _MODEL_CACHE:
            from poslsh_paper.models.smollm2 import load_smollm2
            _MODEL_CACHE["smollm2"] = load_smollm2()
        model, tok = _MODEL_CACHE["smollm2"]
        seg = corpus_segments(tok, index + 1, n, seed=seed, corpora=corpora)[index]
    except (ModelNotAvailable, CorpusNotFound):
        return None
    from poslsh.alibi import alibi_sigmas

    qkv = capture_qkv(model, seg.ids, [layer], rope=rope)[layer]
    heads = list(range(qkv.q_heads)) if heads is None else [int(h) for h in heads]
    kv = [qkv.kv_head(h) for h in heads]
    sig = alibi_sigmas(qkv.q_heads)[heads]
    return RealQKV(qkv.q[heads][None], qkv.k[kv][None], qkv.v[kv][None], heads, sig, layer, seg.source)
