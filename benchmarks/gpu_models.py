"""The patched-model stages of the first GPU run (``bash benchmarks/gpu_first_run.sh``), one subcommand each:

* ``models``  transformers' ``BloomModel`` at BLOOM-560m's shapes (24 layers, width 1024, 16 heads of 64;
              the vocabulary shrunk to 4096, random weights), bf16, n = 4096: ``patch_alibi(model)``
              (exact ALiBi) against the same model in float64 (transformers' eager: the model's own
              ALiBi), judged against eager bf16's own error (within 3x, as flash-attention judges a
              kernel); ``window="certified", tol=1e-3`` against the float64 model patched the same way
              (dense reference backend); then at n = 4096 and 16384 each one's forward time and peak
              memory above the weights, against eager's;
* ``cache``   ``BloomForCausalLM`` at the same shapes patched with fixed per-head windows
              (``ceil(2 sigma_h)``), bf16: a 1024-token prefill then 128 tokens one at a time on the
              per-head window cache (``alibi_cache``), each step's logits against the float64 model's one
              forward over the whole sequence, judged against the bf16 model's own one-forward error;
              each KV head holds its window + 1 rows; ``generate()`` makes the cache itself.

Both need transformers from the integration's range (``poslsh.integrations.MIN_TRANSFORMERS``); where the
machine has an older one (the GPU machine has 5.17), ``make gpu-bundle`` carries a newer one (docs/gpu.md),
else every row is ``unavailable`` with the reason. ``--dry-run``: the same code on the CPU, float32, a
2-layer model of width 64 with 4 heads, n = 97. Rows go to ``<out>/results.md`` / ``results.csv``
(:mod:`gpu_rows`); exit status 1 when a check fails or a row is an error.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch

from gpu_common import rel_error, synchronize  # noqa: E402  (puts the repository on sys.path)
from gpu_rows import Recorder  # noqa: E402

TOL = 1e-3
VOCAB = 4096


@dataclass(frozen=True)
class Shape:
    """A BLOOM-shaped model and the lengths it runs at."""

    hidden: int
    heads: int
    layers: int
    n: int                          # the accuracy check's length
    memory: Tuple[int, ...]         # lengths of the time / peak-memory rows
    prompt: int                     # the cache stage: prefill tokens
    steps: int                      # the cache stage: tokens decoded one at a time
    vocab: int
    dtype: torch.dtype
    device: str


GPU = Shape(1024, 16, 24, 4096, (4096, 16384), 1024, 128, VOCAB, torch.bfloat16, "cuda")
DRY = Shape(64, 4, 2, 97, (97,), 40, 20, 64, torch.float32, "cpu")


def transformers_problem() -> Optional[str]:
    """Why the integration cannot run here (transformers missing or older than its floor), in one line."""
    try:
        from poslsh.integrations import require_transformers
        require_transformers()
    except ImportError as e:
        return (f"{str(e).splitlines()[0]} -- on a machine that installs nothing: `make gpu-bundle`, then carry "
                ".gpu (docs/gpu.md)")
    return None


def _attempt(rec, item, fn, n=""):
    """``fn()``, or one row saying why not (the stage goes on)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError as e:
        rec.row(item, "oom", n=n, detail=str(e).splitlines()[0][:300])
    except Exception as e:  # recorded, the stage goes on
        traceback.print_exc()
        rec.row(item, "error", n=n, detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    return None


def _config(sh: Shape):
    import transformers

    return transformers.BloomConfig(vocab_size=sh.vocab, hidden_size=sh.hidden, n_layer=sh.layers, n_head=sh.heads)


def _ids(sh: Shape, n: int, seed: int = 1):
    return torch.randint(0, sh.vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(sh.device)


def _describe(sh: Shape, what: str) -> str:
    import transformers

    from gpu_env import _where
    return (f"{what}: {sh.layers} layers, width {sh.hidden}, {sh.heads} heads of {sh.hidden // sh.heads}, vocabulary "
            f"{sh.vocab}, random weights (seed 0), batch 1; {str(sh.dtype).split('.')[-1]} on {sh.device}; "
            f"transformers {transformers.__version__} ({_where(transformers)})")


def timed(fn, device: str):
    """``(fn()'s output under no_grad, seconds, peak MiB above what was allocated before; None on the CPU)``."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    synchronize(device)
    secs = time.perf_counter() - t0
    return out, secs, (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if cuda else None


def _forward(model, ids, sh: Shape):
    """``(last hidden state, seconds, peak MiB)``: :func:`timed` of the base model's forward."""
    return timed(lambda: model(input_ids=ids, use_cache=False).last_hidden_state, sh.device)


def _mean_window(model) -> float:
    from poslsh.integrations.hf import alibi_stats

    per = [s["window"] for s in alibi_stats(model)]
    return sum(map(sum, per)) / (len(per) * len(per[0]))


# ------------------------------------------------------------------ models
def models(args, sh: Shape) -> int:
    from transformers import BloomModel

    from poslsh.integrations.hf import patch_alibi

    rec = Recorder(args.out, args.stage)
    rec.row("config", "info", n=sh.n, detail=_describe(sh, "BloomModel"))
    torch.manual_seed(0)
    base = BloomModel(_config(sh)).eval()
    ids = _ids(sh, sh.n)
    oracle = copy.deepcopy(base).to(sh.device, torch.float64)
    with torch.no_grad():
        ref = oracle(input_ids=ids, use_cache=False).last_hidden_state
    eager = copy.deepcopy(base).to(sh.device, sh.dtype)
    got = _forward(eager, ids, sh)[0]
    e_eager = rel_error(got, ref)
    bound = 3 * e_eager + 1e-6
    rec.row("eager (transformers) vs float64", "info", e_eager, "rel err", n=sh.n, mode="fwd",
            detail="the yardstick: the model's own attention at this dtype; max|x - ref| / max|ref| of the last "
                   "hidden state")
    patched = patch_alibi(copy.deepcopy(base).to(sh.device, sh.dtype))

    def judge(item, x, r, extra=""):
        e = rel_error(x, r)
        ok = e <= bound and bool(torch.isfinite(x).all())
        rec.row(item, "PASS" if ok else "FAIL", e, "rel err", n=sh.n, mode="fwd",
                detail=f"vs float64, bound 3 x eager's {e_eager:.2e} + 1e-6{extra}")
        return e

    x = _attempt(rec, "patch_alibi exact", lambda: _forward(patched, ids, sh)[0], sh.n)
    if x is not None:
        judge("patch_alibi exact", x, ref)
    x = _attempt(rec, "patch_alibi certified", lambda: _forward(patch_alibi(patched, window="certified", tol=TOL),
                                                                ids, sh)[0], sh.n)
    if x is not None:
        mean_w = _mean_window(patched)
        ref_c = _attempt(rec, "float64 certified (reference backend)", lambda: _forward(
            patch_alibi(oracle, window="certified", tol=TOL, backend="reference"), ids,
            replace(sh, dtype=torch.float64))[0], sh.n)
        if ref_c is not None:
            judge(f"patch_alibi certified (tol {TOL:g})", x, ref_c,
                  f"; mean window {mean_w:.0f} keys (float64: {_mean_window(oracle):.0f}); vs exact float64 "
                  f"{rel_error(x, ref):.2e}")
    del oracle, ref, got
    if sh.device == "cuda":
        torch.cuda.empty_cache()
    for n in sh.memory:
        ids_n = _ids(sh, n, seed=n)
        peaks = {}
        for name, model, how in (("eager", eager, None), ("exact", patched, {}),
                                 ("certified", patched, dict(window="certified", tol=TOL))):
            def run(model=model, how=how):
                if how is not None:
                    patch_alibi(model, **how)
                _forward(model, ids_n, sh)                       # compiles what it needs
                return _forward(model, ids_n, sh)
            res = _attempt(rec, f"{name} forward", run, n)
            if res is None:
                continue
            _, secs, peak = res
            peaks[name] = peak
            rec.row(f"{name} forward", "ok", 1e3 * secs, "ms", n=n, mode="fwd",
                    detail="one call after a first (compiling) one" + (
                        f"; peak {peak:.0f} MiB above the weights and inputs" if peak is not None else ""))
        for name in ("exact", "certified"):
            if peaks.get("eager") and peaks.get(name):
                rec.row(f"peak memory eager / {name}", "info", peaks["eager"] / peaks[name], "x", n=n, mode="fwd",
                        detail=f"eager {peaks['eager']:.0f} MiB, {name} {peaks[name]:.0f} MiB")
        if sh.device == "cuda":
            torch.cuda.empty_cache()
    return 1 if rec.failures else 0


# ------------------------------------------------------------------ cache
def _windows(sh: Shape) -> List[int]:
    """Per head ``ceil(2 sigma_h)``, each below the prompt (so every head evicts while decoding)."""
    import poslsh

    return [min(sh.prompt // 2, math.ceil(2 * float(s))) for s in poslsh.alibi_sigmas(sh.heads)]


def cache(args, sh: Shape) -> int:
    from transformers import BloomForCausalLM

    from poslsh.integrations.hf import PoslshCache, alibi_cache, patch_alibi

    rec = Recorder(args.out, args.stage)
    P, T = sh.prompt, sh.steps
    windows = _windows(sh)
    rec.row("config", "info", n=P + T, detail=_describe(sh, "BloomForCausalLM") +
            f"; prefill {P} tokens, then {T} one at a time; windows {windows}")
    torch.manual_seed(0)
    base = BloomForCausalLM(_config(sh)).eval()
    seq = _ids(sh, P + T, seed=2)
    oracle = patch_alibi(copy.deepcopy(base).to(sh.device, torch.float64), window=windows, backend="reference")
    with torch.no_grad():
        ref = oracle(seq).logits[:, P - 1:]
    del oracle
    model = patch_alibi(copy.deepcopy(base).to(sh.device, sh.dtype), window=windows)
    full = _attempt(rec, "one forward (no cache)", lambda: model(seq).logits[:, P - 1:].detach(), P + T)
    if full is None:
        return 1
    e_full = rel_error(full, ref)
    rec.row("one forward (no cache) vs float64", "info", e_full, "rel err", n=P + T,
            detail=f"the yardstick: logits of positions {P - 1}..{P + T - 1}")

    def decode():
        c = alibi_cache(model)
        with torch.no_grad():
            steps = [model(seq[:, :P], cache=c, use_cache=True).logits[:, -1:]]
            synchronize(sh.device)
            t0 = time.perf_counter()
            for t in range(P, P + T):
                steps.append(model(seq[:, t:t + 1], cache=c, use_cache=True).logits)
            synchronize(sh.device)
        return torch.cat(steps, 1), c, (time.perf_counter() - t0) / T
    res = _attempt(rec, "per-head cache decoding", decode, P + T)
    if res is None:
        return 1
    got, c, per_token = res
    e = rel_error(got, ref)
    ok = e <= 3 * e_full + 1e-6 and bool(torch.isfinite(got).all())
    rec.row("per-head cache decoding vs float64", "PASS" if ok else "FAIL", e, "rel err", n=P + T,
            detail=f"every step's logits; bound 3 x the one forward's {e_full:.2e} + 1e-6")
    kept = c.kept_keys().tolist()
    want = [w + 1 for w in windows]
    rec.row("rows kept per KV head = window + 1", "PASS" if all(k == want for k in kept) else "FAIL",
            n=P + T, detail=f"layer 0 keeps {kept[0]}" + ("" if all(k == want for k in kept) else f", want {want}"))
    itemsize = torch.finfo(sh.dtype).bits // 8
    full_bytes = 2 * sh.layers * (P + T) * sh.hidden * itemsize
    rec.row("per-head cache size", "info", c.nbytes() / 2 ** 20, "MiB", n=P + T,
            detail=f"a full cache holds {full_bytes / 2 ** 20:.1f} MiB ({full_bytes / c.nbytes():.1f}x)")
    rec.row("per-head cache decoding time", "info", 1e3 * per_token, "ms/token", n=P + T,
            detail=f"{sh.layers} layers, batch 1, one token per step (Python's overhead included)")

    def generate():
        with torch.no_grad():
            out = model.generate(seq[:, :P], max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
        return out
    out = _attempt(rec, "generate() on the per-head cache", generate, P + 16)
    if out is not None:
        got_cache = getattr(out, "cache", None)           # transformers >= 5.24 (the integration's floor)
        ok = isinstance(got_cache, PoslshCache) and out.sequences.shape[1] == P + 16
        rec.row("generate() on the per-head cache", "PASS" if ok else "FAIL", n=P + 16,
                detail=f"greedy, 16 new tokens; cache {type(got_cache).__name__}")
    return 1 if rec.failures else 0


def run_stage(args, prog: str, item: str, run) -> int:
    """``run(args)`` of one GPU stage's command line (``--out``, ``--stage``, ``--dry-run``): without CUDA and
    without ``--dry-run`` one line saying so (exit 2); transformers that cannot serve the stage one
    ``unavailable`` row naming ``item``."""
    if not args.dry_run and not torch.cuda.is_available():
        print(f"{prog}: no CUDA GPU here; use --dry-run for the CPU code path", file=sys.stderr)
        return 2
    why = transformers_problem()
    if why:
        Recorder(args.out, args.stage).row(item, "unavailable", detail=why)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False      # the oracles are float64; nothing relies on tf32
    return run(args)


def stage_arguments(doc: str, stage: str, dry_run: str, argv=None, what=None):
    """The arguments of a GPU stage's command line (``what``: the choices of a leading subcommand)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if what:
        p.add_argument("what", choices=what)
    p.add_argument("--out", required=True, help="folder of results.md / results.csv")
    p.add_argument("--stage", default=stage, help="the stage name in the rows (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help=dry_run)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = stage_arguments(__doc__, None, "CPU, float32, a tiny BLOOM", argv, what=["models", "cache"])
    args.stage = args.stage or args.what
    return run_stage(args, "gpu_models", "patched BLOOM" if args.what == "models" else "per-head cache",
                     lambda a: {"models": models, "cache": cache}[a.what](a, DRY if a.dry_run else GPU))


if __name__ == "__main__":
    sys.exit(main())
