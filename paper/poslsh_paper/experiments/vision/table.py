"""The vision table: every method x seed, trained (resuming; in parallel worker processes with
``jobs > 1``, by :mod:`poslsh_paper.experiments.sweep`), aggregated.

Writes ``table.md``, ``table.csv`` and ``table.json`` (mean +- sample std over seeds of the test
accuracy at each resolution) with the paper-style findings checked against the numbers
(:mod:`.findings`).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from poslsh_paper.io import atomic_write_text, markdown_table
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.experiments.sweep import Launch, Sweep, mean_std, train_all, write_table_files
from poslsh_paper.experiments.vision.config import VisionConfig, head_sigmas, method_label, run_dir
from poslsh_paper.experiments.vision.findings import findings, scale_order
from poslsh_paper.experiments.vision.train import RESULT, load_splits, result_line, train_run

__all__ = ["vision_sweep", "run_all", "collect", "aggregate", "findings", "render_markdown", "write_table"]

CSV_FIELDS = ["method", "label", "scale", "pixels", "grid", "seeds", "acc_mean", "acc_std", "train_cpu_s_mean"]


def vision_sweep(cfg: VisionConfig) -> Sweep:
    """The table's grid: ``cfg.methods`` x ``cfg.seeds``. A run directory is named by the fingerprint
    of its config (a changed config is a new directory), so every result found is this table's."""
    return Sweep(cfg.methods, cfg.seeds, lambda m, s: run_dir(cfg, m, s) / RESULT)


def _launch(cfg: VisionConfig, method: str, seed: int, threads: int) -> Launch:
    """A worker subprocess training one run (:func:`.train.main`), its config in its run directory."""
    d = run_dir(cfg, method, seed)
    d.mkdir(parents=True, exist_ok=True)
    request = d / "requested-config.json"
    atomic_write_text(request, json.dumps(config_to_dict(replace(cfg, threads=threads)), indent=1))
    cmd = [sys.executable, "-m", "poslsh_paper.experiments.vision.train", str(request), method, str(seed)]
    return Launch(f"{method} seed {seed}", cmd, d / "train.log", {**os.environ, "OMP_NUM_THREADS": str(threads)},
                  summary=lambda: result_line(json.loads((d / RESULT).read_text())))


def run_all(cfg: VisionConfig, *, jobs: int = 1, progress: Optional[Callable[[str], None]] = None) -> None:
    """Train every missing ``methods x seeds`` run of ``cfg`` (interrupted ones resume from their newest
    checkpoint); ``jobs > 1`` runs that many worker processes with ``cores // jobs`` threads each."""
    todo, _ = vision_sweep(cfg).pending()
    if progress:
        progress(f"{len(todo)} of {len(cfg.methods) * len(cfg.seeds)} runs to train ({jobs} at a time)")
    if not todo:
        return
    splits = load_splits(cfg) if jobs <= 1 else None
    train_all(todo, jobs, lambda c: train_run(cfg, c[0], c[1], splits=splits, progress=progress),
              lambda c, threads: _launch(cfg, c[0], c[1], cfg.threads or threads), progress, quiet=progress is None)


def collect(cfg: VisionConfig) -> List[dict]:
    """The finished runs' results of this config (other configs live in other directories)."""
    return vision_sweep(cfg).collect().results


def aggregate(results: List[dict], methods: Sequence[str]) -> List[dict]:
    """One row per (method, resolution): mean and sample std of the accuracy over seeds."""
    rows = []
    for m in methods:
        runs = [r for r in results if r["method"] == m]
        if not runs:
            continue
        for key, ev in runs[0]["eval"].items():
            acc, sd = mean_std([r["eval"][key]["acc"] for r in runs])
            cpu = statistics.fmean(r.get("train_cpu_s", r["train_time_s"]) for r in runs)
            rows.append({"method": m, "label": method_label(m), "scale": key, "pixels": ev["pixels"],
                         "sigma_mult": ev.get("sigma_mult", 1),
                         "grid": "x".join(map(str, ev["grid"])), "seeds": len(runs), "acc_mean": acc, "acc_std": sd,
                         "acc_by_seed": {r["seed"]: r["eval"][key]["acc"] for r in runs}, "train_cpu_s_mean": cpu})
    return rows


def _seconds(x: float) -> str:
    """Seconds as read in a table: two significant digits below 10 s (a smoke run's 0.4 s is not 0)."""
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


def _wall(x: float) -> str:
    return f"{_seconds(x)} s" if x < 120 else f"{x / 60:.1f} min"


def render_markdown(rows: List[dict], meta: dict) -> str:
    scales = sorted({r["scale"] for r in rows}, key=scale_order)
    header = ["Method", "Seeds"]
    for s in scales:
        r = next(r for r in rows if r["scale"] == s)
        what = "training" if s == scales[0] else "sigma x%d" % r["sigma_mult"] if s.endswith("-scaled") else \
            "extrapolation"
        header.append(f"Acc % @{r['pixels']} px, {r['grid']} patches ({what})")
    header.append("train CPU s / run")
    body = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = {r["scale"]: r for r in rows if r["method"] == m}
        first = next(iter(mine.values()))
        body.append([first["label"], first["seeds"]] +
                    [f"{mine[s]['acc_mean']:.2f} ± {mine[s]['acc_std']:.2f}" if s in mine else "—" for s in scales] +
                    [_seconds(first["train_cpu_s_mean"])])
    lines = [f"# Vision table: positional methods on {meta['data']}", "",
             f"Command: `{meta['command']}`", "", meta["setup"], "", markdown_table(header, body), "",
             "Findings, checked against the numbers:", ""]
    lines += [f"- {f}" for f in meta["findings"]]
    if meta.get("missing"):
        lines += ["", f"Missing runs (not in the table): {', '.join(meta['missing'])}"]
    return "\n".join(lines) + "\n"


def write_table(cfg: VisionConfig, out: Path, command: str, extra: Optional[Dict] = None) -> Path:
    """Aggregate the finished runs of ``cfg`` into ``out/table.{md,csv,json}`` (atomically)."""
    got = vision_sweep(cfg).collect()
    results = got.results
    rows = aggregate(results, cfg.methods)
    missing = [f"{m}/seed{s}" for m, s in got.missing]
    m = cfg.model
    first = results[0] if results else {}
    setup = (f"ViT: {m.depth} blocks, width {m.dim}, {m.heads} heads (sigma = "
             f"{', '.join(f'{x:g}' for x in head_sigmas(m).tolist())} "
             f"patches), patch {m.patch_size} px, mean pooling; {cfg.epochs} epochs of {first.get('train_images', '?')} "
             f"training images, batch {cfg.batch_size}, AdamW lr {cfg.lr:g}, wd {cfg.weight_decay:g}, warmup + cosine. "
             f"Test: {first.get('test_images', '?')} test images at each resolution (bilinear upsampling; the "
             f"learned position table is resized bicubically to the larger grid). PosLSH/fixed boxes evaluated "
             f"with fixed boxes per layer (seed {cfg.eval_seed}). Mean ± sample std over seeds; "
             f"torch {torch.__version__}.")
    cpu = sum(r.get("train_cpu_s", 0) + r.get("eval_cpu_s", 0) for r in results)
    setup += (f" CPU time of the {len(results)} run{'s' if len(results) != 1 else ''} (training + evaluation, one "
              f"thread each): {_seconds(cpu)} s, i.e. {_wall(cpu / 2)} of wall time on 2 quiet cores with --jobs 2.")
    meta = {"command": command, "data": first.get("data", cfg.dataset), "setup": setup, "findings": findings(rows),
            "cpu_s_all_runs": round(cpu, 1),
            "missing": missing, **(extra or {})}
    runs = [{k: r[k] for k in ("method", "seed", "eval", "train_time_s", "eval_time_s", "steps")}
            | {"train_cpu_s": r.get("train_cpu_s")} for r in results]
    return write_table_files(Path(out), render_markdown(rows, meta), rows, CSV_FIELDS,
                             {"meta": meta, "rows": rows, "config": config_to_dict(cfg), "runs": runs},
                             float_format=".4f")
