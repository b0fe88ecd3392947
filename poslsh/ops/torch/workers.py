"""Threads across the work items of one call of the torch backend on CPU.

A call is many small batched matmuls and softmaxes. Run with torch's intra-op threads, every
one of them is a parallel region whose barrier waits for the slowest thread: on a CPU shared
with other processes a descheduled thread stalls the region (a call slowed 5-20x under load).
Here the items (chunks of query tiles, independent but for the key gradients they add into)
are instead shared among ``torch.get_num_threads()`` Python threads, each running its items
with one intra-op thread: torch's kernels release the GIL, a slow thread delays only its own
items, and nothing waits at a barrier. Biggest items first, taken dynamically.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

from ...threads import intra_op_threads

__all__ = ["run_items", "KeyLocks"]

_POOL: List[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL or _POOL[0]._max_workers < workers:
            _POOL[:] = [ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poslsh")]
        return _POOL[0]


def run_items(items: Sequence, run: Callable[[object], None], cost: Callable[[object], float],
              workers: Optional[int] = None) -> None:
    """``run(item)`` for every item, on ``workers`` threads (default ``torch.get_num_threads()``,
    the caller's thread among them) with one intra-op thread each; inline with 1 worker or 1 item.
    Items run without autograd (kernels of custom ops: the dispatcher's exclusion of autograd
    is per thread). The first exception of any item is raised here."""
    workers = torch.get_num_threads() if workers is None else workers
    if workers <= 1 or len(items) <= 1:
        for item in items:
            run(item)
        return
    order = sorted(items, key=cost, reverse=True)
    ticket = itertools.count()

    @torch.no_grad()
    def loop():
        while True:
            i = next(ticket)              # atomic under the GIL
            if i >= len(order):
                return
            run(order[i])

    with intra_op_threads(1):
        futures = [_pool(workers - 1).submit(loop) for _ in range(min(workers, len(order)) - 1)]
        try:
            loop()
        finally:
            errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


class KeyLocks:
    """One lock per key/value row range that several items add gradients into."""

    def __init__(self):
        self._locks = {}
        self._guard = threading.Lock()

    def __call__(self, key) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())
