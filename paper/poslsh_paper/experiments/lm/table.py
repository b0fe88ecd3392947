"""The length-extrapolation table: every method x seed of a preset, aggregated.

:func:`run_table` trains each missing run (resuming interrupted ones; in parallel
subprocesses with ``jobs > 1``; the runner is :mod:`poslsh_paper.experiments.sweep`), then writes ``<results>/<preset>/table.md``,
``table.csv`` and ``table.json``: mean +- sample std over seeds per method and
length, and the paper's claims checked against the numbers (:func:`findings`). A packed
table may hold unpacked runs of the same set-up beside its own (``--include-runs``, see
:mod:`.include`): rows are per method and packing.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from poslsh.threads import intra_op_threads
from poslsh_paper.io import atomic_write_text, markdown_table
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.experiments.sweep import (Cell, Launch, Sweep, mean_std, read_json, threads_per_job, train_all,
                                            write_table_files)
from poslsh_paper.experiments.lm.config import (TrainConfig, config_differences, describe_differences, layout_name,
                                                method_label, run_dir)
from poslsh_paper.experiments.lm.include import describe, include_runs, included_note
from poslsh_paper.experiments.paths import inside
from poslsh_paper.experiments.lm.findings import findings, get, lengths_of
from poslsh_paper.experiments.lm.loop import estimate_minutes, train
from poslsh_paper.experiments.lm.model import build_model

__all__ = ["aggregate", "findings", "render_markdown", "write_table", "run_table", "table_sweep", "dry_run",
           "table_dir", "describe"]

# Why a run of the grid is not in the table, and what to do (the list of runs follows).
LEFT_OUT = ("{n} run(s) of this table's methods and seeds were trained with another config than this table's and are "
            "not in it (retrain them with `poslsh train ... --overwrite`, or point --runs-dir elsewhere)")

CSV_FIELDS = ["method", "label", "pack", "length", "context", "seeds", "ppl_mean", "ppl_std", "acc_mean", "acc_std"]


# ----------------------------------------------------------------- aggregation
def aggregate(results: List[dict], methods: Sequence[str]) -> List[dict]:
    """One row per (method, packing, length) of the runs' ``result.json``: mean and sample std
    over seeds. A run without ``pack`` (made before packing existed) was not packed; packed rows
    of a table that holds both are labelled so."""
    rows = []
    both = len({bool(r.get("pack", False)) for r in results}) > 1
    for m in methods:
        for pack in (False, True):
            runs = [r for r in results if r["method"] == m and bool(r.get("pack", False)) == pack and r.get("eval")]
            if not runs:
                continue
            label = method_label(m) + (", packed" if pack and both else ", unpacked" if both else "")
            for k in runs[0]["eval"]:
                ppl, ppl_sd = mean_std([r["eval"][k]["ppl"] for r in runs])
                acc, acc_sd = mean_std([r["eval"][k]["acc"] for r in runs])
                rows.append({"method": m, "label": label, "pack": pack, "length": k,
                             "context": runs[0]["eval"][k]["context"], "seeds": len(runs), "ppl_mean": ppl,
                             "ppl_std": ppl_sd, "acc_mean": acc, "acc_std": acc_sd,
                             "ppl_by_seed": {r["seed"]: r["eval"][k]["ppl"] for r in runs}})
    return rows


# ------------------------------------------------------------------- rendering
def render_markdown(rows: List[dict], meta: dict) -> str:
    """``table.md``: title, command/setup/evaluation notes, the table, the checked findings."""
    lengths = lengths_of(rows)
    ctx = {r["length"]: r["context"] for r in rows}
    head = ["Method", "Seeds"]
    for i, k in enumerate(lengths):
        head += [f"PPL @{ctx[k]}{' (training)' if i == 0 else ' (extrapolation)'}", f"Acc % @{ctx[k]}"]
    body = []
    for m, pack in dict.fromkeys((r["method"], r.get("pack", False)) for r in rows):
        mine = [r for r in rows if (r["method"], r.get("pack", False)) == (m, pack)]
        n_seeds = get(mine, m, lengths[0], "seeds")
        cells = [mine[0].get("label") or method_label(m), str(n_seeds)]
        for k in lengths:
            p, ps = get(mine, m, k), get(mine, m, k, "ppl_std")
            a, as_ = get(mine, m, k, "acc_mean"), get(mine, m, k, "acc_std")
            if p is None:
                cells += ["-", "-"]
            elif n_seeds > 1:
                cells += [f"{p:.2f} ± {ps:.2f}", f"{a:.2f} ± {as_:.2f}"]
            else:  # one seed: no spread to report
                cells += [f"{p:.2f}", f"{a:.2f}"]
        body.append(cells)
    lines = [f"# {meta.get('title', 'Length extrapolation')}", ""]
    for key in ("command", "included", "setup", "evaluation"):
        if meta.get(key):
            lines += [f"**{key.capitalize()}:** {meta[key]}", ""]
    if meta.get("left_out"):
        lines += [f"**Left out:** {LEFT_OUT.format(n=len(meta['left_out']))}", ""]
        lines += [f"- {line}" for line in meta["left_out"]] + [""]
    lines += [markdown_table(head, body), "",
              "Mean ± sample standard deviation over the seeds counted in the Seeds column.", ""]
    found = findings(rows, fine_tuned=bool(meta.get("fine_tuned")), pack=meta.get("pack"))
    if found:
        lines += ["## The paper's findings, checked", ""] + [f"- {f}" for f in found] + [""]
    return "\n".join(lines)


def write_table(results: List[dict], methods: Sequence[str], out_dir: Path, meta: dict) -> List[dict]:
    """Write ``table.md``, ``table.csv`` and ``table.json`` under ``out_dir`` atomically."""
    rows = aggregate(results, methods)
    slim = [{k: v for k, v in r.items() if k != "config"} for r in results]
    found = findings(rows, fine_tuned=bool(meta.get("fine_tuned")), pack=meta.get("pack"))
    write_table_files(out_dir, render_markdown(rows, meta), rows, CSV_FIELDS,
                      {"meta": meta, "rows": rows, "findings": found, "runs": slim})
    return rows


# ------------------------------------------------------------------------ runs
def table_dir(out: Path, cfg: TrainConfig) -> Path:
    """``<out>/<preset>``: where a preset's table goes (the name checked, the path kept inside ``out``;
    ``<preset>`` is :func:`~poslsh_paper.experiments.lm.config.layout_name`: packed and unpacked
    tables of one preset do not overwrite each other)."""
    return inside(out, Path(out) / layout_name(cfg), "out")


def _vs_table(diff: dict) -> str:
    """``steps 4 (table: 3)``: the run's value first, then the table's."""
    return describe_differences({k: (b, a) for k, (a, b) in diff.items()}, "table:")


def _refuse(cfg: TrainConfig) -> Callable[[Cell, Optional[dict], bool], Optional[str]]:
    """The table's rule: a run recorded with another config than ``cfg`` (fields that change
    results) is neither resumed nor mixed in; a finished run without a recorded config neither."""
    def refuse(cell: Cell, recorded: Optional[dict], finished: bool) -> Optional[str]:
        run = replace(cfg, method=cell[0], seed=cell[1])
        if not finished:
            diff = config_differences(run, recorded) if recorded is not None else {}
            return f"{run_dir(run)}: unfinished, started with {_vs_table(diff)}" if diff else None
        diff = config_differences(run, (recorded or {}).get("config") or {})
        if diff or not (recorded or {}).get("config"):
            return f"{run_dir(run) / 'result.json'}: trained with {_vs_table(diff) or 'no recorded config'}"
        return None
    return refuse


def table_sweep(cfg: TrainConfig, methods: Sequence[str], seeds: Sequence[int]) -> Sweep:
    """The table's grid: ``methods`` x ``seeds`` of ``cfg``, results in ``<run dir>/result.json``."""
    return Sweep(methods, seeds, lambda m, s: run_dir(replace(cfg, method=m, seed=s)) / "result.json", _refuse(cfg))


def run_table(cfg: TrainConfig, methods: Sequence[str], seeds: Sequence[int], results_dir: Path, *,
              progress: bool = True, command: str = "", train_missing: bool = True, jobs: int = 1,
              include: Optional[Path] = None) -> List[dict]:
    """Train (or resume) every missing method x seed run, ``jobs`` at a time, then write the
    table. Returns the runs' results (those with a ``result.json``; none: no table is written).
    A run of the grid recorded with another config is neither resumed nor retrained over: it is
    left out, said on stderr and in the table, one line each (which run, what differs). ``include``: an earlier
    ``table.json`` whose runs stand in for the method x seed runs that have no run directory
    here (nothing is retrained for them; the table says which rows came from it); its runs of
    the other packing are shown beside this table's (:func:`.include.include_runs`)."""
    sweep = table_sweep(cfg, methods, seeds)
    inc = None
    if include:
        here = sweep.finished()
        local = [r for r in (read_json(sweep.result_path(*c)) for c in here) if r]
        inc = include_runs(include, cfg, [c for c in sweep.cells() if c not in here], sweep.cells(), local)
    earlier: Dict[Cell, List[dict]] = {}
    for r in inc.same if inc else []:
        earlier.setdefault((r["method"], r["seed"]), []).append(r)
    todo, others = sweep.pending(taken=earlier)
    if train_missing and todo:
        train_all(todo, jobs, lambda c: train(replace(cfg, method=c[0], seed=c[1]), resume=True, progress=progress),
                  lambda c, threads: _launch(replace(cfg, method=c[0], seed=c[1]), threads))
    got = sweep.collect(stand_ins=earlier)
    results, others = got.results + (inc.other if inc else []), others + got.left_out
    if others and int(os.environ.get("RANK", "0")) == 0:
        print(f"left out of the table: {len(others)} run(s) trained with another config than this table's "
              "(retrain them with `poslsh train ... --overwrite`, or point --runs-dir elsewhere):\n  "
              + "\n  ".join(others), file=sys.stderr)      # said again in the table: this scrolls away
    if int(os.environ.get("RANK", "0")) == 0 and results:
        title = ("Length extrapolation, trained from scratch (Table 1 analog)" if cfg.model.kind == "scratch"
                 else "Length extrapolation, LoRA fine-tuning (Table 2 analog)")
        packed = ", packed documents" if cfg.pack else ""
        meta = {"title": f"{title}: preset `{cfg.preset}`{packed}", "command": f"`{command}`" if command else "",
                "fine_tuned": cfg.model.kind != "scratch", "pack": cfg.pack, **describe(cfg, results)}
        if inc and (inc.same or inc.other):
            meta["included"] = included_note(inc, include, cfg.pack)
        if others:
            meta["left_out"] = others
        write_table(results, list(methods), table_dir(Path(results_dir), cfg), meta)
    return results


def _launch(c: TrainConfig, threads: int) -> Launch:
    """``python -m poslsh_paper train --resume`` of one run, its requested config in its run directory."""
    c = c if c.threads else replace(c, threads=threads)
    d = run_dir(c)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_text(d / "requested-config.json", json.dumps(config_to_dict(c), indent=1))
    cmd = [sys.executable, "-m", "poslsh_paper", "train", "--config-json", str(d / "requested-config.json"),
           "--resume", "--no-progress"]
    return Launch(f"{c.method} seed {c.seed}", cmd, d / "train.log", {**os.environ, "OMP_NUM_THREADS": str(c.threads)})


def dry_run(cfg: TrainConfig, methods: Sequence[str], steps: int = 3, jobs: int = 1) -> float:
    """Time a few training steps of each method on random tokens (with the threads each of
    ``jobs`` parallel runs gets); print and return the estimated wall minutes of the table."""
    spec = cfg.data.tokenizer
    vocab = int(spec[4:]) if spec.startswith("bpe:") else 49152
    total = 0.0
    with intra_op_threads(threads_per_job(jobs, cfg.threads)):
        for method in methods:
            run_cfg = replace(cfg, method=method)
            model = build_model(run_cfg, vocab)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            x = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.seq_len + 1))
            times = []
            for i in range(steps + 1):
                t0 = time.perf_counter()
                logits = model(input_ids=x[:, :-1], poslsh_step=i).logits
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
            rate = cfg.micro_batch_size * cfg.seq_len / statistics.median(times[1:])
            minutes = estimate_minutes(run_cfg, rate) * len(cfg.seeds)
            total += minutes
            print(f"{method:14s} {rate:8.0f} tokens/s  ~{minutes:6.1f} min for {len(cfg.seeds)} seed(s)")
    total /= jobs
    print(f"estimated total with {jobs} run(s) in parallel: {total:.0f} min ({total / 60:.1f} h); the timing "
          f"assumes the CPU is otherwise idle")
    return total
