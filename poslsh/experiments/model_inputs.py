"""Which model, which text, which layers and heads: the configuration that
``poslsh convergence`` and ``poslsh audit`` share (both measure on a real model's
Q/K/V), and the loaders that turn it into a model, query heads and input segments.

Layers or heads the model does not have are a
:class:`~poslsh.experiments.command.ConfigError` (one line on the command line); a
model or corpus that is not installed is its subclass :class:`InputsNotAvailable`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Tuple

from ..alibi import alibi_sigmas
from ..analysis.qkv import Segment, corpus_segments, random_segments
from ..analysis.records import default_heads
from .command import ConfigError

__all__ = ["ModelInputs", "InputsNotAvailable", "load_model", "query_heads", "input_segments"]


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


def load_model(cfg: ModelInputs):
    """``(model, tokenizer)`` of ``cfg.model`` (SmolLM2 when None), checked against
    ``cfg.layers``; read from local files only."""
    from ..models.smollm2 import ModelNotAvailable, load_causal_lm

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
    heads = list(cfg.heads) if cfg.heads is not None else default_heads(num_heads)
    bad = [h for h in heads if not 0 <= h < num_heads]
    if bad:
        raise ConfigError(f"--heads: {bad} out of range, the model has {num_heads} query heads")
    sig = alibi_sigmas(num_heads)
    return heads, [float(sig[h]) for h in heads]


def input_segments(cfg: ModelInputs, tokenizer, vocab_size: int, num: int, n: int) -> List[Segment]:
    """``num`` segments of ``n`` tokens: whole-document prefixes of ``cfg.corpora``
    (seeded order), or seeded random ids when ``cfg.inputs_from == "random"``."""
    if cfg.inputs_from == "random":
        return random_segments(vocab_size, num, n, seed=cfg.seed)
    from ..data.corpus import CorpusNotFound

    try:
        return corpus_segments(tokenizer, num, n, seed=cfg.seed, corpora=cfg.corpora)
    except CorpusNotFound as e:
        raise InputsNotAvailable(f"{e} (or use --inputs-from random)") from e
    except ValueError as e:      # an unknown corpus name, or too few documents of n tokens
        raise ConfigError(f"--corpora / --n: {e}") from e
