"""``poslsh frontier``: positional LSH against its honest rival, exact ALiBi cut at a per-head
window, at equal cost (keys per query) and equal CPU time, on a real model's Q/K/V and on random ones.

For every length ``n``, input (real text through SmolLM2's layers, pre-RoPE; or Gaussian Q/K/V
with a given logit std) and query head (ALiBi ``sigma_h`` for the model's head count) it measures,
against exact ALiBi attention in float64 (:mod:`~poslsh_paper.experiments.frontier_methods`):

* positional LSH, i.i.d. and grouped, for every ``s`` (one softmax with the counts);
* the window ``w_h = round(c sigma_h)`` over a grid of ``c``, and the *cost-matched* window whose mean
  keys per query equals positional LSH's at that ``s``, head by head (``window@iid s=10``);
* the hybrid: an exact band plus an importance-sampled sparse tail holding a share of the same keys
  (``hybrid 0.5@iid s=10``);

their errors (max, mean absolute, relative Frobenius), their keys per query, and (``timing``) each
method's CPU time on the torch backend: ``poslsh_attention(backend="torch")`` and
``windowed_alibi_attention(backend="torch")`` when that backend serves the window op (else the
time is recorded as missing, with the reason). Errors never depend on a backend.

Draws: positional LSH partitions and hybrid keeps are seeded per (length, draw) and shared by the
inputs of that length (i.i.d.: one nested draw of ``max(s)``; grouped: one draw per ``s``); windows
are deterministic. Every input is checkpointed (``checkpoints/``) so an interrupted run resumes;
``--only-timing`` re-times the methods of an existing ``frontier.json`` and rewrites the outputs
without recomputing an error (``--only-write``: rewrites them only). Outputs (``outputs/frontier/``; ``--out results/frontier`` refreshes
the committed reference): ``frontier.md``, ``frontier.csv``, ``frontier_heads.csv``,
``frontier.json``, ``frontier.png``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List

import torch

from poslsh import theory
from poslsh.alibi import alibi_sigmas
from poslsh.seeding import generator, stable_seed
from poslsh.threads import intra_op_threads
from poslsh_paper.analysis.records import sampler_draws
from poslsh_paper.experiments import frontier_methods as fm
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.frontier_config import PRESETS, VERSION, FrontierConfig  # noqa: F401  (re-exported)
from poslsh_paper.experiments.model_inputs import (InputsNotAvailable, input_segments, load_model,
                                                   missing_prerequisites, reference_note)
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.io import atomic_write_text

__all__ = ["FrontierConfig", "FrontierResult", "PRESETS", "run", "write", "main", "method_plan"]

@dataclass
class FrontierResult:
    report: dict     # frontier.json: config, machine, inputs, heads (per-head summary), timing


# ============================================================ methods of one length
def _samplers_draws(cfg: FrontierConfig, sigmas: List[float], n: int, draw: int):
    return {sp: sampler_draws(sigmas, cfg.samples, sp, ("frontier", cfg.seed, n, draw)) for sp in cfg.samplers}


def method_plan(cfg: FrontierConfig, sigmas: List[float], n: int, draws: int) -> Dict[str, dict]:
    """Every method's parameters at length ``n``, per head (input independent): ``{label: spec}``
    with ``spec['w']`` / ``spec['w0']``, ``spec['hc']`` lists over heads; positional LSH's mean keys
    per query (``spec['keys']``, mean over the draws) set the cost-matched windows and hybrids."""
    plan: Dict[str, dict] = {}
    H = len(sigmas)
    for d in range(draws):
        for sampler, pairs in _samplers_draws(cfg, sigmas, n, d).items():
            for sizes, parts in pairs:
                for s in sizes:
                    spec = plan.setdefault(f"{sampler} s={s}", dict(family=sampler, sampler=sampler, s=s,
                                                                    keys=[0.0] * H))
                    for h in range(H):
                        back, fwd = fm.block_reach(parts, h, s, n)
                        spec["keys"][h] += fm.poslsh_keys(back, fwd, cfg.causal) / draws
    for c in cfg.window_c:
        plan[f"window c={c:g}"] = dict(family="window-c", c=c, w=[min(n - 1, round(c * x)) for x in sigmas])
    for sampler in cfg.samplers:
        for s in cfg.samples:
            keys = plan[f"{sampler} s={s}"]["keys"]
            plan[f"window@{sampler} s={s}"] = dict(family="window", sampler=sampler, s=s,
                                                   w=[fm.match_window(k, n, cfg.causal) for k in keys])
    base = cfg.samplers[0]
    for share in cfg.hybrid_shares:
        for s in cfg.samples:
            pairs = [fm.match_hybrid(k, x, share, n, cfg.causal) for k, x in zip(plan[f"{base} s={s}"]["keys"], sigmas)]
            plan[f"hybrid {share:g}@{base} s={s}"] = dict(family="hybrid", sampler=base, s=s, share=share,
                                                          w0=[p[0] for p in pairs], hc=[p[1] for p in pairs])
    return plan


def _head_methods(cfg: FrontierConfig, plan: Dict[str, dict], sigmas: List[float], h: int, n: int, draws: int):
    """``[(label, draw, Method)]`` of head ``h``: windows once, random methods once per draw."""
    out = [(lab, 0, fm.alibi_method(sigmas[h], n, cfg.causal, sp["w"][h]))
           for lab, sp in plan.items() if sp["family"] in ("window-c", "window")]
    for d in range(draws):
        for sampler, pairs in _samplers_draws(cfg, sigmas, n, d).items():
            for sizes, parts in pairs:
                for s in sizes:
                    out.append((f"{sampler} s={s}", d, fm.count_method(*fm.block_reach(parts, h, s, n), cfg.causal)))
        for lab, sp in plan.items():
            if sp["family"] == "hybrid":
                gen = generator("frontier-hybrid", cfg.seed, n, d, lab, h)
                out.append((lab, d, fm.hybrid_method(sigmas[h], cfg.causal, sp["w0"][h], sp["hc"][h], gen)))
    return out


# ============================================================ inputs
def _units(cfg: FrontierConfig, ni: int, n: int, model, tok, geometry) -> List[dict]:
    """The inputs of length ``n``: ``{source, index, load}`` (``load() -> {source: (q, k, v)}``)."""
    units = []
    if cfg.per_length(cfg.real_inputs, ni):
        from poslsh_paper.analysis.qkv import capture_qkv
        segs = input_segments(cfg, tok, model.config.vocab_size, cfg.per_length(cfg.real_inputs, ni), n)
        for i, seg in enumerate(segs):
            def load(seg=seg):
                got = capture_qkv(model, seg.ids, cfg.layers, rope=cfg.rope)
                return {f"layer {L}": (got[L].q, got[L].k, got[L].v) for L in cfg.layers}
            units.append(dict(sources=[f"layer {L}" for L in cfg.layers], index=i, text=seg.source, load=load))
    hq, hkv, d = geometry
    for std in cfg.random_logit_std:
        for i in range(cfg.per_length(cfg.random_inputs, ni)):
            def load(std=std, i=i):
                g = generator("frontier-random", cfg.seed, n, std, i)
                a = math.sqrt(std)                      # logit std = a^2 for scale 1/sqrt(d)
                return {f"random std {std:g}": (torch.randn(hq, n, d, generator=g) * a,
                                                torch.randn(hkv, n, d, generator=g) * a,
                                                torch.randn(hkv, n, d, generator=g))}
            units.append(dict(sources=[f"random std {std:g}"], index=i, text=f"gaussian:{std:g}:{i}", load=load))
    return units


def _evaluate_unit(cfg, plan, sigmas, heads, n, draws, qkv: dict, unit: dict, bar) -> List[dict]:
    rows = []
    for source, (q, k, v) in qkv.items():
        group = q.shape[0] // k.shape[0]
        for hi, h in enumerate(heads):
            methods = _head_methods(cfg, plan, sigmas, hi, n, draws)
            res, head = fm.evaluate_head(q[h], k[h // group], v[h // group], sigmas[hi], [m for _, _, m in methods],
                                         causal=cfg.causal, chunk=cfg.chunk)
            for (label, draw, method), r in zip(methods, res):
                spec = plan[label]
                row = dict(n=n, source=source, input=unit["index"], head=h, sigma=sigmas[hi], label=label,
                           family=spec["family"], s=spec.get("s"), draw=draw, **r, **head)
                for key in ("w", "w0", "hc"):
                    if key in spec:
                        row[key] = spec[key][hi]
                if "w" in spec:
                    row["bound"] = float(theory.window_error_bound(spec["w"][hi], sigmas[hi], head["logit_range"],
                                                                   causal=cfg.causal, n=n))
                rows.append(row)
            bar.update(1)
    return rows


# ============================================================ the run
def run(cfg: FrontierConfig, *, log: Callable[[str], None] = lambda msg: None) -> FrontierResult:
    """Measure (or resume) every input, then time; ``--only-timing``: re-time an existing report."""
    cfg.check()
    from poslsh_paper.experiments import frontier_timing
    with intra_op_threads(cfg.threads), torch.no_grad():
        if cfg.only_timing or cfg.only_write:
            flag = "--only-timing" if cfg.only_timing else "--only-write"
            path = Path(cfg.out) / "frontier.json"
            if not path.is_file():
                raise ConfigError(f"{flag}: no {path} to reuse; run without {flag} first")
            report = json.loads(path.read_text())
            if cfg.only_timing:
                report["timing"] = frontier_timing.time_methods(report, cfg.timing_rounds, log)
            return FrontierResult(report)
        cfg = _without_missing_inputs(cfg, log)
        report = _run(cfg, log)
        if cfg.timing:
            report["timing"] = frontier_timing.time_methods(report, cfg.timing_rounds, log)
        return FrontierResult(report)


def _without_missing_inputs(cfg: FrontierConfig, log) -> FrontierConfig:
    """``cfg`` when its real-text inputs can run here (or it has none); without them when SmolLM2 or
    the corpus is missing and ``--if-missing random`` (one line says so); else one line naming what
    to install and every way to run without it (:class:`InputsNotAvailable`)."""
    missing = missing_prerequisites(cfg) if any(cfg.real_inputs) else []
    if not missing:
        return cfg
    if cfg.if_missing == "random" and cfg.random_logit_std and any(cfg.random_inputs):
        log(f"frontier: no real-text inputs on this machine ({'; '.join(missing)}): measuring random Q/K/V only "
            "(--real-inputs 0); --if-missing stop refuses instead")
        return replace(cfg, real_inputs=(0,))
    raise InputsNotAvailable("; ".join(missing) + "; or measure random Q/K/V only, with neither model nor corpus: "
                             "--real-inputs 0")


def _run(cfg: FrontierConfig, log) -> dict:
    from tqdm import tqdm

    from poslsh_paper.experiments.frontier_table import head_summary
    t0, load0 = time.time(), os.getloadavg()
    model = tok = None
    geometry = tuple(cfg.random_geometry)
    if any(cfg.real_inputs):
        from poslsh_paper.analysis.qkv import attention_geometry
        model, tok = load_model(cfg)
        geometry = attention_geometry(model)
    hq = geometry[0]
    heads = list(cfg.heads) if cfg.heads is not None else list(range(hq))
    if any(not 0 <= h < hq for h in heads):
        raise ConfigError(f"--heads: {heads} out of range, there are {hq} query heads")
    sigmas = [float(x) for x in alibi_sigmas(hq)[heads]]
    ckpt = Path(cfg.checkpoints or Path(cfg.out) / "checkpoints")
    ckpt.mkdir(parents=True, exist_ok=True)
    log(f"frontier: n {list(cfg.lengths)}, heads {heads} (sigma {[round(x, 2) for x in sigmas]}), s {list(cfg.samples)}, "
        f"samplers {list(cfg.samplers)}, window c {list(cfg.window_c)}, hybrid shares {list(cfg.hybrid_shares)} "
        f"-> {cfg.out}")
    rows, plans, inputs, computed, loads = [], {}, [], 0, []
    for ni, n in enumerate(cfg.lengths):
        draws = cfg.per_length(cfg.draws, ni)
        plan = plans[n] = method_plan(cfg, sigmas, n, draws)
        fp = cfg.unit_fingerprint(n, draws)
        units = _units(cfg, ni, n, model, tok, geometry)
        bar = tqdm(total=sum(len(u["sources"]) for u in units) * len(heads), desc=f"frontier n={n}", unit="head",
                   file=sys.stderr, mininterval=5.0)
        for u in units:
            inputs.append(dict(n=n, sources=u["sources"], index=u["index"], text=u["text"]))
            path = ckpt / f"n{n}-{stable_seed(*u['sources'], u['text'])}.json"
            data = None
            if cfg.resume and path.is_file():
                data = json.loads(path.read_text())
                data = data if data.get("fingerprint") == fp and data.get("text") == u["text"] else None
            if data is None:
                t1 = time.time()
                data = dict(fingerprint=fp, text=u["text"], seconds=0.0,
                            rows=_evaluate_unit(cfg, plan, sigmas, heads, n, draws, u["load"](), u, bar))
                data["seconds"] = time.time() - t1
                atomic_write_text(path, json.dumps(data))
                computed += 1
                loads.append(os.getloadavg()[0])
            else:
                bar.update(len(u["sources"]) * len(heads))
            rows.extend(data["rows"])
        bar.close()
    return dict(config={**config_to_dict(cfg), "heads": heads, "sigmas": sigmas},
                geometry=list(geometry), inputs=inputs,
                plans={str(n): p for n, p in plans.items()}, heads=head_summary(rows),
                machine=dict(cpus=os.cpu_count(), threads=torch.get_num_threads(), load_start=list(load0),
                             load_end=list(os.getloadavg()), load_samples=loads, seconds=time.time() - t0,
                             computed_inputs=computed,
                             resumed_inputs=len(inputs) - computed, torch=torch.__version__))


# ============================================================ output
def write(result: FrontierResult, out, *, plot: bool = True) -> Path:
    """``frontier.md`` / ``.csv`` / ``_heads.csv`` / ``.json`` (and ``.png``) under ``out``, atomically."""
    from poslsh_paper.experiments import frontier_table as table
    out = Path(out)
    report = result.report
    summary = table.summary(report["heads"], report.get("timing"))
    atomic_write_text(out / "frontier.csv", table.csv_of(summary))
    atomic_write_text(out / "frontier_heads.csv", table.csv_of(report["heads"]))
    atomic_write_text(out / "frontier.md", table.markdown(report, summary))
    if plot:
        table.plot(report, summary, out / "frontier.png")
    atomic_write_text(out / "frontier.json", json.dumps(_rounded(report), separators=(",", ":")))
    return out


def _rounded(x):
    """Floats to 7 significant digits (far below any measured difference): a smaller report."""
    if isinstance(x, float):
        return float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return [_rounded(v) for v in x] if isinstance(x, list) else x


def main(cfg: FrontierConfig) -> int:
    from poslsh_paper.experiments.frontier_table import comparison_text
    result = run(cfg, log=print)
    out = write(result, cfg.out, plot=cfg.plot)
    print(comparison_text(result.report))
    print(f"wrote {out}{reference_note(out)}")
    return 0
