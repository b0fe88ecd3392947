"""Atomic file output: write to a temp file in the target directory, then
``os.replace`` it into place, so an interrupted run never leaves a torn file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

PathLike = Union[str, os.PathLike]

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_bytes", "atomic_write_json", "atomic_savefig"]


def atomic_write(path: PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)      # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(path: PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def atomic_savefig(fig, path: PathLike, **kwargs) -> Path:
    """``fig.savefig`` with an atomic replace (format taken from ``path``'s suffix)."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, **kwargs))
