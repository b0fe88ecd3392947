"""Wall-clock (and CPU) times for side-by-side CPU comparisons (GPU code uses
``triton.testing.do_bench``, which synchronises the device)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, List, Tuple


def sample_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> Tuple[List[float], List[float]]:
    """Wall and process-CPU seconds of each of ``repeats`` calls of ``fn()``, after ``warmup``
    calls: ``(walls, cpus)``. CPU / wall above 1 means several threads worked; far below 1,
    the process waited (for the scheduler, on a busy machine)."""
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
    """Median wall-clock time of ``fn()`` over ``repeats`` calls, after ``warmup`` calls."""
    return statistics.median(sample_seconds(fn, repeats, warmup)[0])


def machine() -> str:
    """One line naming the machine a timing ran on: CPU model, cores, memory, torch, OS."""
    import torch

    cpu, mem = "unknown CPU", float("nan")
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, torch {torch.__version__}, {platform.system()}"
