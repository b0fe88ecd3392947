"""Checkpoints of every training job (``poslsh train`` / ``table``, ``poslsh vision``; read by
``eval``, ``generate`` and the vision figure): safetensors only, written so that a kill (or a
full disk) at any moment leaves the previous one intact, and never deleted unless a newer one is
verified. What is particular to the language models (which of their configurations a checkpoint
belongs to, ``--checkpoint`` resolution) is in :mod:`poslsh_paper.experiments.lm.checkpoint`.

``<run>/checkpoints/step-XXXXXXXX/`` holds ``model.safetensors`` (the trainable
parameters), ``optimizer.safetensors`` (AdamW moments and the torch/CUDA RNG
states as tensors) and ``state.json`` (step, optimizer and Python/NumPy RNG
metadata, plus whatever the trainer adds: loss history, elapsed time, config).
A checkpoint is written to a temp directory and renamed; ``checkpoints/latest``
(a one-line pointer, for people) is then replaced atomically. No pickles.

A checkpoint is *complete* only when its ``manifest.json`` — written last, with the
size and SHA-256 of every other file — says so; each new one is verified after the rename
before retention may delete an older one (never a newer one). Resuming takes the newest
complete checkpoint and says which. A checkpoint of the older layout (the same files, no
manifest: written by an earlier version) is adopted on resume once its files load (a manifest
is written for it). Damaged ones (a size or hash that differs, a missing file) are moved to
``checkpoints/damaged/`` and reported by path, never deleted; so are foreign ones (complete, but
recorded under another configuration than the run's, as the job's own rule says), into
``checkpoints/foreign/``. A full disk while writing removes the temp directory and raises
:class:`~poslsh_paper.experiments.command.DiskFull`. Loading is strict: every trainable tensor by
name and shape, or one line saying what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from poslsh_paper.io import atomic_write_text
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.paths import disk_full_error, is_disk_full, move_aside, remove_own

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "load_checkpoint_params", "load_params",
           "fit_problem", "checkpoint_problem", "prepare_resume", "recorded_config", "run_lock", "Named", "MANIFEST",
           "DAMAGED", "FOREIGN"]

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.safetensors", "state.json")
DAMAGED = "damaged"          # checkpoints/damaged/: what resume set aside, kept for the user
FOREIGN = "foreign"          # checkpoints/foreign/: complete, but written under another configuration

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
        return f"no {MANIFEST} (written by an older version, or the write never finished)"
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


def _step_of(directory: Path) -> int:
    return int(directory.name.split("-", 1)[1])


def _step_dirs(run: Path) -> List[Path]:
    ckdir = Path(run) / "checkpoints"
    return sorted((p for p in ckdir.glob("step-*") if p.name[5:].isdigit()), key=_step_of)


def _adopt_older(directory: Path) -> Optional[str]:
    """A checkpoint of the older layout (the files, no manifest): check that its files load and
    state its own step, then write its manifest. Returns why not (None when adopted)."""
    from safetensors.torch import load_file

    missing = [f for f in FILES if not (directory / f).is_file()]
    if missing:
        return f"no {MANIFEST} and {', '.join(missing)} missing"
    try:
        for name in FILES[:2]:
            load_file(str(directory / name))
        step = json.loads((directory / "state.json").read_text())["step"]
    except Exception as e:      # safetensors raises its own type for a torn file
        return f"no {MANIFEST} and its files do not load ({type(e).__name__}: {str(e)[:80]})"
    if step != _step_of(directory):
        return f"no {MANIFEST} and its state.json says step {step}"
    _write_manifest(directory)
    return None


def prepare_resume(run: Path, differs: Optional[Callable[[dict], str]] = None) -> List[str]:
    """Before resuming ``run``: adopt its older-layout checkpoints (:func:`_adopt_older`), move
    damaged ones to ``checkpoints/damaged/`` and foreign ones to ``checkpoints/foreign/``: those
    whose ``state.json`` records a configuration that ``differs`` (the job's rule: how the
    recorded config dict differs from the run's, '' when it does not) names a difference in;
    returns one line per thing done (to print)."""
    said = []
    for path in _step_dirs(run):
        problem = checkpoint_problem(path)
        if problem is None:
            foreign = _foreign(path, differs)
            if foreign:
                kept = move_aside(path, Path(run) / "checkpoints" / FOREIGN)
                said.append(f"moved foreign checkpoint {path} (written with {foreign}) to {kept}")
            continue
        if not (path / MANIFEST).exists():
            why = _adopt_older(path)
            if why is None:
                said.append(f"adopted {path}: a checkpoint of the older layout (no {MANIFEST}) whose files load; "
                            "its manifest is written now")
                continue
            problem = why
        kept = move_aside(path, Path(run) / "checkpoints" / DAMAGED)
        said.append(f"moved damaged checkpoint {path} ({problem}) to {kept}")
    return said


def _foreign(path: Path, differs: Optional[Callable[[dict], str]]) -> str:
    """How the configuration recorded in checkpoint ``path`` differs from the run's ('' if it does
    not, or when either is unknown)."""
    if differs is None:
        return ""
    try:
        recorded = json.loads((path / "state.json").read_text()).get("config")
    except (OSError, ValueError):
        return ""
    return differs(recorded) if isinstance(recorded, dict) else ""


def save_checkpoint(run: Path, step: int, params: Named, optimizer, info: dict, keep: int) -> Path:
    """Write ``run/checkpoints/step-<step>`` (manifest last), verify it, point ``latest`` at it and
    keep the newest ``keep`` complete checkpoints up to it. A full disk raises
    :class:`~poslsh_paper.experiments.command.DiskFull` with the temp directory removed; what was
    at ``step-<step>`` before is kept (a damaged one moved to ``checkpoints/damaged/``)."""
    ckdir = Path(run) / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    final = ckdir / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=ckdir, prefix=".tmp-"))
    try:
        _write_files(tmp, step, params, optimizer, info)
    except BaseException as e:      # Ctrl-C too: never leave a torn temp directory behind
        remove_own(tmp, ckdir)
        if isinstance(e, Exception) and is_disk_full(e):
            raise disk_full_error(ckdir, f"checkpoint {final.name}", e) from None
        raise
    previous = latest_checkpoint(run, report=False)
    superseded = None
    if final.exists() or final.is_symlink():
        if checkpoint_problem(final) is None:       # the same step, complete: replaced once the new one is in
            superseded = Path(tempfile.mkdtemp(dir=ckdir, prefix=".old-"))
            os.replace(final, superseded / final.name)
        else:
            print(f"moved damaged checkpoint {final} to {move_aside(final, ckdir / DAMAGED)}", file=sys.stderr)
    os.replace(tmp, final)
    problem = checkpoint_problem(final)
    if problem is not None:                         # never trust a write retention would act on
        kept = move_aside(final, ckdir / DAMAGED)
        if superseded is not None:
            os.replace(superseded / final.name, final)
            remove_own(superseded, ckdir)
        raise ConfigError(f"checkpoint {final.name} failed verification after writing ({problem}); moved to "
                          f"{kept}; the previous checkpoint {previous or '(none)'} is kept")
    if superseded is not None:
        remove_own(superseded, ckdir)
    try:
        atomic_write_text(ckdir / "latest", final.name + "\n")
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(ckdir, "checkpoints/latest", e) from None
        raise
    older = [p for p in _step_dirs(run) if _step_of(p) < step and checkpoint_problem(p) is None]
    for old in older[:max(0, len(older) - (keep - 1))]:
        remove_own(old, ckdir)
    return final


def _write_files(directory: Path, step: int, params: Named, optimizer, info: dict) -> None:
    from safetensors.torch import save_file

    save_file({n: p.detach().cpu().contiguous() for n, p in params}, str(directory / "model.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    rng_tensors, rng_meta = _rng_state(params[0][1].device)
    save_file({**opt_tensors, **rng_tensors}, str(directory / "optimizer.safetensors"))
    (directory / "state.json").write_text(json.dumps({"step": step, "optimizer": opt_meta, "rng": rng_meta, **info},
                                                     indent=1, default=str))
    _write_manifest(directory)
    os.chmod(directory, 0o755)


def latest_checkpoint(run: Path, *, report=True) -> Optional[Path]:
    """The newest complete checkpoint of ``run`` (None if there is none); damaged newer ones
    are reported on stderr by path (``report``) and skipped."""
    for path in reversed(_step_dirs(run)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if report:
            print(f"skipping damaged checkpoint {path}: {problem}", file=sys.stderr)
    return None


def fit_problem(saved: Dict[str, torch.Tensor], params: Named) -> Optional[str]:
    """How a checkpoint's tensors ``saved`` fail to fit ``params`` exactly (None when they fit)."""
    want = {n: tuple(p.shape) for n, p in params}
    have = {n: tuple(t.shape) for n, t in saved.items()}
    common = [n for n in want if n in have]
    shapes = [n for n in common if want[n] != have[n]]
    parts = []
    if len(common) != len(want) or len(have) != len(want):
        parts.append(f"{len(common)} of the model's {len(want)} trainable tensors are among the checkpoint's "
                     f"{len(have)} by name")
    if shapes:
        n = shapes[0]
        parts.append(f"{len(shapes)} differ in shape (e.g. {n}: checkpoint {list(have[n])}, model {list(want[n])})")
    return "; ".join(parts) or None


def _copy_in(saved: Dict[str, torch.Tensor], params: Named) -> None:
    with torch.no_grad():
        for n, p in params:
            p.copy_(saved[n])


def load_checkpoint(path: Path, params: Named, optimizer, device: torch.device) -> dict:
    """Restore parameters, optimizer and RNG states in place; returns ``state.json``.
    A checkpoint that is not complete, or does not fit ``params``, is an error naming it."""
    from safetensors.torch import load_file

    problem = checkpoint_problem(path)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}")
    saved = load_file(str(Path(path) / "model.safetensors"))
    misfit = fit_problem(saved, params)
    if misfit:
        raise ConfigError(f"checkpoint {path} does not fit this run's model: {misfit}")
    _copy_in(saved, params)
    tensors = load_file(str(Path(path) / "optimizer.safetensors"))
    state = json.loads((Path(path) / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
    _set_rng_state(tensors, state["rng"], device)
    return state


def load_checkpoint_params(path) -> Dict[str, torch.Tensor]:
    """``{name: tensor}`` of a checkpoint's trainable parameters (evaluation, tests, analysis)."""
    from safetensors.torch import load_file

    problem = checkpoint_problem(path)
    if problem is not None and not (Path(path) / MANIFEST).exists() and all((Path(path) / f).is_file() for f in FILES):
        run = Path(path).parent.parent
        raise ConfigError(f"checkpoint {path} has the older layout (no {MANIFEST}): resuming its run verifies and "
                          f"adopts it (`poslsh train --config-json {run / 'config.json'} --resume`, or `poslsh "
                          "vision` again for a vision run; a finished run is only evaluated again)")
    if problem is not None:
        raise ConfigError(f"checkpoint {path} is damaged: {problem}")
    return load_file(str(Path(path) / "model.safetensors"))


def load_params(ckpt: Path, params: Named) -> Optional[str]:
    """Copy checkpoint ``ckpt`` into ``params`` if every trainable tensor fits by name and shape;
    else change nothing and return how it does not fit (:func:`fit_problem`)."""
    saved = load_checkpoint_params(ckpt)
    misfit = fit_problem(saved, params)
    if misfit is None:
        _copy_in(saved, params)
    return misfit


def recorded_config(ckpt: Path) -> Optional[dict]:
    """The training config a checkpoint was written under: its ``state.json``'s, else its run's
    ``config.json`` (None when neither says)."""
    for path, key in ((Path(ckpt) / "state.json", "config"), (Path(ckpt).parent.parent / "config.json", None)):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        data = data.get(key) if key else data
        if isinstance(data, dict):
            return data
    return None


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
