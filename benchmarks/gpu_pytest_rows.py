"""A pytest plugin for the GPU test stage: ``-p gpu_pytest_rows --shard=i/N --rows-out=DIR``.

* ``--shard=i/N`` keeps this process's share of the collected tests: heavy tests first, each
  to the least loaded shard (the same deterministic split in every shard), so N processes run
  the suite, and compile its kernel variants, side by side;
* ``--rows-out=DIR`` writes one row per test to ``DIR/results.md`` / ``results.csv`` (:mod:`gpu_rows`)
  as soon as it finishes: the outcome, the duration and the last lines the test printed (the
  GPU tests print their measured errors), or the failure / skip reason. A passing test's
  numbers are never hidden.
"""
from __future__ import annotations

import pytest

from gpu_rows import Recorder

# Tests that compile more than one kernel family or build large inputs: placed first, spread out.
HEAVY = ("compile", "long_sequence", "test_flex.py::test_gpu", "grouped", "odd_head_dims")


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, help="i/N: run the i-th of N shares of the tests")
    parser.addoption("--rows-out", default=None, help="folder of results.md / results.csv for one row per test")
    parser.addoption("--rows-stage", default="tests", help="stage name in the rows")


def _weight(nodeid: str) -> int:
    return 3 if any(h in nodeid for h in HEAVY) else 1


def split(nodeids, shards: int):
    """Longest-first assignment of the tests to ``shards`` shares: ``[share of every test]``."""
    load = [0] * shards
    share = [0] * len(nodeids)
    for i in sorted(range(len(nodeids)), key=lambda i: (-_weight(nodeids[i]), i)):
        j = min(range(shards), key=lambda j: (load[j], j))
        share[i] = j
        load[j] += _weight(nodeids[i])
    return share


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    i, n = (int(x) for x in spec.split("/"))
    share = split([it.nodeid for it in items], n)
    keep = [it for it, s in zip(items, share) if s == i]
    drop = [it for it, s in zip(items, share) if s != i]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _detail(report) -> str:
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        return crash.message.splitlines()[0][:300] if crash is not None else str(report.longrepr)[-300:]
    if report.skipped:
        lr = report.longrepr
        return str(lr[2] if isinstance(lr, tuple) else lr)[:300]
    lines = [line for line in (report.capstdout or "").splitlines() if line.strip()]
    return " / ".join(lines[-4:])[:400]


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    out = _OPTIONS.get("rows_out")
    if not out:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed) or \
            (report.when == "teardown" and report.failed):
        result = {"passed": "passed", "failed": "failed", "skipped": "skipped"}[report.outcome]
        Recorder(out, _OPTIONS["stage"]).row(report.nodeid, result, round(report.duration, 2), "s",
                                             mode=report.when if report.when != "call" else "", detail=_detail(report))


_OPTIONS = {}


def pytest_configure(config):
    _OPTIONS.update(rows_out=config.getoption("--rows-out"), stage=config.getoption("--rows-stage"))
