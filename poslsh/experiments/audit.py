"""``poslsh audit``: do the empirical quantities respect the paper's theorems?

Many independent trials (independent seeded partition draws), each check at a
stated confidence ``1 - delta``:

* **eq. (3)** ``||L* - M~||_max <= sqrt(log(2 n^2 / delta) / (2 s))``: per (sigma, s) the
  fraction of trials above the bound must be consistent with ``<= delta``.
* **eq. (4)** ``b_max <= 1 + sigma (3 ln(s / delta) + 2)``: same test for the largest
  block of the ``s`` partitions.
* **spectral decay**: the log-log slope of the mean ``||L* - M~||`` against ``s``
  (fitted on ``s >= 100``, where ``s >> log n``) must be ``-1/2 +- tol``; reported
  with the smallest constant ``C`` for which eq. (1) holds on these means.
* **Theorem 2.2 on real Q/K/V** (causal, per head): the smallest ``C`` that makes
  ``||T* - T~||_max <= 2 Delta_P / (beta*_P - Delta_P) ||V||_max`` hold, per draw
  (max over the draw's instances), its ``1 - delta`` quantile and max over draws;
  and the bound checked at ``C3 = sqrt(log(2n^2/delta) / (2 log(n/delta)))``, the
  constant that eq. (3) itself supplies (in the causal case ``||P||_{2,inf} = 1``,
  so ``Delta_P`` is exactly eq. (3)'s ``eps`` at ``C3``). Also the proof's
  deterministic step (eqs. 8-14) with the measured ``||L* - M~||_max``, which must
  hold in every trial.

"Consistent with ``<= delta``": the number of violations among ``T`` trials may
not exceed the 99.9% quantile of Binomial(``T``, ``delta``); a FAIL therefore
rejects "violation probability <= delta" at the 0.1% level.

A check that cannot run here (no model, no corpus, ``--skip-output``, no
convergence rows) is a SKIPPED row that says why, and the summary line counts
passed / failed / skipped. Rows computed from a convergence run's ``rows.csv`` name
that file in their ``source`` column (``committed`` when it is the reference under
``results/``): they were not produced by this run.

Outputs (git-ignored ``outputs/audit/``, ``outputs/audit/quick/`` for ``--quick``;
``--out results/audit`` refreshes the committed reference): ``audit.json``,
``audit.csv`` and ``audit.md`` (the table).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

from .. import theory
from ..alibi import alibi_sigmas
from ..analysis.qkv import attention_geometry, capture_qkv
from ..analysis.records import FIT_MIN_S, default_heads, fit_slope, input_records, mask_records
from ..io import atomic_write_text, csv_text
from ..partitions import sample_partitions
from ..seeding import stable_seed
from ..threads import intra_op_threads
from .audit_table import (AUTO_ROWS, TABLE_FIELDS, THIS_RUN, format_table, read_convergence_rows,
                          reused_source, skipped_row, summary_line, table_row)
from .command import Command, ConfigError
from .model_inputs import (InputsNotAvailable, ModelInputs, check_out_dir, input_segments, is_reference,
                           load_model, missing_prerequisites, query_heads)

__all__ = ["AuditConfig", "PRESETS", "allowed_violations", "c3_constant", "matrix_trials", "matrix_checks",
           "output_trials", "output_checks", "run", "write", "main", "format_table", "summary_line", "COMMANDS"]

CONFIDENCE_LEVEL = 0.999       # binomial test level for "violation rate <= delta"


@dataclass
class AuditConfig(ModelInputs):
    delta: float = 0.05                                 # confidence: every check is at level 1 - delta
    # matrix checks (no model needed)
    num_heads: int = 9                                  # ALiBi slopes for this head count (SmolLM2: 9)
    n_matrix: int = 1024                                # n for the matrix checks
    trials: int = 60                                    # independent draws for the matrix checks
    samples: Tuple[int, ...] = (1, 10, 100, 1000, 10000)  # s for the matrix checks
    slope_tol: float = 0.1                              # accepted |slope + 1/2| for the spectral decay
    fit_min_s: int = FIT_MIN_S                          # the slope is fitted on s >= this
    # Theorem 2.2 on real Q/K/V
    n_output: int = 2048                                # n for Theorem 2.2 on real Q/K/V
    inputs: int = 8                                     # real inputs for Theorem 2.2
    draws: int = 4                                      # independent draws per input
    output_samples: Tuple[int, ...] = (100, 1000, 10000)  # s for Theorem 2.2
    skip_output: bool = False                           # matrix checks only (no model needed)
    # also audit a convergence run's rows.csv ('' skips; auto: outputs/convergence/rows.csv when there, else the
    # committed results/convergence/rows.csv)
    convergence_rows: str = "auto"
    out: str = "outputs/audit"                          # output directory (results/audit: the reference)

    def check(self) -> None:
        self.check_inputs()
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")
        for name in ("num_heads", "n_matrix", "trials", "n_output", "inputs", "draws"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        for name in ("samples", "output_samples"):
            got = list(getattr(self, name))
            if not got or min(got) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: give sample sizes >= 1, got {got}")
        if self.heads is not None and max(self.heads) >= self.num_heads:
            raise ConfigError(f"--heads: {list(self.heads)} out of range for --num-heads {self.num_heads}")
        if self.convergence_rows not in ("", "auto") and not Path(self.convergence_rows).is_file():
            raise ConfigError(f"--convergence-rows: no such file {self.convergence_rows} ('' to skip, auto to "
                              f"use {' or '.join(AUTO_ROWS)} when there)")
        check_out_dir("--out", self.out)


PRESETS: Dict[str, AuditConfig] = {
    "default": AuditConfig(),
    "quick": AuditConfig(n_matrix=512, trials=20, samples=(1, 10, 100, 1000), n_output=1024, inputs=2, draws=2,
                         output_samples=(100, 1000), out="outputs/audit/quick"),
}


def allowed_violations(trials: int, delta: float, level: float = CONFIDENCE_LEVEL) -> int:
    """Largest violation count still consistent with a violation rate ``<= delta``:
    the ``level`` quantile of Binomial(``trials``, ``delta``)."""
    cdf = 0.0
    for k in range(trials + 1):
        cdf += math.comb(trials, k) * delta ** k * (1.0 - delta) ** (trials - k)
        if cdf >= level - 1e-12:
            return k
    return trials


def c3_constant(n: int, delta: float) -> float:
    """The ``C`` at which Theorem 2.2's ``Delta_P`` (with ``||P||_{2,inf} = 1``)
    equals eq. (3)'s deviation: ``sqrt(log(2 n^2 / delta) / (2 log(n / delta)))``."""
    return math.sqrt(math.log(2.0 * n * n / delta) / (2.0 * math.log(n / delta)))


# ============================================================ matrix checks
def matrix_trials(cfg: AuditConfig, sigmas: Sequence[float], progress=None) -> List[dict]:
    """:func:`~poslsh.analysis.records.mask_records` of ``cfg.trials`` independent
    draws for the bandwidths ``sigmas``: one record per (trial, head, s)."""
    rows = []
    sig = torch.tensor(list(sigmas), dtype=torch.float64)
    for t in range(cfg.trials):
        parts = sample_partitions(sig, max(cfg.samples), seed=stable_seed("audit-matrix", cfg.seed, t))
        rows.extend(mask_records(parts, cfg.n_matrix, cfg.samples, trial=t))
        if progress is not None:
            progress(1)
    return rows


def matrix_checks(rows: List[dict], cfg: AuditConfig, heads: Sequence[int]) -> Tuple[List[dict], dict]:
    """The eq. (3), eq. (4) and spectral-decay rows from :func:`matrix_trials` records."""
    n, delta = cfg.n_matrix, cfg.delta
    table, details = [], {"eq3": [], "eq4": [], "spectral": []}
    by = {}
    for r in rows:
        by.setdefault((r["head_index"], r["s"]), []).append(r)
    for hi, h in enumerate(heads):
        sigma = next(r["sigma"] for r in rows if r["head_index"] == hi)
        subject = f"head {h}, sigma={sigma:.3g}"
        viol3 = viol4 = trials = 0
        fail3 = fail4 = False
        worst3 = worst4 = 0.0
        means, ss = [], []
        for s in sorted(cfg.samples):
            rs = by[(hi, s)]
            T = len(rs)
            allowed = allowed_violations(T, delta)
            e3 = theory.max_norm_deviation_bound(n, s, delta)
            v3 = sum(r["max"] > e3 for r in rs)
            q3 = float(np.quantile([r["max"] for r in rs], 1 - delta))
            b4 = theory.block_size_bound(sigma, s, delta)
            v4 = sum(r["b_max"] > b4 for r in rs)
            q4 = float(np.quantile([r["b_max"] for r in rs], 1 - delta))
            worst3, worst4 = max(worst3, max(r["max"] for r in rs) / e3), max(worst4, max(r["b_max"] for r in rs) / b4)
            viol3, viol4, trials = viol3 + v3, viol4 + v4, trials + T
            fail3, fail4 = fail3 or v3 > allowed, fail4 or v4 > allowed
            spec = np.array([r["spectral"] for r in rs])
            means.append(float(spec.mean()))
            ss.append(s)
            details["eq3"].append(dict(head=h, sigma=sigma, s=s, trials=T, bound=e3, quantile=q3, violations=v3,
                                       allowed=allowed))
            details["eq4"].append(dict(head=h, sigma=sigma, s=s, trials=T, bound=b4, quantile=q4, violations=v4,
                                       allowed=allowed))
            details["spectral"].append(dict(head=h, sigma=sigma, s=s, trials=T, mean=float(spec.mean()),
                                            std=float(spec.std(ddof=1)) if T > 1 else 0.0,
                                            quantile=float(np.quantile(spec, 1 - delta)),
                                            eq1_C1=theory.spectral_expectation_bound(n, s, sigma, 1.0)))
        per_cell = allowed_violations(len(by[(hi, ss[0])]), delta)
        table.append(table_row("eq. (3) max-norm", subject, f"max ||L*-M~||max / eps3 = {worst3:.3f}",
                          f"eps3(n={n}, s, delta={delta:g})", trials, viol3, f"{per_cell}/cell", not fail3,
                          f"{len(ss)} values of s"))
        table.append(table_row("eq. (4) block size", subject, f"max b_max / bound = {worst4:.3f}",
                          "1 + sigma (3 ln(s/delta) + 2)", trials, viol4, f"{per_cell}/cell", not fail4))
        slope = fit_slope(ss, means, cfg.fit_min_s)
        c1 = max(m / theory.spectral_expectation_bound(n, s, sigma, 1.0) for s, m in zip(ss, means))
        ok = slope is not None and abs(slope + 0.5) <= cfg.slope_tol
        table.append(table_row("spectral decay (eq. 1/2)", subject,
                          "slope n/a" if slope is None else f"slope {slope:+.3f} (s >= {cfg.fit_min_s})",
                          f"-0.5 +- {cfg.slope_tol:g}", len(by[(hi, ss[0])]), "", "", ok,
                          f"eq. (1) holds on the means with any C >= {c1:.3g}"))
    return table, details


# ============================================================ Theorem 2.2
def output_trials(cfg: AuditConfig, progress=None) -> Tuple[List[dict], dict]:
    """Real Q/K/V instances x independent draws; one record per (input, draw, layer, head, s)."""
    model, tok = load_model(cfg)
    hq = attention_geometry(model)[0]
    heads, sigmas = query_heads(cfg, hq)
    segments = input_segments(cfg, tok, model.config.vocab_size, cfg.inputs, cfg.n_output)
    rows = []
    for i, seg in enumerate(segments):
        qkv = capture_qkv(model, seg.ids, cfg.layers, rope=cfg.rope)
        cache: dict = {}
        for dr in range(cfg.draws):
            parts = sample_partitions(torch.tensor(sigmas, dtype=torch.float64), max(cfg.output_samples),
                                      seed=stable_seed("audit-output", cfg.seed, i * 1000 + dr))
            for r in input_records(qkv, heads, sigmas, cfg.output_samples, parts, index=i, source=seg.source,
                                   spectral=False, cache=cache):
                r["draw"] = i * cfg.draws + dr
                rows.append(r)
            if progress is not None:
                progress(1)
    meta = dict(heads=heads, sigmas=sigmas, q_heads=hq, inputs=[s.source for s in segments])
    return rows, meta


def output_checks(rows: List[dict], n: int, delta: float, *, label: str = "",
                  source: str = THIS_RUN) -> Tuple[List[dict], List[dict]]:
    """Theorem 2.2 rows (per head) from attention records with fields ``t_err``,
    ``beta_star``, ``p_2inf``, ``v_max``, ``max``, ``s``, ``draw``; ``source`` says
    where the records come from."""
    c3 = c3_constant(n, delta)
    smin = math.log(n / delta)
    table, details = [], []
    heads = sorted({(r["sigma"], r["head"]) for r in rows})
    for sigma, h in heads:
        rs = [r for r in rows if r["head"] == h and r["s"] >= smin]
        if not rs:
            continue
        per_draw: Dict[int, float] = {}
        det_viol = 0
        c3_viol_draws = set()
        applicable = 0
        for r in rs:
            c, _ = theory.smallest_constant(r["t_err"], r["beta_star"], r["p_2inf"], r["v_max"], sigma, n, r["s"],
                                            delta)
            per_draw[r["draw"]] = max(per_draw.get(r["draw"], 0.0), c)
            # the proof's deterministic step with the measured max-norm error (eqs. 8, 10, 12-14)
            dm = r["max"]
            if dm < r["beta_star"] and r["t_err"] > 2 * dm / (r["beta_star"] - dm) * r["v_max"] * (1 + 1e-9) + 1e-12:
                det_viol += 1
            b = theory.output_error_bound(r["beta_star"], r["p_2inf"], r["v_max"], sigma, n, r["s"], delta, c3)
            if math.isfinite(b):
                applicable += 1
                if r["t_err"] > b:
                    c3_viol_draws.add(r["draw"])
        cs = np.array(list(per_draw.values()))
        D = len(per_draw)
        allowed = allowed_violations(D, delta)
        subject = f"head {h}, sigma={sigma:.3g}"
        q = float(np.quantile(cs, 1 - delta))
        table.append(table_row(f"Thm 2.2 output bound{label}", subject,
                          f"smallest C: q{int(round(100 * (1 - delta)))} {q:.3g}, max {cs.max():.3g}",
                          f"C3 = {c3:.3f} (from eq. 3)", D, len(c3_viol_draws), allowed,
                          len(c3_viol_draws) <= allowed,
                          f"bound finite in {applicable}/{len(rs)} instances; "
                          f"median beta* {np.median([r['beta_star'] for r in rs]):.2g}", source))
        ratios = [_det_ratio(r) for r in rs if r["max"] < r["beta_star"]]
        table.append(table_row(f"Thm 2.2 deterministic step{label}", subject,
                          f"max err/bound = {max(ratios):.3g}" if ratios else "never applicable",
                          "eqs. (8)-(14) with measured ||L*-M~||max", len(ratios), det_viol, 0, det_viol == 0,
                          f"applicable (||L*-M~||max < beta*) in {len(ratios)}/{len(rs)} instances", source))
        details.append(dict(head=h, sigma=sigma, n=n, draws=D, C3=c3, C_quantile=q, C_max=float(cs.max()),
                            C_median=float(np.median(cs)), c3_violations=len(c3_viol_draws), allowed=allowed,
                            applicable=applicable, instances=len(rs), deterministic_violations=det_viol))
    return table, details


def _det_ratio(r) -> float:
    dm = r["max"]
    b = 2 * dm / (r["beta_star"] - dm) * r["v_max"]
    return r["t_err"] / b if b > 0 else (0.0 if r["t_err"] == 0 else float("inf"))


# ============================================================ run
def run(cfg: AuditConfig, *, log: Callable[[str], None] = lambda msg: None) -> dict:
    """All checks; returns the ``audit.json`` dict (``table``: one row per check,
    ``passed``: no FAIL, ``counts``: passed / failed / skipped rows). ``log`` gets a
    line per phase; progress goes to stderr."""
    cfg.check()
    with intra_op_threads(cfg.threads), torch.no_grad():
        return _run(cfg, log)


def _run(cfg: AuditConfig, log) -> dict:
    from tqdm import tqdm

    t0 = time.time()
    heads = list(cfg.heads) if cfg.heads is not None else default_heads(cfg.num_heads)
    sig_all = alibi_sigmas(cfg.num_heads)
    sigmas = [float(sig_all[h]) for h in heads]
    log(f"audit: delta={cfg.delta}, matrix checks n={cfg.n_matrix} x {cfg.trials} trials, heads {heads} "
        f"(sigma {[round(x, 3) for x in sigmas]}), s {list(cfg.samples)}")
    # said before the matrix trials, so a missing model is news now, not after them
    skip = "not asked for (--skip-output)" if cfg.skip_output else "; ".join(missing_prerequisites(cfg))
    if skip:
        log(f"audit: Theorem 2.2 on real Q/K/V will be SKIPPED: {skip}")
    bar = tqdm(total=cfg.trials, desc="audit: matrix trials", unit="trial", file=sys.stderr, mininterval=2.0)
    mrows = matrix_trials(cfg, sigmas, progress=bar.update)
    bar.close()
    for r in mrows:
        r["head"] = heads[r["head_index"]]
    table, mdetails = matrix_checks(mrows, cfg, heads)
    result = dict(config=dataclasses.asdict(cfg), heads=heads, sigmas=sigmas, matrix=mdetails, output=None,
                  output_from_convergence=None)
    t_matrix = time.time() - t0
    table += [skipped_row("Thm 2.2 output bound", skip)] if skip else _real_qkv_checks(cfg, result, log, tqdm)
    table += _reused_checks(cfg, result, log)
    result["table"] = table
    result["counts"] = {k: sum(r["result"] == v for r in table)
                        for k, v in (("passed", "PASS"), ("failed", "FAIL"), ("skipped", "SKIPPED"))}
    result["passed"] = result["counts"]["failed"] == 0
    result["timing"] = dict(total_s=time.time() - t0, matrix_s=t_matrix)
    return result


def _real_qkv_checks(cfg: AuditConfig, result: dict, log, tqdm) -> List[dict]:
    """Theorem 2.2 on Q/K/V computed by this run (or one SKIPPED row saying why not)."""
    check = "Thm 2.2 output bound"
    log(f"audit: Theorem 2.2 on real Q/K/V, n={cfg.n_output}, {cfg.inputs} inputs x {cfg.draws} draws, "
        f"layers {list(cfg.layers)}, s {list(cfg.output_samples)}")
    bar = tqdm(total=cfg.inputs * cfg.draws, desc="audit: real Q/K/V", unit="draw", file=sys.stderr,
               mininterval=2.0)
    try:
        orows, meta = output_trials(cfg, progress=bar.update)
    except InputsNotAvailable as e:      # removed since the check above: the matrix checks still stand
        return [skipped_row(check, str(e))]
    finally:
        bar.close()
    otable, odetails = output_checks(orows, cfg.n_output, cfg.delta)
    result["output"] = dict(meta=meta, heads=odetails)
    smin = math.log(cfg.n_output / cfg.delta)
    return otable or [skipped_row(check, f"no --output-samples s >= log(n/delta) = {smin:.1f}")]


def _reused_checks(cfg: AuditConfig, result: dict, log) -> List[dict]:
    """Theorem 2.2 on a convergence run's ``rows.csv`` (labelled as reused), or SKIPPED."""
    check = "Thm 2.2 output bound [convergence run]"
    if not cfg.convergence_rows:
        return [skipped_row(check, "not asked for (--convergence-rows '')")]
    path = next((p for p in AUTO_ROWS if Path(p).is_file()), None) if cfg.convergence_rows == "auto" \
        else cfg.convergence_rows
    got = read_convergence_rows(Path(path)) if path else None
    if got is None:
        return [skipped_row(check, f"no convergence rows ({path or ' or '.join(AUTO_ROWS)} missing or empty): "
                                "run `poslsh convergence` first")]
    source = reused_source(path)
    log(f"audit: Theorem 2.2 on the rows of a convergence run {source}")
    crow, n_c = got
    ctable, cdetails = output_checks(crow, n_c, cfg.delta, label=f" [convergence run, n={n_c}]", source=source)
    result["output_from_convergence"] = dict(path=str(path), source=source, heads=cdetails)
    return ctable or [skipped_row(check, f"{path} has no s >= log(n/delta)")]


def write(result: dict, out) -> Path:
    """``audit.csv``, ``audit.md`` (the table) and ``audit.json`` under ``out``, atomically."""
    out = Path(out)
    atomic_write_text(out / "audit.csv", csv_text(result["table"], TABLE_FIELDS, float_format=".9g"))
    atomic_write_text(out / "audit.md", format_table(result["table"], markdown=True) + "\n")
    atomic_write_text(out / "audit.json", json.dumps(result, indent=1, default=float))
    return out


def main(cfg: AuditConfig) -> int:
    """Run, write and print the table; exit code 1 when a check FAILs."""
    result = run(cfg, log=print)
    out = write(result, cfg.out)
    print(format_table(result["table"]))
    ref = " (the committed reference results: review with git diff)" if is_reference(out) else ""
    print(f"{summary_line(result)} ({result['timing']['total_s']:.0f} s) -> {out}{ref}")
    return 0 if result["passed"] else 1


COMMANDS = [Command(name="audit", help="check the empirical errors against Theorems 2.1/2.2 (pass/fail table)",
                    config=AuditConfig, presets=PRESETS, default_preset="default", main=main)]
