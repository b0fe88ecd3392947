"""Checkpoints: safetensors only, written so that a kill at any moment leaves the
previous one intact.

``<run>/checkpoints/step-XXXXXXXX/`` holds ``model.safetensors`` (the trainable
parameters), ``optimizer.safetensors`` (AdamW moments and the torch/CUDA RNG
states as tensors) and ``state.json`` (step, optimizer and Python/NumPy RNG
metadata, plus whatever the trainer adds: loss history, elapsed time, config).
A checkpoint is written to a temp directory and renamed; ``checkpoints/latest``
(a one-line pointer, for people) is then replaced atomically. No pickles.

A checkpoint is *complete* only when its ``manifest.json`` — written last, with the
size and SHA-256 of every other file — says so. Resuming takes the newest complete
checkpoint and says which; damaged ones (no manifest, a size or hash that differs)
are reported by path and left in place, never deleted silently.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import random
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from poslsh_paper.io import atomic_write_text
from poslsh_paper.experiments.command import ConfigError

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "load_checkpoint_params",
           "resolve_checkpoint", "checkpoint_problem", "run_lock", "MANIFEST"]

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.safetensors", "state.json")

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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(directory: Path) -> None:
    files = {name: {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
             for name in FILES}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_problem(directory: Path) -> Optional[str]:
    """Why ``directory`` is not a complete checkpoint (None when it is)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the write never finished)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def save_checkpoint(run: Path, step: int, params: Named, optimizer, info: dict, keep: int) -> Path:
    """Write ``run/checkpoints/step-<step>`` (manifest last), point ``latest`` at it and keep
    the newest ``keep`` complete checkpoints (damaged ones are left for the user to inspect)."""
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
    _write_manifest(tmp)
    os.chmod(tmp, 0o755)
    final = ckdir / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckdir / "latest", final.name + "\n")
    complete = [p for p in sorted(ckdir.glob("step-*")) if p != final and checkpoint_problem(p) is None]
    for old in complete[:max(0, len(complete) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run: Path, *, report=True) -> Optional[Path]:
    """The newest complete checkpoint of ``run`` (None if there is none); damaged newer ones
    are reported on stderr by path (``report``) and skipped."""
    ckdir = Path(run) / "checkpoints"
    for path in sorted(ckdir.glob("step-*"), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if report:
            print(f"skipping damaged checkpoint {path}: {problem} (left in place)", file=sys.stderr)
    return None


def load_checkpoint(path: Path, params: Named, optimizer, device: torch.device) -> dict:
    """Restore parameters, optimizer and RNG states in place; returns ``state.json``.
    A checkpoint that is not complete is an error naming the file."""
    from safetensors.torch import load_file

    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}")
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

    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}")
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
                          "directory, its checkpoints/latest pointer, a run directory, or init (the untrained model)")
    return ckpt


@contextmanager
def run_lock(run: Path) -> Iterator[None]:
    """Hold ``<run>.lock`` (an exclusive ``flock`` next to the run directory, so ``--overwrite``
    cannot delete it) for the life of a training process; a second process on the same run
    gets a one-line error naming the holder's PID. The OS drops the lock if the holder dies."""
    import fcntl

    path = Path(str(Path(run)) + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"run directory {run} is in use by process {holder} (another poslsh train); "
                              "wait for it to finish or use another --runs-dir / --seed") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)      # releases the lock
