"""Threads across the work items of one call of the torch backend on CPU, with results that do
not depend on them.

A call is many small batched matmuls and softmaxes. Run with torch's intra-op threads, every
one of them is a parallel region whose barrier waits for the slowest thread: on a CPU shared
with other processes a descheduled thread stalls the region (a call slowed 5-20x under load).
Here the items (chunks of query tiles) are instead shared among ``torch.get_num_threads()``
Python threads, each running its items with one intra-op thread: torch's kernels release the
GIL, a slow thread delays only its own items, and nothing waits at a barrier. Biggest items
first, taken dynamically.

Determinism. Identical calls give bitwise-identical results whatever the thread count and the
scheduling, because nothing an item computes depends on either:

* every item runs with one intra-op thread, on the workers and inline alike (a reduction split
  across threads adds in another order: ``x.sum()`` of one long row differs between 1 and 2
  threads);
* what several items add into the same rows (the key gradients ``dk``, ``dv``) is not added by
  the items: ``run(item)`` returns its part, and ``commit(item, part)`` adds it, one item at a
  time, in one fixed order (the items sorted by cost, biggest first, ties in the plan's order: a
  function of the call alone). A part that finishes early waits for its turn while its thread
  goes on; whichever thread finishes the item whose turn it is commits it and every waiting part
  after it. The adds are serial, as they were under a lock, and the order they take is the one of
  a single thread. A thread starts no item more than ``WAITING_PER_WORKER x workers`` items
  after the oldest unfinished one, so the waiting parts are a few chunks' worth of memory.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

from ...threads import intra_op_threads

__all__ = ["run_items"]

# Items a thread may run ahead of the oldest unfinished one, per worker: while a thread is
# descheduled the others keep computing for that long, their parts waiting (the extra memory).
# On 2 threads under load 4: 2 per worker waited 2-8% of the wall time, 4 per worker 0-1%.
WAITING_PER_WORKER = 4

_POOL: List[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()
_MISSING = object()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL or _POOL[0]._max_workers < workers:
            _POOL[:] = [ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poslsh")]
        return _POOL[0]


class _InOrder:
    """``commit(order[i], part_i)`` for ``i = 0, 1, ...`` in turn, whichever thread delivers
    ``part_i`` and when; a thread about to start item ``i`` waits while ``i`` is ``window`` items
    or more ahead of the next turn (the waiting parts are bounded)."""

    def __init__(self, order: Sequence, commit: Callable[[object, object], None], window: int):
        self.order, self.commit, self.window = order, commit, window
        self.turn, self.parts, self.committing, self.failed = 0, {}, False, False
        self.cond = threading.Condition()

    def room(self, i: int) -> bool:
        """Wait until item ``i`` may start; False when another item failed (stop)."""
        with self.cond:
            while i - self.turn >= self.window and not self.failed:
                self.cond.wait()
            return not self.failed

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def deliver(self, i: int, part) -> None:
        with self.cond:
            self.parts[i] = part
            if self.committing:           # the committing thread takes it in its turn
                return
            self.committing = True
        while True:
            with self.cond:
                part = self.parts.pop(self.turn, _MISSING)
                if part is _MISSING or self.failed:
                    self.committing = False
                    return
            self.commit(self.order[self.turn], part)
            with self.cond:
                self.turn += 1
                self.cond.notify_all()


def run_items(items: Sequence, run: Callable[[object], object], cost: Callable[[object], float],
              workers: Optional[int] = None, commit: Optional[Callable[[object, object], None]] = None) -> None:
    """``run(item)`` for every item, on ``workers`` threads (default ``torch.get_num_threads()``,
    the caller's thread among them; inline with 1 worker or 1 item), always with one intra-op
    thread; with ``commit``, then ``commit(item, run(item))`` for every item one at a time, in the
    order of ``items`` sorted by ``cost`` (biggest first, stable), whatever the threads. Items run
    without autograd on the workers (kernels of custom ops: the dispatcher's exclusion of autograd
    is per thread). The first exception of any item is raised here."""
    workers = torch.get_num_threads() if workers is None else workers
    order = sorted(items, key=cost, reverse=True)
    with intra_op_threads(1):
        if workers <= 1 or len(order) <= 1:
            for item in order:
                part = run(item)
                if commit is not None:
                    commit(item, part)
            return
        numbers = itertools.count()
        turns = _InOrder(order, commit, WAITING_PER_WORKER * workers) if commit is not None else None

        @torch.no_grad()
        def loop():
            if torch.get_num_threads() != 1:   # a worker keeps the count it started with
                torch.set_num_threads(1)
            try:
                while True:
                    i = next(numbers)             # atomic under the GIL
                    if i >= len(order) or (turns is not None and not turns.room(i)):
                        return
                    part = run(order[i])
                    if turns is not None:
                        turns.deliver(i, part)
            except BaseException:
                if turns is not None:
                    turns.fail()
                raise

        futures = [_pool(workers - 1).submit(loop) for _ in range(min(workers, len(order)) - 1)]
        try:
            loop()
        finally:
            errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
