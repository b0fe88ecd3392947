"""``poslsh generate``: stream text from a trained model with the bounded KV cache.

The model comes from a training run (``--checkpoint``: a run directory, a checkpoint
directory or its ``checkpoints/latest`` pointer; the run's ``config.json`` rebuilds the
model and its tokenizer) or from a directory saved with ``save_pretrained`` (``--model``,
loaded with :func:`poslsh.integrations.hf.from_pretrained`, tokenizer from the same
directory). Tokens stream to stdout (transformers' ``TextStreamer``); greedy by default,
``--sample`` with ``--temperature`` / ``--top-k`` / ``--top-p`` through transformers'
``GenerationConfig``. At the end a summary goes to stderr: prefill and decoding speed,
and the cache: for poslsh / fixed_blocks models the keys each layer kept against its
bound (:mod:`poslsh.integrations.hf.cache`), for alibi-window models the rows each KV head
keeps (its own window) and, with ``--tol``, the certificate's worst bound on the dropped mass
(``--policy``: widen | warn | raise; ``--sinks``: first positions kept exactly), for the others
the full cache.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from poslsh_paper.experiments.command import Command, ConfigError

__all__ = ["GenerateConfig", "load_for_generation", "generate", "main", "COMMANDS"]


@dataclass
class GenerateConfig:
    checkpoint: Optional[str] = None  # a training run directory, a checkpoint directory or checkpoints/latest
    model: Optional[str] = None       # or a model directory saved with save_pretrained (with its tokenizer)
    prompt: Optional[str] = None      # the prompt text
    prompt_file: Optional[str] = None  # read the prompt from this file instead
    max_new_tokens: int = 64          # tokens to generate
    sample: bool = False              # sample instead of greedy decoding
    temperature: float = 1.0          # sampling temperature
    top_k: int = 50                   # sampling: keep the k most likely tokens (0 = all)
    top_p: float = 1.0                # sampling: smallest set of tokens with this much probability (1 = all)
    seed: int = 0                     # seed of the sampler
    ignore_eos: bool = False          # keep generating after the end-of-text token
    prefill_chunk: int = 4096         # prompt tokens per forward pass (0 = the whole prompt at once)
    cache: str = "auto"               # auto (bounded for poslsh/fixed_blocks, per head for alibi-window) | full | none
    tol: float = 0.0                  # alibi-window: certify every step's dropped softmax mass <= tol (0 = off)
    policy: str = "warn"              # a step over --tol: widen (keep more keys) | warn | raise
    sinks: int = 0                    # alibi-window: keep the first k positions of the sequence exactly
    device: str = "auto"              # auto | cpu | cuda
    threads: int = 0                  # torch intra-op threads (0 = torch default)

    def check(self) -> None:
        if (self.checkpoint is None) == (self.model is None):
            raise ConfigError("pass exactly one of --checkpoint (a training run) and --model (a saved model directory)")
        if (self.prompt is None) == (self.prompt_file is None):
            raise ConfigError("pass exactly one of --prompt TEXT and --prompt-file FILE")
        if self.prompt_file is not None:
            self.prompt_text()
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling: need temperature > 0, top_k >= 0 and 0 < top_p <= 1, got "
                              f"{self.temperature}, {self.top_k}, {self.top_p}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"--prefill-chunk: must be >= 0, got {self.prefill_chunk}")
        if not 0 <= self.tol < 1 or self.sinks < 0:
            raise ConfigError(f"--tol must be in [0, 1) and --sinks >= 0, got {self.tol} and {self.sinks}")
        if (self.tol or self.sinks) and self.cache != "auto":
            raise ConfigError("--tol / --sinks: the certificate and sink keys belong to the per-head window cache "
                              "(--cache auto)")
        for name, allowed in (("cache", ("auto", "full", "none")), ("device", ("auto", "cpu", "cuda")),
                              ("policy", ("widen", "warn", "raise"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name}: must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ConfigError("--device cuda: no CUDA device is available")

    def prompt_text(self) -> str:
        """The prompt: ``--prompt``, or ``--prompt-file`` read as UTF-8 (else one-line ConfigError)."""
        if self.prompt is not None:
            return self.prompt
        path = Path(self.prompt_file)
        if not path.is_file():
            raise ConfigError(f"--prompt-file: no such file {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompt-file {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}); convert it (iconv -t UTF-8) or pass the text with --prompt") from None


def _from_run(path: str):
    """(model, HF tokenizer) of a training run's checkpoint."""
    from transformers import PreTrainedTokenizerFast

    from poslsh_paper.experiments.lm.config import parse_method
    from poslsh_paper.experiments.lm.model import trainable_parameters
    from poslsh_paper.experiments.paths import check_name

    from poslsh_paper.data.tokens import load_tokenizer
    from poslsh_paper.experiments.lm.checkpoint import load_strict, resolve_checkpoint
    from poslsh_paper.experiments.lm.config import TrainConfig
    from poslsh_paper.experiments.lm.model import build_model
    from poslsh_paper.experiments.serialize import config_from_dict

    ckpt = resolve_checkpoint(path, Path(path))
    run = ckpt.parent.parent                      # <run>/checkpoints/step-XXXXXXXX
    if not (run / "config.json").is_file():
        raise ConfigError(f"--checkpoint: {run} has no config.json: pass a directory written by poslsh train")
    try:
        cfg = config_from_dict(TrainConfig, json.loads((run / "config.json").read_text()))
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"--checkpoint: {run / 'config.json'} is not a run's config ({e})") from None
    check_name("preset", cfg.preset)      # a recorded name is checked like a typed one
    parse_method(cfg.method)
    tok = load_tokenizer(cfg.data, cfg.cache_dir or None)
    model = build_model(cfg, tok.vocab_size, tok.separator_id)
    load_strict(ckpt, trainable_parameters(model), cfg)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.backend.id_to_token(tok.separator_id))
    return model, hf_tok, f"{run} ({ckpt.name}, {cfg.method})"


def _from_directory(path: str):
    import torch
    from transformers import AutoTokenizer

    from poslsh.integrations import hf
    from poslsh_paper.models.smollm2 import quiet_loading

    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"--model: {path} is not a model directory (no config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:     # transformers' message runs over several lines
        raise ConfigError(f"--model: {path} holds no tokenizer that AutoTokenizer can load "
                          f"({type(e).__name__}; no tokenizer.json / tokenizer_config.json there?): save the "
                          "tokenizer with the model (tokenizer.save_pretrained(DIR)), or generate from a training "
                          "run with --checkpoint RUN_DIR") from None
    with quiet_loading():
        model = hf.from_pretrained(path, dtype=torch.float32)
    return model, tok, f"{path} ({model.config._attn_implementation})"


def load_for_generation(cfg: GenerateConfig):
    """``(model in eval mode, tokenizer, description)`` from ``--checkpoint`` or ``--model``."""
    import torch

    model, tok, what = _from_run(cfg.checkpoint) if cfg.checkpoint is not None else _from_directory(cfg.model)
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    return model.to(device).eval(), tok, what


class _TimedStreamer:
    """transformers' ``TextStreamer`` that also notes when the first new token arrived."""

    def __init__(self, tok):
        from transformers import TextStreamer

        self.inner, self.calls, self.first = TextStreamer(tok, skip_prompt=True), 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:           # the first call carries the prompt
            self.first = time.perf_counter()
        self.inner.put(value)

    def end(self):
        self.inner.end()


def cache_summary(cache) -> str:
    """One line about a cache after generation."""
    from poslsh.integrations.hf.cache import PoslshCache

    if isinstance(cache, PoslshCache) and cache.stats()[0].get("kept_per_head") is not None:
        st = cache.stats()
        return (f"per-head window cache: {st[0]['tokens']} tokens seen, rows per KV head {st[0]['kept_per_head']} "
                f"(layer 0; its own window + 1), {cache.nbytes() / 2**20:.2f} MiB")
    if isinstance(cache, PoslshCache):
        st = cache.stats()
        kept, bound = max(s["kept"] for s in st), max(s["bound"] or 0 for s in st)
        return (f"bounded cache: {st[0]['tokens']} tokens seen, at most {kept} keys kept per layer (bound "
                f"{bound}: the widest block - 1), {max(s['peak'] for s in st)} attended in one step, "
                f"{cache.nbytes() / 2**20:.2f} MiB")
    if cache is None:
        return "no cache (recomputed every step)"
    n = cache.get_seq_length()
    size = sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values) if t is not None)
    return f"full cache: {n} keys per layer, {size / 2**20:.2f} MiB"


def certificate_summary(cfg: GenerateConfig, cache) -> Optional[str]:
    """With ``--tol``: one line on what the certificate found, in this command's words (the library's
    per-head warnings are held back during generation, so the streamed text stays clean); else None."""
    from poslsh.integrations.hf.cache import PoslshCache

    if not cfg.tol or not isinstance(cache, PoslshCache):
        return None
    certs = [(s["layer"], s["certificate"]) for s in cache.stats() if "certificate" in s]
    if not certs:
        return None
    worst = max(c["worst"] for _, c in certs)
    steps = sum(c["steps"] * len(c["exceeded"]) for _, c in certs)
    over = sum(sum(c["exceeded"]) for _, c in certs)
    widened = sum(sum(c["widened"]) for _, c in certs)
    line = (f"certificate (--tol {cfg.tol:g}, --policy {cfg.policy}): worst bound on the dropped softmax mass "
            f"{worst:.2e}; ")
    grown = f", after {widened} widening{'s' if widened != 1 else ''}" if widened else ""
    if not over:
        return line + f"every step of every head stayed within tol ({steps} head-steps{grown})"
    where = "; ".join(f"layer {layer} head{'s' if sum(x > 0 for x in c['exceeded']) > 1 else ''} "
                      f"{', '.join(str(h) for h, x in enumerate(c['exceeded']) if x)}"
                      for layer, c in certs if any(c["exceeded"]))
    advice = {"warn": "--policy widen keeps more keys where the bound passes tol, --policy raise stops there",
              "widen": "a head widens only after a step over tol, and never past its cap: loosen --tol, or use a "
                       "model with wider windows"}.get(cfg.policy, "")
    return line + (f"{over} of {steps} head-steps over tol{grown} ({where}): the text above is not certified at "
                   f"those steps; {advice}")


def generate(cfg: GenerateConfig, model, tok) -> dict:
    """Stream ``cfg.max_new_tokens`` tokens after the prompt; returns the numbers of the summary."""
    import torch
    from transformers import DynamicCache, GenerationConfig

    prompt = cfg.prompt_text()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    if ids.shape[1] == 0:
        raise ConfigError("the prompt encodes to no tokens")
    eos = None if cfg.ignore_eos else tok.eos_token_id
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.sample, temperature=cfg.temperature,
                           top_k=cfg.top_k, top_p=cfg.top_p, eos_token_id=eos, pad_token_id=tok.eos_token_id or 0,
                           prefill_chunk_size=(cfg.prefill_chunk or None) if cfg.cache != "none" else None,
                           use_cache=cfg.cache != "none",
                           return_dict_in_generate=True)
    extra = {"cache": DynamicCache(config=model.config)} if cfg.cache == "full" else {}
    if cfg.tol or cfg.sinks:
        from poslsh.decoding import Certificate
        from poslsh.integrations.hf.cache import WINDOW_SCHEMES, PoslshCache

        if model.config._attn_implementation not in WINDOW_SCHEMES:
            raise ConfigError(f"--tol / --sinks: only alibi-window models keep per-head windows, this model runs "
                              f"{model.config._attn_implementation} (positional LSH keeps its own bound)")
        cert = Certificate(cfg.tol, cfg.policy) if cfg.tol else None
        extra = {"cache": PoslshCache(model, certificate=cert, sinks=cfg.sinks)}
    torch.manual_seed(cfg.seed)
    streamer = _TimedStreamer(tok)
    t0 = time.perf_counter()
    from poslsh.decoding.certificate import CertificateWarning

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CertificateWarning)   # counted in the cache's stats, said at the end
        try:
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                 streamer=streamer, **extra)
        except ValueError as e:
            stopped = cfg.tol and cfg.policy == "raise" and any(
                any(s["certificate"]["exceeded"]) for s in extra["cache"].stats() if "certificate" in s)
            if not stopped:
                raise
            print(file=sys.stderr)
            raise ConfigError(f"certificate (--tol {cfg.tol:g}, --policy raise) stopped the generation: "
                              f"{str(e).split(': take')[0]}; --policy widen keeps more keys, --policy warn goes on "
                              "and says where tol was passed, or loosen --tol") from None
    for w in caught:           # any other warning is shown as Python would have shown it
        if not issubclass(w.category, CertificateWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    t1 = time.perf_counter()
    new = res.sequences.shape[1] - ids.shape[1]
    first = streamer.first or t1
    return {"prompt_tokens": ids.shape[1], "new_tokens": new, "prefill_s": first - t0,
            "decode_tokens_per_s": (new - 1) / (t1 - first) if new > 1 and t1 > first else float("nan"),
            "cache": cache_summary(getattr(res, "cache", None)),
            "certificate": certificate_summary(cfg, getattr(res, "cache", None)), "sequences": res.sequences}


def main(cfg: GenerateConfig) -> int:
    import torch

    cfg.check()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tok, what = load_for_generation(cfg)
    st = generate(cfg, model, tok)
    print(f"\n[{what}] prompt {st['prompt_tokens']} tokens, prefill {st['prefill_s']:.2f} s; {st['new_tokens']} new "
          f"tokens at {st['decode_tokens_per_s']:.1f} tokens/s; {st['cache']}", file=sys.stderr)
    if st["certificate"]:
        print(st["certificate"], file=sys.stderr)
    return 0


COMMANDS = [Command("generate", "stream text from a trained model (bounded KV cache: poslsh, fixed blocks, windows)",
                    GenerateConfig, {"default": GenerateConfig()}, "default", main,
                    preset_help={"default": "greedy, 64 new tokens, the bounded cache where the model has one"})]
