"""What every benchmark script shares, depending on the library's dependencies only (not on the
paper's app): the machine line, side-by-side timing in interleaved rounds, per-call wall and
CPU samples, peak memory, and the JSON / Markdown writers.

Side by side means one process, every contender timed once per round, rounds repeated, the
best (lowest) time of each kept: on a shared machine the best round is the one least disturbed
by other tenants, and interleaving keeps a slow period from favouring one contender.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """One line naming the machine a timing ran on: CPU model, cores, memory, load, torch, OS."""
    import torch

    cpu, mem = "unknown CPU", float("nan")
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, load {load:.1f}, torch {torch.__version__}, "
            f"{platform.system()}")


def best_of_rounds(contenders: Mapping[str, Callable[[], object]], *, rounds: int = 5,
                   warmup: int = 1) -> Dict[str, Dict[str, float]]:
    """Time every contender ``rounds`` times, interleaved (A B C, A B C, ...) after ``warmup``
    untimed calls each: ``{name: {"best": s, "median": s, "worst": s}}`` in wall seconds."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, list] = {name: [] for name in contenders}
    for _ in range(max(1, rounds)):
        for name, fn in contenders.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"best": min(ts), "median": sorted(ts)[len(ts) // 2], "worst": max(ts)}
            for name, ts in times.items()}


def sample_seconds(fn: Callable[[], object], repeats: int = 3,
                   warmup: int = 1) -> Tuple[List[float], List[float]]:
    """Wall and process-CPU seconds of each of ``repeats`` calls of ``fn()``, after ``warmup``
    untimed calls: ``(walls, cpus)``. CPU / wall above 1 means several threads worked; far below
    1, the process waited (for the scheduler, on a busy machine)."""
    for _ in range(warmup):
        fn()
    walls, cpus = [], []
    for _ in range(max(1, repeats)):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    return statistics.median(sample_seconds(fn, repeats, warmup)[0])


def peak_rss_gib() -> float:
    """The process's peak resident memory so far, GiB (``ru_maxrss``; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_json(path, data: Any) -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
