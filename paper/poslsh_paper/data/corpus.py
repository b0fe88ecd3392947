"""Document-level corpora read from Debian documentation packages.

* ``linux-doc``: the Linux kernel documentation (package ``linux-doc-6.1``,
  ``.rst.gz`` files, about 6M tokens).
* ``python-doc``: the Python documentation's reST sources (package
  ``python3.11-doc``, ``.rst.txt`` files, about 3M tokens).

Documents are kept whole (never line-shuffled) and split into train/validation/
test *by document*, with a split that depends only on the document's name.
"""
from __future__ import annotations

import gzip
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

__all__ = ["CORPORA", "CorpusNotFound", "Document", "available_corpora", "corpus_files",
           "iter_documents", "load_documents", "split_documents"]


@dataclass(frozen=True)
class CorpusSpec:
    package: str      # Debian package that ships it
    root: str         # default directory
    suffix: str       # file suffix of a document
    env: str          # environment variable that overrides the root


CORPORA: Dict[str, CorpusSpec] = {
    "linux-doc": CorpusSpec("linux-doc-6.1", "/usr/share/doc/linux-doc-6.1/Documentation", ".rst.gz",
                            "POSLSH_LINUX_DOC_ROOT"),
    "python-doc": CorpusSpec("python3.11-doc", "/usr/share/doc/python3.11/html/_sources", ".rst.txt",
                             "POSLSH_PYTHON_DOC_ROOT"),
}
DEFAULT_CORPORA = ("linux-doc", "python-doc")


class CorpusNotFound(FileNotFoundError):
    """A corpus is not installed; the message says which package to install."""


@dataclass(frozen=True)
class Document:
    corpus: str
    name: str    # path relative to the corpus root: a stable identifier
    text: str


def _spec(name: str) -> CorpusSpec:
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {sorted(CORPORA)}")
    return CORPORA[name]


def _root(name: str) -> Path:
    spec = _spec(name)
    return Path(os.environ.get(spec.env, spec.root))


def install_hint(names: Iterable[str]) -> str:
    pkgs = " ".join(_spec(n).package for n in names)
    return f"sudo apt-get install {pkgs}"


def corpus_files(name: str) -> List[Path]:
    """All document files of corpus ``name``, sorted; raises :class:`CorpusNotFound`."""
    spec, root = _spec(name), _root(name)
    files = sorted(root.rglob(f"*{spec.suffix}")) if root.is_dir() else []
    if not files:
        raise CorpusNotFound(
            f"corpus {name!r} not found under {root}: install the Debian package {spec.package!r} "
            f"({install_hint([name])}) or point {spec.env} at a copy")
    return files


def available_corpora() -> List[str]:
    out = []
    for name in CORPORA:
        try:
            corpus_files(name)
            out.append(name)
        except CorpusNotFound:
            pass
    return out


def _read(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return raw.decode("utf-8", errors="replace")


def iter_documents(names: Sequence[str] = DEFAULT_CORPORA, *, min_chars: int = 1) -> Iterator[Document]:
    """Yield whole documents of the given corpora in a fixed order."""
    missing = [n for n in names if n not in available_corpora()]
    if missing:
        raise CorpusNotFound(f"corpora {missing} are not installed: run `{install_hint(missing)}`")
    for name in names:
        root = _root(name)
        for path in corpus_files(name):
            text = _read(path)
            if len(text) >= min_chars:
                yield Document(name, str(path.relative_to(root)), text)


def load_documents(names: Sequence[str] = DEFAULT_CORPORA, *, min_chars: int = 1) -> List[Document]:
    return list(iter_documents(names, min_chars=min_chars))


def _unit_interval(key: str) -> float:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: Iterable[Document], *, validation: float = 0.02, test: float = 0.02,
                    salt: Optional[str] = "poslsh") -> Dict[str, List[Document]]:
    """Split by document into ``train`` / ``validation`` / ``test``.

    The split of a document depends only on its corpus, name and ``salt``, so it
    is stable when documents are added or removed.
    """
    if validation < 0 or test < 0 or validation + test >= 1:
        raise ValueError("validation and test fractions must be >= 0 and sum to < 1")
    out: Dict[str, List[Document]] = {"train": [], "validation": [], "test": []}
    for d in docs:
        x = _unit_interval(f"{salt}:{d.corpus}:{d.name}")
        key = "test" if x < test else "validation" if x < test + validation else "train"
        out[key].append(d)
    return out
