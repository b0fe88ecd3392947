"""Checkpoints: safetensors only, written so that a kill at any moment leaves the
previous one intact.

``<run>/checkpoints/step-XXXXXXXX/`` holds ``model.safetensors`` (the trainable
parameters), ``optimizer.safetensors`` (AdamW moments and the torch/CUDA RNG
states as tensors) and ``state.json`` (step, optimizer and Python/NumPy RNG
metadata, plus whatever the trainer adds: loss history, elapsed time, config).
A checkpoint is written to a temp directory and renamed; ``checkpoints/latest``
(a one-line pointer) is then replaced atomically. No pickles.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ...io import atomic_write_text
from ..command import ConfigError

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "load_checkpoint_params",
           "resolve_checkpoint"]

Named = List[Tuple[str, torch.Tensor]]   # [(name, parameter)] of the trainable parameters


def _flatten_optimizer(sd: dict):
    """An optimizer ``state_dict`` as (tensors for safetensors, JSON-able rest)."""
    tensors, state = {}, {}
    for k, entry in sd["state"].items():
        state[str(k)] = {}
        for name, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{k}.{name}"] = v.detach().cpu().contiguous()
                state[str(k)][name] = {"tensor": f"opt.{k}.{name}"}
            else:
                state[str(k)][name] = v
    return tensors, {"state": state, "param_groups": sd["param_groups"]}


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {int(k): {n: (tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v)
                      for n, v in entry.items()} for k, entry in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state(device: torch.device):
    tensors = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    st = np.random.get_state()
    return tensors, {"python": random.getstate(), "numpy": [st[0], st[1].tolist(), *st[2:]]}


def _set_rng_state(tensors: dict, meta: dict, device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = meta["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))


def save_checkpoint(run: Path, step: int, params: Named, optimizer, info: dict, keep: int) -> Path:
    """Write ``run/checkpoints/step-<step>``, point ``latest`` at it and keep the newest ``keep``."""
    from safetensors.torch import save_file

    ckdir = Path(run) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckdir, prefix=".tmp-"))
    save_file({n: p.detach().cpu().contiguous() for n, p in params}, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    rng_tensors, rng_meta = _rng_state(params[0][1].device)
    save_file({**opt_tensors, **rng_tensors}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, "optimizer": opt_meta, "rng": rng_meta, **info},
                                               indent=1, default=str))
    os.chmod(tmp, 0o755)
    final = ckdir / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckdir / "latest", final.name + "\n")
    for old in sorted(p for p in ckdir.glob("step-*") if p.name != final.name)[:-keep or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run: Path) -> Optional[Path]:
    """The checkpoint ``run/checkpoints/latest`` points at, or None."""
    pointer = Path(run) / "checkpoints" / "latest"
    if pointer.exists():
        path = pointer.parent / pointer.read_text().strip()
        if (path / "state.json").exists():
            return path
    return None


def load_checkpoint(path: Path, params: Named, optimizer, device: torch.device) -> dict:
    """Restore parameters, optimizer and RNG states in place; returns ``state.json``."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(path) / "model.safetensors"))
    with torch.no_grad():
        for n, p in params:
            p.copy_(saved[n])
    tensors = load_file(str(Path(path) / "optimizer.safetensors"))
    state = json.loads((Path(path) / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
    _set_rng_state(tensors, state["rng"], device)
    return state


def load_checkpoint_params(path) -> Dict[str, torch.Tensor]:
    """``{name: tensor}`` of a checkpoint's trainable parameters (evaluation, tests, analysis)."""
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


def resolve_checkpoint(path: Optional[str], run: Path) -> Path:
    """The checkpoint ``poslsh eval --checkpoint PATH`` means: a checkpoint directory, a run
    directory (its latest), or a ``checkpoints/latest`` pointer; no PATH: ``run``'s latest."""
    if path is None:
        ckpt = latest_checkpoint(run)
        if ckpt is None:
            raise ConfigError(f"checkpoint: no checkpoint under {run}: train the run first (poslsh train ...) "
                              "or pass --checkpoint")
        return ckpt
    ckpt = Path(path)
    if ckpt.name == "latest" and ckpt.is_file():                  # the pointer file itself
        ckpt = ckpt.parent / ckpt.read_text().strip()
    elif not (ckpt / "model.safetensors").exists():               # a run directory
        ckpt = latest_checkpoint(ckpt) or ckpt
    if not (ckpt / "model.safetensors").exists():
        raise ConfigError(f"checkpoint: {path} is not a checkpoint (no model.safetensors): pass a checkpoint "
                          "directory, its checkpoints/latest pointer or a run directory")
    return ckpt
