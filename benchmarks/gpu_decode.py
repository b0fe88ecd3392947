"""The ``decode`` stage of the first GPU run (``bash benchmarks/gpu_first_run.sh``): long-context decoding of a
patched BLOOM, bf16, against float64, and its time per token.

``BloomForCausalLM`` at BLOOM-560m's shapes (24 layers, width 1024, 16 heads of 64; vocabulary 4096, random
weights), bf16, batch 1: a 1024-token prefill, then 48 tokens one at a time,

* **exact** (``patch_alibi(model)``) on an ``AppendCache`` (what ``generate()`` uses): every step's logits
  against the untouched float64 model's one forward over the sequence, judged against the patched bf16 model's
  own one-forward error (within 3x, as the ``cache`` stage judges);
* **certified** (``window="certified", tol=1e-3``) on the per-head window cache: the windows are chosen from
  the prefill; every step's logits against the float64 model cut at those same windows (layer by layer, the
  dense reference backend), judged against the bf16 one forward at those windows; the certificate's worst
  bound and its exceedances, and each KV head holding ``min(tokens, w + 1)`` rows;
* **per-token time** at 4k, 16k, 32k: eager (transformers, ``DynamicCache``), exact and certified, on caches
  filled with the prompt's keys and values repeated (``bench_decode_models.filled_caches``), the median
  interval between steps inside one ``generate()`` of 8 tokens, and the KV MiB each holds.

``--dry-run``: the same code on the CPU, float32, a 2-layer model of width 64 with 4 heads, 40 + 20 tokens,
contexts 64 and 128. Rows go to ``<out>/results.md`` / ``results.csv``; exit status 1 when a check fails.
"""
from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import replace

import torch

from gpu_common import rel_error, synchronize  # noqa: E402  (puts the repository on sys.path)
from gpu_models import DRY, GPU, _attempt, _config, _describe, _ids, run_stage, stage_arguments  # noqa: E402
from gpu_rows import Recorder  # noqa: E402
import bench_decode_models as bench  # noqa: E402

TOL = 1e-3
SHAPES = {"gpu": (replace(GPU, prompt=1024, steps=48), (4096, 16384, 32768)),
          "dry": (replace(DRY, prompt=40, steps=20), (64, 128))}


def _stepwise(model, seq, P: int, cache):
    """Prefill ``seq[:, :P]`` on ``cache``, then one token at a time: logits of positions ``P - 1 ..`` (float64)."""
    with torch.no_grad():
        steps = [model(seq[:, :P], cache=cache, use_cache=True).logits[:, -1:].double()]
        for t in range(P, seq.shape[1]):
            steps.append(model(seq[:, t:t + 1], cache=cache, use_cache=True).logits.double())
    synchronize(seq.device.type)
    return torch.cat(steps, 1)


def _at_windows(model, windows):
    """``model`` patched to exact ALiBi cut at fixed per-layer windows (``windows[layer] [H]``): the windows a
    certified cache chose, as one forward computes them. (patch_alibi takes one window list for all layers.)"""
    from poslsh.integrations.hf import patch_alibi
    from poslsh.window import make_window

    patch_alibi(model, window=windows[0], backend=getattr(model, "_decode_backend", "auto"))
    layers = [m for m in model.modules() if getattr(m, "_poslsh_alibi", None) is not None]
    for m, w in zip(layers, windows):
        st = m._poslsh_alibi
        m._poslsh_alibi = replace(st, positional=make_window(st.slopes, torch.tensor(w)))
    return model


def decode(args) -> int:
    from transformers import BloomForCausalLM

    from poslsh.decoding import CertificateWarning
    from poslsh.integrations.hf import AppendCache, alibi_cache, alibi_stats, patch_alibi

    sh, contexts = SHAPES["dry" if args.dry_run else "gpu"]
    rec = Recorder(args.out, args.stage)
    P, T = sh.prompt, sh.steps
    rec.row("config", "info", n=P + T, detail=_describe(sh, "BloomForCausalLM") +
            f"; prefill {P} tokens, then {T} one at a time")
    torch.manual_seed(0)
    base = BloomForCausalLM(_config(sh)).eval()
    seq = _ids(sh, P + T, seed=3)
    oracle = copy.deepcopy(base).to(sh.device, torch.float64)
    with torch.no_grad():
        ref = oracle(seq).logits[:, P - 1:]
    model = patch_alibi(copy.deepcopy(base).to(sh.device, sh.dtype))
    failures = 0

    def judge(item, got, want, full):
        e, e_full = rel_error(got, want), rel_error(full, want)
        ok = e <= 3 * e_full + 1e-6 and bool(torch.isfinite(got).all())
        rec.row(item, "PASS" if ok else "FAIL", e, "rel err", n=P + T,
                detail=f"every step's logits; bound 3 x the one forward's {e_full:.2e} + 1e-6")

    def exact():
        with torch.no_grad():
            full = model(seq).logits[:, P - 1:]
        cache = AppendCache()
        judge("exact decoding (AppendCache) vs float64", _stepwise(model, seq, P, cache), ref, full)
        out = model.generate(seq[:, :P], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        made = getattr(out, "cache", None)
        rec.row("generate() decodes exact ALiBi on an AppendCache", "PASS" if isinstance(made, AppendCache) else
                "FAIL", n=P + 4, detail=f"cache {type(made).__name__}")
    _attempt(rec, "exact decoding", exact, P + T)

    def certified():
        patch_alibi(model, window="certified", tol=TOL)
        cache = alibi_cache(model)
        got = _stepwise(model, seq, P, cache)
        windows = [s["window"] for s in alibi_stats(model)]
        oracle.zero_grad(set_to_none=True)
        with torch.no_grad():
            want = _at_windows(patch_alibi(oracle), windows)(seq).logits[:, P - 1:]
            full = _at_windows(copy.deepcopy(base).to(sh.device, sh.dtype), windows)(seq).logits[:, P - 1:]
        judge(f"certified decoding (tol {TOL:g}) vs float64 at its windows", got, want, full)
        rec.row("certified vs float64 exact", "info", rel_error(got, ref), "rel err", n=P + T,
                detail=f"mean window {sum(map(sum, windows)) / sum(map(len, windows)):.0f} keys")
        stats = cache.stats()
        worst = max(s["certificate"]["worst"] for s in stats)
        over = sum(sum(s["certificate"]["exceeded"]) for s in stats)
        rec.row("certificate: worst dropped-mass bound", "info", worst, "", n=P + T,
                detail=f"{over} head-steps over tol {TOL:g} (policy warn), {stats[0]['certificate']['steps']} steps")
        want_kept = [[min(P + T, w + 1) for w in ws] for ws in windows]
        ok = cache.kept_keys().tolist() == want_kept
        rec.row("rows kept per KV head = min(tokens, window + 1)", "PASS" if ok else "FAIL", n=P + T,
                detail=f"layer 0 keeps {cache.kept_keys().tolist()[0]}")
    _attempt(rec, "certified decoding", certified, P + T)
    del oracle
    if sh.device == "cuda":
        torch.cuda.empty_cache()

    models = {"eager": copy.deepcopy(base).to(sh.device, sh.dtype), "exact": patch_alibi(model),
              "certified": patch_alibi(copy.deepcopy(base).to(sh.device, sh.dtype), window="certified", tol=TOL)}
    prompt = _attempt(rec, "keys, values and certified windows of a prompt", lambda: bench.from_prompt(
        models, sh.vocab, prompt=P), P)
    for L in contexts if prompt is not None else ():
        def timed(L=L):
            caches = bench.filled_caches(models, prompt[0], prompt[2], 1, L, True)
            ids = torch.randint(0, sh.vocab, (1, L + 1), generator=torch.Generator().manual_seed(L)).to(sh.device)
            for name in ("eager", "exact", "certified"):
                with warnings.catch_warnings():      # the certificate on repeated keys: timed, not judged here
                    warnings.simplefilter("ignore", CertificateWarning)
                    bench.decode_round(models[name], caches[name], ids, 2)             # warm-up
                    _, secs, _ = bench.decode_round(models[name], caches[name], ids, 8)
                rec.row(f"{name} decoding time", "ok", 1e3 * secs, "ms/token", n=L,
                        detail=f"{sh.layers} layers, batch 1; filled cache of {L} tokens holding "
                               f"{bench.kv_bytes(caches[name]) / 2 ** 20:.1f} MiB; median step in one generate()")
            del caches
            if sh.device == "cuda":
                torch.cuda.empty_cache()
        _attempt(rec, "decoding time", timed, L)
    return 1 if rec.failures or failures else 0


def main(argv=None) -> int:
    args = stage_arguments(__doc__, "decode", "CPU, float32, a tiny BLOOM", argv)
    return run_stage(args, "gpu_decode", "long-context decoding", decode)


if __name__ == "__main__":
    sys.exit(main())
