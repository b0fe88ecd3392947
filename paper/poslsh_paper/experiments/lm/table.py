"""The length-extrapolation table: every method x seed of a preset, aggregated.

:func:`run_table` trains each missing run (resuming interrupted ones; in parallel
subprocesses with ``jobs > 1``), then writes ``<results>/<preset>/table.md``,
``table.csv`` and ``table.json``: mean +- sample std over seeds per method and
length, and the paper's claims checked against the numbers (:func:`findings`). A packed
table may hold unpacked runs of the same set-up beside its own (``--include-runs``, see
:mod:`.include`): rows are per method and packing.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from poslsh_paper.io import atomic_write_text, csv_text, markdown_table
from poslsh.threads import intra_op_threads
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.experiments.lm.config import (TrainConfig, config_differences, describe_differences, layout_name,
                                                method_label, run_dir)
from poslsh_paper.experiments.lm.include import describe, include_runs, included_note
from poslsh_paper.experiments.paths import inside
from poslsh_paper.experiments.lm.findings import findings, get, lengths_of
from poslsh_paper.experiments.lm.loop import estimate_minutes, train
from poslsh_paper.experiments.lm.model import build_model

__all__ = ["aggregate", "findings", "render_markdown", "write_table", "run_table", "train_parallel", "dry_run",
           "table_dir", "describe"]

CSV_FIELDS = ["method", "label", "pack", "length", "context", "seeds", "ppl_mean", "ppl_std", "acc_mean", "acc_std"]


# ----------------------------------------------------------------- aggregation
def _mean_std(xs: List[float]):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


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
                ppl, ppl_sd = _mean_std([r["eval"][k]["ppl"] for r in runs])
                acc, acc_sd = _mean_std([r["eval"][k]["acc"] for r in runs])
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
    lines += [markdown_table(head, body), "",
              "Mean ± sample standard deviation over the seeds counted in the Seeds column.", ""]
    found = findings(rows, fine_tuned=bool(meta.get("fine_tuned")), pack=meta.get("pack"))
    if found:
        lines += ["## The paper's findings, checked", ""] + [f"- {f}" for f in found] + [""]
    return "\n".join(lines)


def write_table(results: List[dict], methods: Sequence[str], out_dir: Path, meta: dict) -> List[dict]:
    """Write ``table.md``, ``table.csv`` and ``table.json`` under ``out_dir`` atomically."""
    rows = aggregate(results, methods)
    atomic_write_text(out_dir / "table.csv", csv_text(rows, CSV_FIELDS))
    slim = [{k: v for k, v in r.items() if k != "config"} for r in results]
    found = findings(rows, fine_tuned=bool(meta.get("fine_tuned")), pack=meta.get("pack"))
    atomic_write_text(out_dir / "table.json", json.dumps({"meta": meta, "rows": rows, "findings": found, "runs": slim},
                                                         indent=1))
    atomic_write_text(out_dir / "table.md", render_markdown(rows, meta))
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


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_table(cfg: TrainConfig, methods: Sequence[str], seeds: Sequence[int], results_dir: Path, *,
              progress: bool = True, command: str = "", train_missing: bool = True, jobs: int = 1,
              include: Optional[Path] = None) -> List[dict]:
    """Train (or resume) every missing method x seed run, ``jobs`` at a time, then write the
    table. Returns the runs' results (those with a ``result.json``). ``include``: an earlier
    ``table.json`` whose runs stand in for the method x seed runs that have no run directory
    here (nothing is retrained for them; the table says which rows came from it); its runs of
    the other packing are shown beside this table's (:func:`.include.include_runs`)."""
    runs = [replace(cfg, method=m, seed=s) for m in methods for s in seeds]
    pairs = [(m, s) for m in methods for s in seeds]
    inc = None
    if include:
        files = {(r.method, r.seed): run_dir(r) / "result.json" for r in runs}
        here = [p for p in pairs if files[p].exists()]
        local = [r for r in (_read_json(files[p]) for p in here) if r]
        inc = include_runs(include, cfg, [p for p in pairs if p not in here], pairs, local)
    earlier = inc.same if inc else []
    taken = {(r["method"], r["seed"]) for r in earlier}
    # Seed-major training order: a table cut short still has every method at the first seeds.
    todo = [replace(cfg, method=m, seed=s) for s in seeds for m in methods]
    todo = [r for r in todo if not (run_dir(r) / "result.json").exists() and (r.method, r.seed) not in taken]
    others = []
    for r in list(todo):    # an unfinished run of another configuration is neither resumed nor mixed in
        recorded = _read_json(run_dir(r) / "config.json")
        diff = config_differences(r, recorded) if recorded is not None else {}
        if diff:
            todo.remove(r)
            others.append(f"{run_dir(r)}: unfinished, started with {_vs_table(diff)}")
    if train_missing and todo:
        if jobs > 1:
            train_parallel(todo, jobs)
        else:
            for r in todo:
                train(r, resume=True, progress=progress)
    results = []
    for r in runs:
        path = run_dir(r) / "result.json"
        if not path.exists():
            results += [e for e in earlier if (e["method"], e["seed"]) == (r.method, r.seed)]
            continue
        result = json.loads(path.read_text())
        diff = config_differences(r, result.get("config") or {})
        if diff or not result.get("config"):
            others.append(f"{path}: trained with {_vs_table(diff) or 'no recorded config'}")
        else:
            results.append(result)
    results += inc.other if inc else []
    if others and int(os.environ.get("RANK", "0")) == 0:
        print(f"left out of the table: {len(others)} run(s) trained with another config than this table's "
              "(retrain them with `poslsh train ... --overwrite`, or point --runs-dir elsewhere):\n  "
              + "\n  ".join(others), file=sys.stderr)
    if int(os.environ.get("RANK", "0")) == 0 and results:
        title = ("Length extrapolation, trained from scratch (Table 1 analog)" if cfg.model.kind == "scratch"
                 else "Length extrapolation, LoRA fine-tuning (Table 2 analog)")
        packed = ", packed documents" if cfg.pack else ""
        meta = {"title": f"{title}: preset `{cfg.preset}`{packed}", "command": f"`{command}`" if command else "",
                "fine_tuned": cfg.model.kind != "scratch", "pack": cfg.pack, **describe(cfg, results)}
        if inc and (inc.same or inc.other):
            meta["included"] = included_note(inc, include, cfg.pack)
        write_table(results, list(methods), table_dir(Path(results_dir), cfg), meta)
    return results


class _Children:
    """The running ``poslsh train`` subprocesses, so Ctrl-C can reach each one exactly once."""

    def __init__(self):
        self.lock, self.procs, self.stopped = threading.Lock(), set(), False

    def run(self, cmd: List[str], log_path: Path, env: dict) -> Optional[int]:
        """Run ``cmd`` to the end with its output in ``log_path``; None if stopped before it started."""
        with open(log_path, "a") as log:
            with self.lock:
                if self.stopped:
                    return None
                # Own session: a terminal's Ctrl-C reaches the parent only, which forwards it once.
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                self.procs.add(proc)
            try:
                return proc.wait()
            finally:
                with self.lock:
                    self.procs.discard(proc)

    def interrupt(self) -> None:
        """SIGTERM to every child: each saves a checkpoint and exits; start no more. (Not
        SIGINT: children of a table started in the background by a script ignore it.)"""
        with self.lock:
            self.stopped = True
            for proc in self.procs:
                proc.send_signal(signal.SIGTERM)


def train_parallel(cfgs: Sequence[TrainConfig], jobs: int) -> None:
    """``python -m poslsh_paper train --resume`` for each config in a subprocess, ``jobs`` at a time,
    each with ``cpu_count // jobs`` threads (independent small runs scale better than threads
    do). Logs go to ``<run dir>/train.log``; Ctrl-C or SIGTERM makes every child checkpoint and stop."""
    from tqdm.auto import tqdm

    threads = max(1, (os.cpu_count() or 1) // jobs)
    children, failed = _Children(), []

    def run_one(c: TrainConfig) -> Optional[int]:
        c = c if c.threads else replace(c, threads=threads)
        d = run_dir(c)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "requested-config.json", json.dumps(config_to_dict(c), indent=1))
        cmd = [sys.executable, "-m", "poslsh_paper", "train", "--config-json", str(d / "requested-config.json"),
               "--resume", "--no-progress"]
        tqdm.write(f"[start] {c.method} seed {c.seed}: log {d / 'train.log'}")
        return children.run(cmd, d / "train.log", {**os.environ, "OMP_NUM_THREADS": str(c.threads)})

    bar = tqdm(total=len(cfgs), desc=f"runs ({jobs} in parallel)", unit="run")
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(run_one, c): c for c in cfgs}
        for fut in as_completed(futures):
            c, rc = futures[fut], fut.result()
            bar.update(1)
            tqdm.write(f"[{'done' if rc == 0 else 'FAILED'}] {c.method} seed {c.seed}")
            if rc:
                failed.append(f"{c.method} seed {c.seed} (exit {rc}, see {run_dir(c) / 'train.log'})")
    except KeyboardInterrupt:
        children.interrupt()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # after an interrupt: wait for the checkpoints
        bar.close()
    if failed:
        raise RuntimeError("runs failed: " + "; ".join(failed))


def dry_run(cfg: TrainConfig, methods: Sequence[str], steps: int = 3, jobs: int = 1) -> float:
    """Time a few training steps of each method on random tokens (with the threads each of
    ``jobs`` parallel runs gets); print and return the estimated wall minutes of the table."""
    spec = cfg.data.tokenizer
    vocab = int(spec[4:]) if spec.startswith("bpe:") else 49152
    total = 0.0
    with intra_op_threads(cfg.threads or max(1, (os.cpu_count() or 1) // jobs)):
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
