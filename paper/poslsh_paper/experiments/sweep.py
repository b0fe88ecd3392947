"""The one sweep runner behind ``poslsh table`` and ``poslsh vision``: every method x seed of a
configuration, trained where no result exists yet (resuming interrupted runs), collected, and
written as ``table.md`` / ``table.csv`` / ``table.json``.

A :class:`Sweep` is the grid and two rules: where a cell's result lives (``result_path``) and why
a recorded run is not this sweep's (``refuse``: a reason, or None to take it). The language-model
table refuses runs whose recorded config differs from the table's (they share one directory per
preset); the vision table names run directories by a fingerprint of their config, so it refuses
nothing. A refused run is neither resumed nor mixed in: it is *left out*, with its reason, which
the table states. Training goes seed-major (a sweep cut short still has every method at the first
seeds), in this process or in ``jobs`` worker subprocesses (:func:`run_parallel`).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from poslsh_paper.io import atomic_write_text, csv_text

__all__ = ["Cell", "Sweep", "Collected", "Launch", "Children", "mean_std", "threads_per_job", "train_all",
           "run_parallel", "read_json", "write_table_files"]

Cell = Tuple[str, int]          # (method, seed)


def mean_std(xs: Sequence[float]) -> Tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def read_json(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None if it is missing or torn."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _take_all(cell: Cell, recorded: Optional[dict], finished: bool) -> Optional[str]:
    return None


class Collected(NamedTuple):
    """What a sweep holds after training: ``results`` (method-major, the table's runs),
    ``left_out`` (one line per refused run: which and why), ``missing`` (cells with no result)."""

    results: List[dict]
    left_out: List[str]
    missing: List[Cell]


@dataclass(frozen=True)
class Sweep:
    """``methods`` x ``seeds``; ``result_path(method, seed)``: a finished run's result file (its
    directory holds ``config.json`` while the run is unfinished); ``refuse(cell, recorded,
    finished)``: why the run recorded there (its config or result, None if unreadable) is not
    this sweep's, as one line naming it, or None."""

    methods: Sequence[str]
    seeds: Sequence[int]
    result_path: Callable[[str, int], Path]
    refuse: Callable[[Cell, Optional[dict], bool], Optional[str]] = _take_all

    def cells(self) -> List[Cell]:
        """Method-major: the order of a table's rows and runs."""
        return [(m, s) for m in self.methods for s in self.seeds]

    def finished(self) -> List[Cell]:
        return [c for c in self.cells() if self.result_path(*c).exists()]

    def pending(self, taken: Iterable[Cell] = ()) -> Tuple[List[Cell], List[str]]:
        """``(todo, left_out)``: the cells to train, seed-major, without a result and not in
        ``taken`` (stand-ins from elsewhere); an unfinished run that ``refuse`` rejects is left out."""
        taken = set(taken)
        todo, left_out = [], []
        for cell in ((m, s) for s in self.seeds for m in self.methods):
            if cell in taken or self.result_path(*cell).exists():
                continue
            config = self.result_path(*cell).parent / "config.json"
            why = self.refuse(cell, read_json(config), False) if config.exists() else None
            if why:
                left_out.append(why)
            else:
                todo.append(cell)
        return todo, left_out

    def collect(self, stand_ins: Optional[Mapping[Cell, List[dict]]] = None) -> Collected:
        """Every cell's result, unless ``refuse`` rejects it; a cell without a result takes its
        ``stand_ins`` (results from elsewhere) or is missing."""
        results, left_out, missing, stand_ins = [], [], [], stand_ins or {}
        for cell in self.cells():
            path = self.result_path(*cell)
            if not path.exists():
                if cell in stand_ins:
                    results += stand_ins[cell]
                else:
                    missing.append(cell)
                continue
            result = json.loads(path.read_text())
            why = self.refuse(cell, result, True)
            if why:
                left_out.append(why)
            else:
                results.append(result)
        return Collected(results, left_out, missing)


# ------------------------------------------------------------------ training
@dataclass(frozen=True)
class Launch:
    """One worker subprocess: ``cmd`` with its output appended to ``log``, under ``env``;
    ``summary()``: a line on the finished run, said after ``[done]``."""

    label: str
    cmd: List[str]
    log: Path
    env: Dict[str, str]
    summary: Optional[Callable[[], str]] = None


def threads_per_job(jobs: int, threads: int = 0) -> int:
    """``threads`` if set, else the cores shared out among ``jobs`` runs (independent small runs
    scale better than threads do)."""
    return threads or max(1, (os.cpu_count() or 1) // max(1, jobs))


def train_all(todo: Sequence[Cell], jobs: int, train_here: Callable[[Cell], object],
              launch: Callable[[Cell, int], Launch], say: Optional[Callable[[str], None]] = None, *,
              quiet: bool = False) -> None:
    """Train ``todo``: one after the other in this process (``train_here``) or, with ``jobs > 1``,
    ``jobs`` worker subprocesses at a time (``launch(cell, threads)`` says how to start one;
    :func:`run_parallel` with ``say`` and ``quiet``)."""
    if jobs > 1:
        threads = threads_per_job(jobs)
        run_parallel(todo, jobs, lambda c: launch(c, threads), say, quiet=quiet)
    else:
        for cell in todo:
            train_here(cell)


class Children:
    """The running worker subprocesses, so Ctrl-C can reach each one exactly once."""

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
        SIGINT: children of a sweep started in the background by a script ignore it.)"""
        with self.lock:
            self.stopped = True
            for proc in self.procs:
                proc.send_signal(signal.SIGTERM)


def run_parallel(cells: Sequence[Cell], jobs: int, launch: Callable[[Cell], Launch],
                 say: Optional[Callable[[str], None]] = None, *, quiet: bool = False) -> None:
    """Run a worker subprocess per cell, ``jobs`` at a time (``launch(cell)``, called when the
    cell's turn comes, prepares its run directory and says how to start it), with a progress bar
    and a line per start and end (``say``, default ``tqdm.write``; ``quiet``: neither); Ctrl-C or
    SIGTERM makes every child checkpoint and stop. Raises RuntimeError naming the failed runs and
    their logs."""
    from tqdm.auto import tqdm

    say = (lambda _: None) if quiet else (say or tqdm.write)
    children, failed = Children(), []

    def run_one(cell: Cell) -> Tuple[Launch, Optional[int]]:
        job = launch(cell)
        job.log.parent.mkdir(parents=True, exist_ok=True)
        say(f"[start] {job.label}: log {job.log}")
        return job, children.run(job.cmd, job.log, job.env)

    bar = tqdm(total=len(cells), desc=f"runs ({jobs} in parallel)", unit="run", disable=quiet)
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for fut in as_completed([pool.submit(run_one, cell) for cell in cells]):
            job, rc = fut.result()
            bar.update(1)
            say(f"[{'done' if rc == 0 else 'FAILED'}] {job.label}")
            if rc == 0 and job.summary:
                say(job.summary())
            if rc:
                failed.append(f"{job.label} (exit {rc}, see {job.log})")
    except KeyboardInterrupt:
        children.interrupt()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)   # after an interrupt: wait for the checkpoints
        bar.close()
    if failed:
        raise RuntimeError("runs failed: " + "; ".join(failed))


# ------------------------------------------------------------------- writing
def write_table_files(out_dir: Path, markdown: str, rows: List[dict], fields: Sequence[str], data: dict, *,
                      float_format: Optional[str] = None) -> Path:
    """``table.csv`` (``rows`` in the columns ``fields``), ``table.json`` (``data``) and
    ``table.md`` (``markdown``, written last: a table.md is never older than its data) under
    ``out_dir``, each atomically; returns the path of ``table.md``."""
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "table.csv", csv_text(rows, fields, float_format=float_format))
    atomic_write_text(out_dir / "table.json", json.dumps(data, indent=1))
    atomic_write_text(out_dir / "table.md", markdown)
    return out_dir / "table.md"
