"""Names that become paths, and the only ways the app removes or moves files.

A preset, method, split or run name reaches the app from a flag, ``--set``, a ``--config-json``
file or a recorded ``config.json``, and becomes a path component
(``<runs_dir>/<preset>/<method>/seed<k>``, ``<out>/<preset>/table.md``). :func:`check_name` is the
one rule for all of them; :func:`inside` resolves a path (links included) and checks that it stays
under its root. Nothing is deleted except through :func:`remove_run` (a whole run directory, on
``--overwrite``) and :func:`remove_own` (a directory this process created or verified); files the
app will not delete (a damaged checkpoint) are moved with :func:`move_aside`.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Union

from poslsh_paper.experiments.command import ConfigError, DiskFull

__all__ = ["NAME_RULE", "check_name", "inside", "remove_run", "remove_own", "move_aside", "is_disk_full",
           "disk_full_error", "RUN_MARKERS"]

# Letters, digits, '.', '_', '-', starting with a letter or digit, never '..': a single path
# component that cannot climb, hide (leading dot), look like a flag, or hold a separator.
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# what makes a directory a run: files poslsh train / eval / table write there
RUN_MARKERS = ("config.json", "result.json", "checkpoints", "requested-config.json", "train.log", "eval-*.json")

PathLike = Union[str, os.PathLike]


def check_name(what: str, value) -> str:
    """``value`` if it is a plain name (:data:`NAME_RULE`, no ``..``); else one-line ConfigError."""
    if not isinstance(value, str) or not NAME_RULE.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what}: {value!r} is not a valid name (it becomes a directory name): use letters, "
                          "digits, '.', '_' and '-', starting with a letter or digit, without '..'")
    return value


def inside(root: PathLike, path: PathLike, what: str) -> Path:
    """``path``, after checking that it lies under ``root`` once both are resolved (symbolic links
    followed): a link out of the root is refused, not followed."""
    root_r, path_r = Path(root).resolve(), Path(path).resolve()
    if path_r != root_r and root_r not in path_r.parents:
        raise ConfigError(f"{what}: {path} resolves to {path_r}, outside {root} ({root_r}); a symbolic link "
                          f"leads out of it: point the option at the real directory")
    return Path(path)


def remove_run(run: PathLike, root: PathLike) -> None:
    """Delete the run directory ``run`` (``--overwrite``): only inside ``root``, not a link, and only
    a directory that is a run (holds one of :data:`RUN_MARKERS`)."""
    run = Path(run)
    inside(root, run, "overwrite")
    if run.is_symlink() or not run.is_dir():
        raise ConfigError(f"overwrite: {run} is not a run directory (a link or a file); remove it yourself")
    if not any(any(run.glob(m)) for m in RUN_MARKERS):
        raise ConfigError(f"overwrite: {run} is not a run directory (none of {', '.join(RUN_MARKERS)}): it was "
                          "not written by poslsh; move it away yourself")
    shutil.rmtree(run)


def remove_own(path: PathLike, root: PathLike) -> None:
    """Delete ``path``, a directory this process wrote (a temp directory) or verified (a checkpoint
    past retention), after checking that it lies inside ``root``."""
    inside(root, path, "remove")
    shutil.rmtree(path, ignore_errors=True)


def move_aside(path: PathLike, into: PathLike) -> Path:
    """Move ``path`` into the directory ``into`` (created), under a name not yet taken there;
    returns where it went. Used for files the app keeps but no longer uses."""
    path, into = Path(path), Path(into)
    into.mkdir(parents=True, exist_ok=True)
    target, k = into / path.name, 1
    while target.exists():
        target, k = into / f"{path.name}.{k}", k + 1
    os.replace(path, target)
    return target


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk or quota: an ``OSError`` with ENOSPC/EDQUOT, or a library's
    error that wraps one (safetensors raises its own type with the OS message in it)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


def disk_full_error(where: PathLike, what: str, exc: BaseException) -> DiskFull:
    """The one-line error for a full disk while writing ``what`` under ``where``."""
    return DiskFull(f"no space left on device while writing {what} under {where} ({type(exc).__name__}); free "
                    "space there or point --runs-dir / --out at a larger disk")
