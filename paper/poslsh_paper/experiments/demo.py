"""``poslsh demo``: the main job, on an embedded default.

For the ALiBi heads of a 4-head model at n = 4096 it measures, for
s in {1, 5, 10, 20, 100} and each sampler of ``--samplers`` side by side (``iid``,
the paper; ``grouped``: groups of shifted grids, ``docs/sampling.md``):
||L* - M~|| and ||L* - M~||_max next to the bounds of Theorem 2.1 (eq. (3) with the
sampler's own number of independent groups), the attention output error
||T* - T~||_max (causal), and the time of poslsh against exact ALiBi; then it draws
the paper's Figure 1 for one head.

Timings are what this machine did, nothing promised: the job also measures the
crossover length (the smallest n of a doubling grid from which poslsh's forward
beats exact ALiBi at every larger n of the grid) and warns when the machine was
too busy for any of these times to mean much (the process got far less CPU than
wall-clock time, or the load average exceeded the CPU count).

Outputs: ``outputs/demo/demo.json`` and ``figure1.png`` (git-ignored); the
committed reference under ``results/demo/`` is rewritten only by ``--out
results/demo``, and only with SmolLM2 Q/K/V unless ``--qkv random`` says otherwise. The config
and presets live in :mod:`poslsh_paper.experiments.demo_config` (``--help`` needs no torch).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from poslsh import theory
from poslsh.alibi import alibi_bias, alibi_sigmas
from poslsh.attention import poslsh_attention
from poslsh_paper.io import atomic_write_json
from poslsh.partitions import sample_partitions
from poslsh.sampling import parse_sampler
from poslsh_paper.timing import median_seconds
from poslsh_paper.experiments import demo_config
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.demo_config import COMMANDS, MODEL_HEADS, PRESETS, DemoConfig
from poslsh_paper.experiments.model_inputs import reference_note

__all__ = ["DemoConfig", "DemoRow", "DemoResult", "PRESETS", "Stopwatch", "crossover", "crossover_length",
           "busy_warning", "run", "write", "main", "format_table", "COMMANDS"]

BUSY_CPU_PER_WALL = 0.8      # below this the timed calls got under 80% of even one core: others had the CPU


@dataclass
class DemoRow:
    s: int
    head: int
    sigma: float
    spectral: float           # ||L* - M~||
    spectral_bound: float     # eq. (1) with constant C
    max_norm: float           # ||L* - M~||_max
    max_bound: float          # eq. (3) at confidence 1 - delta, with the sampler's independent groups
    output_error: float       # ||T* - T~||_max, causal
    sampler: str = "iid"      # how the s partitions were drawn


@dataclass
class DemoResult:
    config: dict                                              # the DemoConfig as a dict
    qkv_source: str
    rows: List[DemoRow] = field(default_factory=list)        # one per (sampler, s, head)
    time_poslsh_ms: dict = field(default_factory=dict)       # sampler -> s -> median ms of one poslsh call
    time_exact_ms: float = 0.0                                # median ms of exact ALiBi attention
    crossover: Optional[dict] = None                          # see :func:`crossover`
    timing: dict = field(default_factory=dict)                # CPU vs wall over the timed calls, load, warning


def _exact_bytes(heads: int, n: int) -> int:
    return demo_config.exact_bytes(heads, n)


def _memory_gib() -> float:
    return demo_config.memory_gib()


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _load_qkv(cfg: DemoConfig):
    """``(q, k, v, sigma, source)``, q/k/v ``[1, H, n, d]``, sigma ``[H]``: SmolLM2's
    pre-RoPE Q/K/V on real text when installed (``auto``/``model``), else random Gaussian."""
    why = ""
    if cfg.qkv in ("auto", "model"):
        from poslsh_paper.analysis.qkv import real_qkv_or_none
        real = real_qkv_or_none(n=cfg.n, heads=MODEL_HEADS)
        if real is not None:
            source = f"SmolLM2-135M layer {real.layer} heads {real.heads}, pre-RoPE, on {real.source}"
            return real.q.float(), real.k.float(), real.v.float(), real.sigmas, source
        why = demo_config.real_qkv_missing() or "no document long enough"
        if cfg.qkv == "model":
            raise ConfigError(f"--qkv model: real Q/K/V unavailable: {why}")
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v = (torch.randn(1, cfg.num_heads, cfg.n, cfg.head_dim, generator=g) for _ in range(3))
    return q, k, v, alibi_sigmas(cfg.num_heads), "random Gaussian Q/K/V" + (f" ({why})" if why else "")


# ------------------------------------------------------------------ timing
class Stopwatch:
    """Median times of calls, and the CPU time the process got while they ran: on a
    busy machine CPU time falls far below wall-clock time."""

    def __init__(self, repeats: int = 3):
        self.repeats, self.cpu_s, self.wall_s = repeats, 0.0, 0.0

    def median_ms(self, fn: Callable[[], object]) -> float:
        c0, w0 = time.process_time(), time.perf_counter()
        t = median_seconds(fn, repeats=self.repeats)
        self.cpu_s += time.process_time() - c0
        self.wall_s += time.perf_counter() - w0
        return t * 1e3


def busy_warning(cpu_per_wall: float, load: float, cpus: int) -> Optional[str]:
    """A warning when the timings cannot be trusted, else None."""
    why = []
    if cpu_per_wall < BUSY_CPU_PER_WALL:
        why.append(f"the timed calls got {cpu_per_wall:.2f} s of CPU per wall-clock second")
    if load > cpus:
        why.append(f"load average {load:.1f} on {cpus} CPUs")
    return None if not why else (f"WARNING: this machine was busy ({'; '.join(why)}): the times, speedups and "
                                 "crossover above are not reliable; rerun on a quiet machine")


def _exact(q, k, v, sigma, watch: Stopwatch):
    """Exact causal ALiBi attention ``[1, H, n, d]`` and its median ms: SDPA with the
    materialised ``[H, n, n]`` bias, built outside the timed calls (and freed on return:
    256 MB at n = 4096)."""
    mask = alibi_bias(q.shape[2], 1.0 / sigma, causal=True, dtype=q.dtype)[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out, watch.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def crossover_length(points: Sequence[dict]) -> Optional[int]:
    """The smallest ``n`` from which poslsh is faster at every larger measured ``n``
    (``points`` sorted by n, each with ``poslsh_ms`` and ``exact_ms``); None if it never is."""
    n = None
    for p in reversed(points):
        if p["poslsh_ms"] >= p["exact_ms"]:
            break
        n = p["n"]
    return n


@torch.no_grad()
def crossover(sigma, s: int, n_max: int, *, start: int = 256, head_dim: int = 64, seed: int = 0,
              watch: Optional[Stopwatch] = None, known: Optional[Tuple[float, float]] = None) -> dict:
    """Time poslsh's forward (torch backend, causal, ``s`` samples) against exact ALiBi
    on random Q/K/V with bandwidths ``sigma`` at n = start, 2 start, ..., ``n_max``, and
    at 2 ``n_max`` when poslsh is not faster at ``n_max`` (unless the machine is busy or
    short of memory: the exact side's cost grows 4x). ``known``: the ``(poslsh_ms,
    exact_ms)`` already measured at ``n_max``. Returns the points and
    :func:`crossover_length`."""
    watch = watch or Stopwatch()
    parts = sample_partitions(sigma, s, seed=seed + s)     # blocks are defined for every n: one draw serves all
    grid = [min(start, n_max)]
    while grid[-1] * 2 <= n_max:
        grid.append(grid[-1] * 2)
    if grid[-1] != n_max:
        grid.append(n_max)
    points: List[dict] = []

    def measure(n):
        if n == n_max and known is not None:
            return dict(n=n, poslsh_ms=known[0], exact_ms=known[1])
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, len(sigma), n, head_dim, generator=g) for _ in range(3))
        ex = _exact(q, k, v, sigma, watch)[1]
        return dict(n=n, poslsh_ms=watch.median_ms(lambda: poslsh_attention(q, k, v, parts, causal=True,
                                                                            backend="torch")), exact_ms=ex)
    for n in grid:
        points.append(measure(n))
    not_beyond = None
    if points[-1]["poslsh_ms"] >= points[-1]["exact_ms"]:
        if watch.wall_s > 0 and watch.cpu_s / watch.wall_s < BUSY_CPU_PER_WALL:
            not_beyond = "the machine is busy"
        elif _exact_bytes(len(sigma), 2 * n_max) > 0.25 * _memory_gib() * 2 ** 30:
            not_beyond = "not enough memory"
        else:
            points.append(measure(2 * n_max))
    return dict(s=s, heads=len(sigma), head_dim=head_dim, points=points, n=crossover_length(points),
                not_beyond=not_beyond)


# ------------------------------------------------------------------ the job
def run(cfg: DemoConfig, *, progress: Optional[Callable[[str], None]] = None) -> DemoResult:
    """Norms, bounds, output errors and timings for every s, then the crossover
    search; ``progress`` gets a line per step."""
    cfg.check()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0     # before our own work adds to it
    q, k, v, sigma, source = _load_qkv(cfg)
    H, n = q.shape[1], cfg.n
    result = DemoResult(config=dataclasses.asdict(cfg), qkv_source=source)
    watch = Stopwatch()
    with torch.no_grad():
        exact, result.time_exact_ms = _exact(q, k, v, sigma, watch)
    for sampler in cfg.samplers:
        method, size = parse_sampler(sampler)
        times = result.time_poslsh_ms.setdefault(sampler, {})
        for s in cfg.samples:
            parts = sample_partitions(sigma, s, seed=cfg.seed + s, sampler=method, group_size=size)
            with torch.no_grad():
                approx = poslsh_attention(q, k, v, parts, causal=True, backend="torch")
                times[s] = watch.median_ms(lambda: poslsh_attention(q, k, v, parts, causal=True, backend="torch"))
            out_err = (exact - approx).abs().amax((0, 2, 3))
            errs = theory.mask_error_norms(parts, n)
            max_bound = theory.max_norm_bound_for(parts, n, cfg.delta)
            for h in range(H):
                sg = float(sigma[h])
                result.rows.append(DemoRow(s, h, sg, float(errs.spectral[h]),
                                           theory.spectral_expectation_bound(n, s, sg, cfg.bound_c),
                                           float(errs.max[h]), max_bound, float(out_err[h]), sampler))
            if progress is not None:
                progress(f"  {sampler} s={s:<4d} done ({times[s]:.0f} ms per poslsh call)")
    del exact, approx
    if cfg.crossover_s:
        s = cfg.crossover_s
        first = result.time_poslsh_ms.get("iid", {})
        known = (first[s], result.time_exact_ms) if s in first else None
        result.crossover = crossover(sigma, s, n, start=cfg.crossover_from, head_dim=q.shape[-1], seed=cfg.seed,
                                     watch=watch, known=known)
        if progress is not None:
            progress(f"  crossover search at s={s} done (n = {[p['n'] for p in result.crossover['points']]})")
    ratio = watch.cpu_s / watch.wall_s if watch.wall_s > 0 else float("nan")
    result.timing = dict(cpu_s=watch.cpu_s, wall_s=watch.wall_s, cpu_per_wall=ratio, load_before=load,
                         cpus=_cpus(), threads=torch.get_num_threads(), repeats=watch.repeats,
                         warning=busy_warning(ratio, load, _cpus()))
    return result


def write(result: DemoResult, out_dir=None) -> Tuple[Path, Path]:
    """Figure 1 (``figure1.png``) and ``demo.json`` under ``out_dir`` (default: the
    run's ``out``), atomically; returns both paths."""
    from poslsh_paper.experiments.plots import plot_figure1

    cfg = result.config
    out = Path(out_dir if out_dir is not None else cfg["out"])
    sigma = float(alibi_sigmas(cfg["num_heads"])[cfg["figure_head"]])
    fig = plot_figure1(sigma, cfg["seed"], cfg["figure_window"], out / "figure1.png")
    return fig, atomic_write_json(out / "demo.json", dataclasses.asdict(result))


def _x(ratio: float) -> str:
    """A speedup with the digits that matter: 0.064x, 1.04x, 15x."""
    return f"{ratio:.2g}x" if ratio < 1 else f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.0f}x"


def format_crossover(res: DemoResult) -> List[str]:
    """Where poslsh starts to win on this machine, and whether to believe it."""
    t, xo = res.timing, res.crossover
    lines = [f"times: median of {t.get('repeats', 3)} calls, {t.get('threads')} torch threads; exact ALiBi = "
             "SDPA with the materialised [H, n, n] bias"]
    if xo is not None:
        pts = ", ".join(f"{p['n']}: {_x(p['exact_ms'] / p['poslsh_ms'])}" for p in xo["points"])
        where = (f"from n = {xo['n']} on" if xo["n"] is not None
                 else f"at no n up to {xo['points'][-1]['n']}")
        if xo.get("not_beyond"):
            where += f" (n = {2 * xo['points'][-1]['n']} not tried: {xo['not_beyond']})"
        lines.append(f"crossover (s={xo['s']}, {xo['heads']} heads, measured): poslsh's forward is faster than "
                     f"exact ALiBi {where}  [speedup by n: {pts}]")
    if t.get("warning"):
        lines.append(t["warning"])
    return lines


def format_table(res: DemoResult) -> str:
    cfg = res.config
    lines = [
        f"n={cfg['n']}, {len(set(r.head for r in res.rows))} ALiBi heads, causal, Q/K/V: {res.qkv_source}",
        f"bounds: eq.(1) E||L*-M~|| <= C Psi (sqrt(log n/s) + log n/s) with C={cfg['bound_c']:g}; "
        f"eq.(3) ||L*-M~||_max <= sqrt(log(2n^2/delta)/(2s)) at delta={cfg['delta']:g}",
        "",
        f"{'sampler':>10} {'s':>4} {'sigma':>6} | {'||L*-M~||':>10} {'eq.(1)':>9} | {'||.||_max':>9} {'eq.(3)':>7} | "
        f"{'||T*-T~||_max':>13} | {'poslsh ms':>9} {'exact ms':>9} {'speedup':>7}",
    ]
    for r in res.rows:
        t = res.time_poslsh_ms[r.sampler][r.s]
        timing = f"{t:9.1f} {res.time_exact_ms:9.1f} {_x(res.time_exact_ms / t):>7}" if r.head == 0 else ""
        lines.append(f"{r.sampler:>10} {r.s:4d} {r.sigma:6.0f} | {r.spectral:10.3f} {r.spectral_bound:9.2f} | "
                     f"{r.max_norm:9.4f} {r.max_bound:7.3f} | {r.output_error:13.4f} | {timing}")
    return "\n".join(lines + format_side_by_side(res) + [""] + format_crossover(res))


def format_side_by_side(res: DemoResult) -> List[str]:
    """Each correlated sampler's errors over i.i.d.'s at the same s (geometric mean over heads)."""
    others = [sp for sp in dict.fromkeys(r.sampler for r in res.rows) if sp != "iid"]
    if not others or not any(r.sampler == "iid" for r in res.rows):
        return []
    by = {(r.sampler, r.s, r.head): r for r in res.rows}
    lines = ["", "error ratio to iid at the same s (geometric mean over heads; < 1: better):"]
    for sp in others:
        for s in sorted({r.s for r in res.rows if r.sampler == sp}):
            pairs = [(r, by.get(("iid", s, r.head))) for r in res.rows if r.sampler == sp and r.s == s]
            pairs = [(a, b) for a, b in pairs if b is not None]
            if not pairs:
                continue
            geo = lambda f: math.exp(sum(math.log(max(f(a), 1e-300) / max(f(b), 1e-300))     # noqa: E731
                                         for a, b in pairs) / len(pairs))
            lines.append(f"  {sp} s={s}: ||L*-M~|| {geo(lambda r: r.spectral):.2f}x, ||.||_max "
                         f"{geo(lambda r: r.max_norm):.2f}x, ||T*-T~||_max {geo(lambda r: r.output_error):.2f}x")
    return lines


def main(cfg: DemoConfig) -> int:
    cfg.check()
    print(f"poslsh demo: n={cfg.n}, s in {list(cfg.samples)}, samplers {list(cfg.samplers)}, "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    res = run(cfg, progress=print)
    print()
    print(format_table(res))
    fig, js = write(res, cfg.out)
    print(f"\nwrote {fig} (Figure 1 analog) and {js}{reference_note(cfg.out)}  [{time.perf_counter() - t0:.0f} s]")
    return 0
