"""Wall-clock (and CPU) times for the app's side-by-side CPU comparisons (``poslsh demo``).
The benchmark scripts keep their own timers in ``benchmarks/bench_common.py``: the app and the
benchmarks depend on the library, not on each other."""
from __future__ import annotations

import statistics
import time
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

