"""The time column of ``poslsh frontier``: every method of a report, on the torch backend, in one
run (interleaved rounds, best kept: the machine is shared).

Times do not depend on the values, so the inputs are seeded Gaussian float32 tensors of the
report's geometry ``[1, H, n, d]``; the partitions are the report's draw 0 and the windows its
per-head ``w_h``. Positional LSH runs ``poslsh_attention(backend="torch")``; the windows (and exact
ALiBi, the window ``n - 1``) run ``windowed_alibi_attention(backend="torch")`` when the torch
backend serves the window op, else their time is missing with the reason; the hybrid has no
fast implementation (it is measured in float64 only).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List

import torch

from poslsh.attention import available_backends, poslsh_attention
from poslsh import windowed_alibi_attention
from poslsh.partitions import Partitions
from poslsh.seeding import generator
from poslsh_paper.analysis.records import sampler_draws

__all__ = ["time_methods"]


def _calls(report: dict, n: int, q, k, v) -> List[dict]:
    """``[{label, family, fn or reason}]`` for every method of length ``n``."""
    cfg = report["config"]
    plan = report["plans"][str(n)]
    sig = torch.tensor(cfg["sigmas"], dtype=torch.float64)
    causal = cfg["causal"]
    out = []
    for sampler in cfg["samplers"]:
        for sizes, parts in sampler_draws(cfg["sigmas"], cfg["samples"], sampler, ("frontier", cfg["seed"], n, 0)):
            for s in sizes:
                prefix = Partitions(parts.widths[:, :s], parts.offsets[:, :s], parts.sigma, parts.groups)
                out.append(dict(label=f"{sampler} s={s}", family=sampler, backend="torch", fn=lambda p=prefix: (
                    poslsh_attention(q, k, v, p, causal=causal, backend="torch"))))
    windows = [(label, spec["family"], spec["w"]) for label, spec in plan.items() if "w" in spec]
    windows.append(("exact", "exact", [n - 1] * len(cfg["sigmas"])))
    have = "torch" in available_backends(op="window")
    reason = ("" if have else "no torch backend for the window op in this build (windowed_alibi_attention serves "
              f"{available_backends(op='window')}); re-run with --only-timing once it has one")
    for label, family, w in windows:
        fn = (lambda w=torch.tensor(w, dtype=torch.int64): windowed_alibi_attention(
            q, k, v, 1.0 / sig, window=w, causal=causal, backend="torch")) if have else None
        out.append(dict(label=label, family=family, backend="torch", fn=fn, reason=reason))
    for label, spec in plan.items():
        if spec["family"] == "hybrid":
            out.append(dict(label=label, family="hybrid", backend=None, fn=None,
                            reason="no fast implementation (the hybrid is measured in float64 only)"))
    return out


def time_methods(report: dict, rounds: int, log: Callable[[str], None] = lambda msg: None) -> Dict:
    """``{rows: [{n, label, family, seconds, cpu_seconds, backend, reason}], machine}``: the best wall
    time of ``rounds`` interleaved rounds after one warm-up call per method."""
    cfg = report["config"]
    hq, hkv, d = report["geometry"]
    heads = len(cfg["sigmas"])
    kv = hkv if heads == hq else heads                          # a subset of heads: no GQA
    load0, rows = os.getloadavg(), []
    for n in cfg["lengths"]:
        g = generator("frontier-timing", n)
        q = torch.randn(1, heads, n, d, generator=g)
        k, v = torch.randn(1, kv, n, d, generator=g), torch.randn(1, kv, n, d, generator=g)
        calls = _calls(report, n, q, k, v)
        best: Dict[str, tuple] = {}
        with torch.no_grad():
            for c in calls:
                if c["fn"] is not None:
                    c["fn"]()
            for _ in range(rounds):
                for c in calls:
                    if c["fn"] is None:
                        continue
                    c0, t0 = time.process_time(), time.perf_counter()
                    c["fn"]()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    if c["label"] not in best or wall < best[c["label"]][0]:
                        best[c["label"]] = (wall, cpu)
        for c in calls:
            wall, cpu = best.get(c["label"], (None, None))
            rows.append(dict(n=n, label=c["label"], family=c["family"], seconds=wall, cpu_seconds=cpu,
                             backend=c["backend"] if wall is not None else None, reason=c.get("reason", "")))
        log(f"timed n={n}: {sum(c['fn'] is not None for c in calls)} methods, {rounds} rounds")
    machine = dict(cpus=os.cpu_count(), threads=torch.get_num_threads(), load_start=list(load0),
                   load_end=list(os.getloadavg()), dtype="float32", shape=[1, heads, "n", d], kv_heads=kv,
                   sigmas=cfg["sigmas"], causal=cfg["causal"])
    return dict(rows=rows, machine=machine)
