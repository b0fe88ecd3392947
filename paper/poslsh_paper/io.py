"""Atomic file output: write to a temp file in the target directory, then
``os.replace`` it into place, so an interrupted run never leaves a torn file."""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

PathLike = Union[str, os.PathLike]

__all__ = ["atomic_write", "atomic_write_text", "atomic_write_bytes", "atomic_write_json", "atomic_savefig",
           "csv_text", "markdown_table"]


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


def csv_text(rows: Iterable[Mapping[str, Any]], fields: Sequence[str], *, float_format: Optional[str] = None) -> str:
    """``rows`` as CSV text with the columns ``fields`` (other keys are ignored); floats
    formatted with ``float_format`` (e.g. ``".9g"``) when given."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (format(v, float_format) if float_format and isinstance(v, float) else v)
                    for k, v in r.items()})
    return buf.getvalue()


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table (no trailing newline)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)
