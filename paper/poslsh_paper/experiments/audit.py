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

Every check runs for each sampler of ``--samplers`` against that sampler's own bound
(rows of a correlated sampler say ``[grouped]`` etc.): eq. (3) and Theorem 2.2 with
its number of independent groups ``G`` in place of ``s`` (i.i.d.: ``G = s``, the
paper's bounds verbatim), see :mod:`poslsh_paper.experiments.audit_output`.

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
import textwrap
import time
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import numpy as np
import torch

from poslsh import theory
from poslsh.alibi import alibi_sigmas
from poslsh_paper.analysis.records import default_heads, fit_slope, mask_records, sampler_draws
from poslsh_paper.io import atomic_write_text, csv_text
from poslsh.threads import intra_op_threads
from poslsh_paper.experiments.audit_output import allowed_violations, c3_constant, output_checks, output_trials, units
from poslsh_paper.experiments.audit_config import COMMANDS, PRESETS, AuditConfig, auto_rows
from poslsh_paper.experiments.audit_table import (TABLE_FIELDS, format_table, format_report, read_convergence_rows,
                                                  reused_source, skipped_row, summary_line, table_row)
from poslsh_paper.experiments.model_inputs import InputsNotAvailable, missing_prerequisites, reference_note

__all__ = ["AuditConfig", "PRESETS", "allowed_violations", "c3_constant", "matrix_trials", "matrix_checks",
           "output_trials", "output_checks", "run", "write", "main", "format_table", "format_report", "summary_line",
           "COMMANDS"]

# ============================================================ matrix checks
def matrix_trials(cfg: AuditConfig, sigmas: Sequence[float], progress=None) -> List[dict]:
    """:func:`~poslsh_paper.analysis.records.mask_records` of ``cfg.trials`` independent
    draws per sampler for the bandwidths ``sigmas``: one record per (trial, sampler, head, s)."""
    rows = []
    for t in range(cfg.trials):
        for sampler in cfg.samplers:
            for sizes, parts in sampler_draws(sigmas, cfg.samples, sampler, ("audit-matrix", cfg.seed, t)):
                rows.extend(mask_records(parts, cfg.n_matrix, sizes, trial=t, sampler=sampler))
        if progress is not None:
            progress(1)
    return rows


def matrix_checks(rows: List[dict], cfg: AuditConfig, heads: Sequence[int]) -> Tuple[List[dict], dict]:
    """The eq. (3), eq. (4) and spectral-decay rows from :func:`matrix_trials` records, per
    sampler, each against its own bound: eq. (3) with the sampler's independent groups
    ``G`` (``s`` for i.i.d.); eq. (4) as is (its union bound ``P(b_max > x) <= s P(b > x)``
    holds for every sampler: a stratum of probability ``k_g / s`` exceeds ``x`` with
    probability at most ``s / k_g`` times the tail); the spectral slope ``-1/2 +- tol``
    for i.i.d. masks, at most ``-1/2 + tol`` (no slower) for correlated ones."""
    table, details = [], {"eq3": [], "eq4": [], "spectral": []}
    for sampler in dict.fromkeys(r.get("sampler", "iid") for r in rows):
        sub = [r for r in rows if r.get("sampler", "iid") == sampler]
        t, d = _matrix_checks(sub, cfg, heads, "" if sampler == "iid" else f" [{sampler}]")
        table += t
        for k in details:
            details[k] += [dict(sampler=sampler, **x) for x in d[k]]
    return table, details


def _matrix_checks(rows: List[dict], cfg: AuditConfig, heads: Sequence[int], tag: str) -> Tuple[List[dict], dict]:
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
            e3 = theory.grouped_max_norm_deviation_bound(n, units(rs[0]), delta)
            v3 = sum(r["max"] > e3 for r in rs)
            q3 = float(np.quantile([r["max"] for r in rs], 1 - delta))
            b4 = theory.block_size_bound(num_samples=s, sigma=sigma, delta=delta)
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
        per = "s" if not tag else "G groups"
        table.append(table_row(f"eq. (3) max-norm{tag}", subject, f"max ||L*-M~||max / eps3 = {worst3:.3f}",
                               f"eps3(n={n}, {per}, delta={delta:g})", trials, viol3, f"{per_cell}/cell", not fail3,
                               f"{len(ss)} values of s"))
        table.append(table_row(f"eq. (4) block size{tag}", subject, f"max b_max / bound = {worst4:.3f}",
                               "1 + sigma (3 ln(s/delta) + 2)", trials, viol4, f"{per_cell}/cell", not fail4))
        slope = fit_slope(ss, means, cfg.fit_min_s)
        c1 = max(m / theory.spectral_expectation_bound(n, s, sigma, 1.0) for s, m in zip(ss, means))
        ok = slope is not None and (abs(slope + 0.5) <= cfg.slope_tol if not tag else slope <= -0.5 + cfg.slope_tol)
        table.append(table_row(f"spectral decay (eq. 1/2){tag}", subject,
                               "slope n/a" if slope is None else f"slope {slope:+.3f} (s >= {cfg.fit_min_s})",
                               f"-0.5 +- {cfg.slope_tol:g}" if not tag else f"<= -0.5 + {cfg.slope_tol:g}",
                               len(by[(hi, ss[0])]), "", "", ok,
                               f"eq. (1) holds on the means with any C >= {c1:.3g}"))
    return table, details


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
        f"(sigma {[round(x, 3) for x in sigmas]}), s {list(cfg.samples)}, samplers {list(cfg.samplers)}")
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
    log(f"audit: Theorem 2.2 on real Q/K/V, n={cfg.n_output}, {cfg.num_inputs} inputs x {cfg.draws} draws, "
        f"layers {list(cfg.layers)}, s {list(cfg.output_samples)}")
    bar = tqdm(total=cfg.num_inputs * cfg.draws, desc="audit: real Q/K/V", unit="draw", file=sys.stderr,
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
    path = auto_rows() if cfg.convergence_rows == "auto" else cfg.convergence_rows
    got = read_convergence_rows(Path(path)) if path else None
    if got is None:
        return [skipped_row(check, f"no convergence rows ({path or 'outputs/convergence/ and results/convergence/'}"
                                   " missing or empty): run `poslsh convergence` first")]
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


def _say(line: str) -> None:
    """Print ``line`` wrapped to 100 columns (continuation lines indented)."""
    print("\n".join(textwrap.wrap(line, 100, subsequent_indent="    ", break_on_hyphens=False)))


def main(cfg: AuditConfig) -> int:
    """Run, write and print the report (one block per check, <= 100 columns; the full table is
    in audit.md / audit.csv); exit code 1 when a check FAILs."""
    result = run(cfg, log=_say)
    out = write(result, cfg.out)
    print(format_report(result["table"]))
    _say(f"{summary_line(result)} ({result['timing']['total_s']:.0f} s) -> {out}{reference_note(out)}")
    return 0 if result["passed"] else 1
