"""``load_alibi_encoder``: a MosaicBERT, DNABERT-2 or Jina-BERT-v2 checkpoint as its original code
saves it (``config.json`` + ``model.safetensors``, or the Hub's ``pytorch_model.bin`` read with
``weights_only=True``; sharded ones by their index), into the modules of this package. No code from
the checkpoint ever runs: the config is read as JSON, the weights as tensors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import Tensor

from .attention import check_window
from .family import encoder_config, recognise, split_prefix, unused_key
from .model import AlibiEncoderForMaskedLM, AlibiEncoderForSequenceClassification, AlibiEncoderModel

__all__ = ["load_alibi_encoder", "read_state_dict"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_HEADS = {"none": AlibiEncoderModel, "mlm": AlibiEncoderForMaskedLM,
          "classification": AlibiEncoderForSequenceClassification}
_TIED = "cls.predictions.decoder.weight"


def _read_file(path: Path) -> Dict[str, Tensor]:
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ModuleNotFoundError:
            raise ModuleNotFoundError(f"{path}: reading safetensors needs the safetensors package: "
                                      "pip install safetensors") from None
        return load_file(str(path), device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def read_state_dict(directory) -> Dict[str, Tensor]:
    """The weights of a checkpoint directory: the first of ``model.safetensors``, its sharded index,
    ``pytorch_model.bin`` (``torch.load(weights_only=True)``), its index."""
    directory = Path(directory)
    for name in _WEIGHT_FILES:
        f = directory / name
        if not f.exists():
            continue
        if not name.endswith(".index.json"):
            return _read_file(f)
        state: Dict[str, Tensor] = {}
        for shard in sorted(set(json.loads(f.read_text())["weight_map"].values())):
            state.update(_read_file(directory / shard))
        return state
    raise FileNotFoundError(f"{directory}: no weights ({', '.join(_WEIGHT_FILES)})")


def _hub_snapshot(repo_id: str) -> Path:
    """A Hub model's ``config.json`` and weights (never its code), through huggingface_hub."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import EntryNotFoundError
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"{repo_id}: no such directory; to read a Hub id, pip install huggingface_hub") \
            from None
    config = Path(hf_hub_download(repo_id, "config.json"))
    for name in _WEIGHT_FILES:
        try:
            got = Path(hf_hub_download(repo_id, name))
        except EntryNotFoundError:
            continue
        if name.endswith(".index.json"):
            for shard in sorted(set(json.loads(got.read_text())["weight_map"].values())):
                hf_hub_download(repo_id, shard)
        return config.parent
    raise FileNotFoundError(f"{repo_id}: the Hub repository has no weights ({', '.join(_WEIGHT_FILES)})")


def _directory(path) -> Path:
    p = Path(path)
    if p.is_dir():
        return p
    if isinstance(path, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not p.exists():
        return _hub_snapshot(path)
    raise FileNotFoundError(f"{path}: not a checkpoint directory (config.json and weights)")


def _state_for(model, state: Dict[str, Tensor], prefix: str, layout: str, where: str) -> Dict[str, Tensor]:
    """The checkpoint's tensors renamed to ``model``'s names (the encoder under ``bert.`` in a head),
    the tied decoder checked, unused weights dropped; missing or foreign names refused in one line."""
    target = "" if isinstance(model, AlibiEncoderModel) else "bert."
    out = {}
    for name, t in state.items():
        if unused_key(name, layout):
            continue
        out[target + name[len(prefix):] if name.startswith(prefix) else name] = t
    word = out.get(target + "embeddings.word_embeddings.weight")
    if _TIED in out and not torch.equal(out[_TIED], word):
        raise ValueError(f"{where}: {_TIED} differs from the word embeddings, but the model ties them")
    if _TIED not in out and isinstance(model, AlibiEncoderForMaskedLM):
        out[_TIED] = word
    if "cls.predictions.bias" in out:                    # Jina's port keeps the decoder bias beside it
        bias = out.pop("cls.predictions.bias")
        out.setdefault("cls.predictions.decoder.bias", bias)
    own = model.state_dict()
    missing = sorted(set(own) - set(out))
    foreign = sorted(set(out) - set(own))
    if missing or foreign:
        raise ValueError(f"{where}: weights missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                         f"weights with no place {foreign[:4]}{' ...' if len(foreign) > 4 else ''}")
    bad = [k for k in own if tuple(own[k].shape) != tuple(out[k].shape)]
    if bad:
        raise ValueError(f"{where}: {bad[0]} has shape {tuple(out[bad[0]].shape)}, the layout needs "
                         f"{tuple(own[bad[0]].shape)}")
    return out


def load_alibi_encoder(path, *, window=None, tol: Optional[float] = None, dtype: Optional[torch.dtype] = None,
                       device=None, backend: str = "auto"):
    """Load a MosaicBERT / DNABERT-2 / Jina-BERT-v2 checkpoint natively (no remote code) in eval mode.

    Args:
        path: a checkpoint directory as the original code writes it, or a Hub id (``"owner/name"``,
            through ``huggingface_hub`` where installed: the config and weights only).
        window: ``None`` exact ALiBi; an int or ``[H]`` per-head windows (keys with ``|i - j| <= w``);
            ``"certified"`` with ``tol``: per call and head the smallest window whose bound on every
            query's dropped softmax mass is ``<= tol``.
        tol: the tolerance of ``window="certified"`` (in (0, 1)).
        dtype: the parameters' dtype (default: as stored). device: where the model goes.
        backend: the window op's backend (``"auto"``, ``"torch"``, ``"triton"``, ``"flex"``, ``"reference"``).
    Returns:
        :class:`~.model.AlibiEncoderModel`, or :class:`~.model.AlibiEncoderForMaskedLM` /
        :class:`~.model.AlibiEncoderForSequenceClassification` when the checkpoint has that head.
    Raises:
        ValueError in one line for a checkpoint that is not an ALiBi encoder this loader knows (a plain
        BERT, a RoPE encoder, an unknown layout) or whose weights do not fit its layout.
    """
    check_window(window, tol)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: a floating torch.dtype (float32, float64, bfloat16, float16), got {dtype!r}")
    directory = _directory(path)
    where = str(path)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{where}: no config.json")
    config = json.loads((directory / "config.json").read_text())
    state = read_state_dict(directory)
    layout = recognise(config, state.keys(), where)
    prefix, head = split_prefix(state.keys(), where)
    cfg = encoder_config(config, layout, {k: tuple(v.shape) for k, v in state.items()}, prefix, where)
    pooler = (prefix + "pooler.dense.weight") in state
    model = _HEADS[head](cfg, pooler=pooler)
    stored = state[prefix + "embeddings.word_embeddings.weight"].dtype
    model.load_state_dict(_state_for(model, state, prefix, layout, where))
    model.to(dtype=dtype or stored, device=device)
    model.set_attention(window=window, tol=tol, backend=backend)
    return model.eval()
