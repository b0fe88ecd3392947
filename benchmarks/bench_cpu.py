"""CPU benchmark: poslsh (torch backend) vs exact ALiBi through SDPA, side by side.

Configuration: float32, B=1, H=4 ALiBi heads, d=64, s=10, causal.
* speed: poslsh vs ``F.scaled_dot_product_attention`` given a materialised ALiBi
  float mask (mask built outside the timed region) at n=16384;
* scaling: time(n=65536) / time(n=16384) for poslsh;
* memory: peak resident memory of a fresh process running poslsh at n=65536,
  minus that process's resident memory after creating its inputs.

* busy machine: the same two forwards while a standard background load runs
  (``--load-procs`` processes, each looping 512 x 512 float32 matmuls on
  ``--load-threads`` threads: by default 2 x 2 threads on top of ours, i.e. the
  cores oversubscribed 3x), started and stopped by this script; reports the spread
  (min / median / max) and the busy / quiet ratios.

* the rival: positional LSH against exact ALiBi cut at per-head windows on the same engine
  (``windowed_alibi_attention``, torch backend) — at the cost-matched window (the keys per
  query of positional LSH at s, :func:`poslsh.cost.cost_matched_window`) and at 4 and 8 sigma —
  and against dense SDPA + mask, forward and forward + backward at n=16384 and 65536,
  interleaved rounds, best of each; prints the ratios (``--rival-only`` runs just this).

* samplers: grouped vs i.i.d. partitions (``docs/sampling.md``), forward
  at n=16384 (4096 with ``--quick``): at equal s (s = 5, 10, 20), and at equal
  accuracy: each grouped s against i.i.d. at the s with the same mean
  ``||L* - M~||_max`` (measured here at n=1024 over ``--accuracy-draws`` draws of the
  4 heads, i.i.d. s on a grid, log-log interpolated, then rounded up), plus the
  largest block of each draw (the cost the kernels see). Times are the best of
  interleaved rounds (robust on a shared machine).

Prints medians and ratios, writes ``outputs/bench_cpu.json`` atomically (the committed
``results/bench_cpu.json`` is refreshed only with ``--out results/bench_cpu.json``).
Run: ``python benchmarks/bench_cpu.py [--quick] [--no-busy] [--no-samplers]``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import poslsh
from poslsh import theory
from bench_common import machine, median_seconds, sample_seconds, write_json

B, H, D, S = 1, 4, 64, 10


def inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), S, seed=seed)
    return q, k, v, parts


def run_poslsh(n: int, repeats: int, backward: bool = False) -> float:
    q, k, v, parts = inputs(n)
    if not backward:
        with torch.no_grad():
            return median_seconds(lambda: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch"), repeats)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)

    def step():
        poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch").sum().backward()
    return median_seconds(step, repeats)


def run_sdpa_alibi(n: int, repeats: int) -> float:
    q, k, v, _ = inputs(n)
    mask = poslsh.alibi.alibi_bias(n, poslsh.alibi_slopes(H), causal=True, dtype=torch.float32)[None]
    with torch.no_grad():
        return median_seconds(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), repeats)


def rival_comparison(lengths, rounds: int) -> dict:
    """Best wall / CPU seconds of interleaved rounds: poslsh s=S, the ALiBi window at the cost of
    s=S and at 4 and 8 sigma (all on the torch backend), and dense SDPA + ALiBi mask (n <= 16384)."""
    from poslsh.cost import cost_matched_window
    sigma, slopes = poslsh.alibi_sigmas(H), poslsh.alibi_slopes(H)
    windows = {f"window at the cost of s={S}": cost_matched_window(sigma, S),
               "window 4 sigma": torch.round(4 * sigma).long(), "window 8 sigma": torch.round(8 * sigma).long()}
    out = {}
    for n in lengths:
        q, k, v, parts = inputs(n)
        calls = {f"poslsh s={S}": lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=True,
                                                                           backend="torch")}
        for name, w in windows.items():
            calls[name] = (lambda w: lambda q, k, v: poslsh.windowed_alibi_attention(
                q, k, v, slopes, window=w, causal=True, backend="torch"))(w)
        if n <= 16384:
            mask = poslsh.alibi.alibi_bias(n, slopes, causal=True, dtype=torch.float32)[None]
            calls["dense SDPA + ALiBi mask"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grads = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        modes = {"forward": lambda f: (lambda: f(q, k, v)),
                 "forward+backward": lambda f: (lambda: f(*grads).sum().backward())}
        res = {mode: {name: {"wall": [], "cpu": []} for name in calls} for mode in modes}
        for mode, make in modes.items():
            for name, f in calls.items():
                with torch.set_grad_enabled(mode != "forward"):
                    make(f)()                                   # warm-up
            for _ in range(rounds):
                for name, f in calls.items():
                    with torch.set_grad_enabled(mode != "forward"):
                        t0, c0 = time.perf_counter(), time.process_time()
                        make(f)()
                        res[mode][name]["wall"].append(time.perf_counter() - t0)
                        res[mode][name]["cpu"].append(time.process_time() - c0)
        out[n] = {mode: {name: {"seconds": min(r["wall"]), "cpu_seconds": min(r["cpu"])} for name, r in rows.items()}
                  for mode, rows in res.items()}
        out[n]["windows"] = {name: w.tolist() for name, w in windows.items()}
    return out


def print_rival(res: dict) -> None:
    print("\npositional LSH vs the ALiBi window on the same engine (torch backend), best of interleaved rounds:")
    for n, modes in res.items():
        print(f"  n = {n}: windows per head " + "; ".join(f"{k}: {v}" for k, v in modes["windows"].items()))
        for mode in ("forward", "forward+backward"):
            base = modes[mode][f"poslsh s={S}"]["seconds"]
            for name, r in modes[mode].items():
                print(f"    {mode:17s} {name:32s} {r['seconds'] * 1e3:9.1f} ms   {r['seconds'] / base:6.2f}x poslsh")


IID_GRID = (1, 2, 3, 5, 7, 10, 14, 20, 30, 40, 60, 80, 120, 160, 240, 320)


def mean_max_error(s: int, method: str, draws: int, n: int = 1024) -> float:
    """Mean ``||L* - M~||_max`` over ``draws`` draws x the 4 heads (seeded)."""
    errs = [theory.max_norm_error(poslsh.sample_partitions(poslsh.alibi_sigmas(H), s, seed=1000 + r, sampler=method),
                                  n) for r in range(draws)]
    return float(torch.cat(errs).mean())


def iid_samples_of_error(iid_err: dict, err: float) -> float:
    """The i.i.d. sample size whose mean error is ``err``: log-log linear interpolation of the
    measured curve ``{s: mean error}`` (the measured errors fall with s). Loud outside the
    measured range: that needs a longer ``IID_GRID``, not a guess."""
    import numpy as np

    s, e = zip(*sorted(iid_err.items()))
    if any(a <= b for a, b in zip(e, e[1:])):
        raise ValueError(f"the measured i.i.d. errors do not fall with s ({dict(zip(s, e))}); raise --accuracy-draws")
    if not min(e) <= err <= max(e):
        raise ValueError(f"error {err:.3g} lies outside the i.i.d. curve measured on IID_GRID "
                         f"[{min(e):.3g}, {max(e):.3g}]; extend IID_GRID")
    # np.interp needs increasing abscissae: the curve read from small to large error
    return float(np.exp(np.interp(math.log(err), np.log(e[::-1]), np.log(s[::-1]))))


def sampler_comparison(n: int, repeats: int, draws: int, samples=(5, 10, 20)) -> dict:
    """Grouped vs i.i.d.: accuracy (mean max-norm error at n=1024), the i.i.d. s of equal
    accuracy, and the forward time at ``n`` at equal s and at equal accuracy."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    iid_err = {s: mean_max_error(s, "iid", draws) for s in IID_GRID}

    def setup(s: int, method: str):
        parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), s, seed=0, sampler=method)
        return parts, {"s": s, "method": method, "max_block": parts.max_block_size(n), "times": [], "cpu": []}

    rows = []
    for s in samples:
        err = mean_max_error(s, "grouped", draws)
        s_eq = iid_samples_of_error(iid_err, err)
        cases = [setup(s, "grouped"), setup(s, "iid"), setup(max(s, math.ceil(s_eq)), "iid")]
        # interleaved rounds, best of each: on a shared machine the load hits all three alike,
        # and the minimum is the least disturbed call
        with torch.no_grad():
            for parts, rec in cases:
                poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch")          # warm-up
            for _ in range(repeats):
                for parts, rec in cases:
                    t0, c0 = time.perf_counter(), time.process_time()
                    poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch")
                    rec["times"].append(time.perf_counter() - t0)
                    rec["cpu"].append(time.process_time() - c0)
        # CPU seconds (all threads) of the best call: the work done, much less sensitive than wall
        # time to other processes on the machine
        grouped, iid_same, iid_equal = (dict(rec, seconds=min(rec["times"]), cpu_seconds=min(rec["cpu"]))
                                        for _, rec in cases)
        rows.append({"s": s, "grouped_max_err": err, "iid_max_err_same_s": iid_err.get(s), "iid_s_equal_accuracy": s_eq,
                     "grouped": grouped, "iid_same_s": iid_same,
                     "iid_equal_accuracy": iid_equal,
                     "speedup_same_s": iid_same["seconds"] / grouped["seconds"],
                     "speedup_equal_accuracy": iid_equal["seconds"] / grouped["seconds"],
                     "cpu_ratio_same_s": iid_same["cpu_seconds"] / grouped["cpu_seconds"],
                     "cpu_ratio_equal_accuracy": iid_equal["cpu_seconds"] / grouped["cpu_seconds"]})
    return {"n": n, "accuracy_n": 1024, "accuracy_draws": draws, "iid_grid_max_err": iid_err, "rows": rows}


def print_sampler_comparison(res: dict) -> None:
    print(f"\ngrouped vs iid partitions (forward at n={res['n']}; accuracy = mean ||L*-M~||max at "
          f"n={res['accuracy_n']} over {res['accuracy_draws']} draws x {H} heads):")
    print(f"{'s':>4} {'max err g/iid':>14} {'iid s eq.acc':>12} | {'grouped ms':>10} {'iid ms':>8} "
          f"{'iid@eq ms':>10} | {'x same s':>8} {'x eq.acc':>8} | {'cpu x same s':>12} {'cpu x eq.acc':>12} | "
          f"{'max block g/iid':>16}")
    for r in res["rows"]:
        g, i, e = r["grouped"], r["iid_same_s"], r["iid_equal_accuracy"]
        print(f"{r['s']:4d} {r['grouped_max_err']:.4f}/{r['iid_max_err_same_s']:.4f} "
              f"{r['iid_s_equal_accuracy']:9.1f}   | {g['seconds'] * 1e3:10.1f} "
              f"{i['seconds'] * 1e3:8.1f} {e['seconds'] * 1e3:10.1f} | {r['speedup_same_s']:7.2f}x "
              f"{r['speedup_equal_accuracy']:7.2f}x | {r['cpu_ratio_same_s']:11.2f}x "
              f"{r['cpu_ratio_equal_accuracy']:11.2f}x | {g['max_block']:>7d}/{i['max_block']:<7d}")
    print("ms: best wall time of interleaved rounds; x = iid / grouped (> 1: grouped faster); cpu x: the same with "
          "the CPU seconds of the best call; iid@eq = iid at the s of equal accuracy (rounded up)")


LOAD_SCRIPT = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(512, 512)
while True:
    a @ a
"""


class BackgroundLoad:
    """``procs`` processes of matmul loops on ``threads`` threads each, for a ``with`` block."""

    def __init__(self, procs: int, threads: int):
        self.procs, self.threads, self.children = procs, threads, []

    def __enter__(self):
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        self.children = [subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT, str(self.threads)], env=env)
                         for _ in range(self.procs)]
        time.sleep(1.0)          # let the load reach full speed
        return self

    def __exit__(self, *exc):
        for c in self.children:
            c.terminate()
        for c in self.children:
            c.wait()


def spread(fn, repeats: int) -> dict:
    """Wall seconds of ``fn()`` (after one warm-up): min / median / max, and CPU / wall."""
    walls, cpus = sample_seconds(fn, repeats)
    return {"min": min(walls), "median": statistics.median(walls), "max": max(walls),
            "cpu_per_wall": sum(cpus) / sum(walls)}


def busy_comparison(n: int, repeats: int, procs: int, threads: int) -> dict:
    """poslsh forward and SDPA + ALiBi mask at ``n``, quiet and under the standard load."""
    q, k, v, parts = inputs(n)
    mask = poslsh.alibi.alibi_bias(n, poslsh.alibi_slopes(H), causal=True, dtype=torch.float32)[None]
    fns = {"poslsh torch, forward": lambda: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch"),
           "SDPA + ALiBi mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}
    out = {}
    with torch.no_grad():
        quiet = {name: spread(fn, repeats) for name, fn in fns.items()}
        with BackgroundLoad(procs, threads):
            busy = {name: spread(fn, repeats) for name, fn in fns.items()}
    for name in fns:
        out[name] = {"quiet": quiet[name], "busy": busy[name],
                     "busy_over_quiet": busy[name]["median"] / quiet[name]["median"]}
    return out


def _peak_rss() -> int:
    """Peak resident set size of this process (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def peak_memory_child(n: int) -> None:
    """Run in a fresh process: print peak RSS growth (bytes) of one poslsh call.
    (ru_maxrss would carry the parent's peak across exec; VmHWM is reset instead.)"""
    q, k, v, parts = inputs(n)
    with torch.no_grad():
        poslsh.poslsh_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], parts, causal=True, backend="torch")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                       # reset VmHWM to the current RSS
    base = _peak_rss()
    with torch.no_grad():
        poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch")
    peak = _peak_rss()
    print(json.dumps({"n": n, "peak_growth_bytes": peak - base, "peak_rss_bytes": peak}))


def peak_memory(n: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--memory-child", str(n)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller n (4096 / 16384), fewer repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="outputs/bench_cpu.json")
    ap.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True,
                    help="also time under a standard background load (default on)")
    ap.add_argument("--load-procs", type=int, default=2, help="background load: processes")
    ap.add_argument("--load-threads", type=int, default=2, help="background load: threads per process")
    ap.add_argument("--samplers", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare grouped with i.i.d. partitions at equal s and equal accuracy (default on)")
    ap.add_argument("--samplers-only", action="store_true", help="only the sampler comparison")
    ap.add_argument("--accuracy-draws", type=int, default=8, help="sampler comparison: draws per accuracy point")
    ap.add_argument("--rival-only", action="store_true", help="only positional LSH vs the ALiBi window")
    ap.add_argument("--rounds", type=int, default=5, help="rival comparison: interleaved rounds")
    args = ap.parse_args()
    if args.memory_child is not None:
        peak_memory_child(args.memory_child)
        return
    machine_line = f"{machine()}, {torch.get_num_threads()} threads"
    if args.rival_only:
        res = rival_comparison((4096, 16384) if args.quick else (16384, 65536), args.rounds)
        print_rival(res)
        write_json(args.out, {"machine": machine_line, "load_after": os.getloadavg()[0], "rival": res})
        print(f"wrote {args.out}")
        return
    if args.samplers_only:
        n = 4096 if args.quick else 16384
        res = sampler_comparison(n, args.repeats, args.accuracy_draws)
        print_sampler_comparison(res)
        write_json(args.out, {"machine": machine_line, "samplers": res})
        print(f"wrote {args.out}")
        return
    n_small, n_large = (4096, 16384) if args.quick else (16384, 65536)
    reps = 3 if args.quick else args.repeats
    print(f"machine: {machine_line}")
    print(f"config: float32 B={B} H={H} d={D} s={S} causal, ALiBi sigmas {poslsh.alibi_sigmas(H).tolist()}")

    mem = peak_memory(n_large)      # first, in a fresh process
    t_small = run_poslsh(n_small, reps)
    t_sdpa = run_sdpa_alibi(n_small, max(3, reps // 2))
    t_large = run_poslsh(n_large, reps)
    t_small_bwd = run_poslsh(n_small, reps, backward=True)
    rows = [
        ("SDPA + materialised ALiBi mask", n_small, t_sdpa),
        ("poslsh torch, forward", n_small, t_small),
        ("poslsh torch, forward", n_large, t_large),
        ("poslsh torch, forward+backward", n_small, t_small_bwd),
    ]
    print(f"\n{'method':36s} {'n':>7s} {'median ms':>10s}")
    for name, n, t in rows:
        print(f"{name:36s} {n:7d} {t * 1e3:10.1f}")
    speedup = t_sdpa / t_small
    scaling = t_large / t_small
    print(f"\nspeedup poslsh vs SDPA+ALiBi mask at n={n_small}: {speedup:.1f}x   (target >= 12x)")
    print(f"time(n={n_large}) / time(n={n_small}): {scaling:.2f}   (target <= 4.5)")
    print(f"peak memory growth at n={n_large}: {mem['peak_growth_bytes'] / 2**20:.0f} MiB "
          f"(peak RSS {mem['peak_rss_bytes'] / 2**30:.2f} GiB; target < 2 GiB)")
    busy = None
    if args.busy:
        busy = busy_comparison(n_small, max(5, reps), args.load_procs, args.load_threads)
        print(f"\nunder a background load of {args.load_procs} x {args.load_threads}-thread matmul processes "
              f"(n={n_small}, wall ms min / median / max, CPU time per wall second):")
        for name, r in busy.items():
            for when in ("quiet", "busy"):
                x = r[when]
                print(f"  {name:26s} {when:5s} {x['min'] * 1e3:8.1f} / {x['median'] * 1e3:8.1f} / "
                      f"{x['max'] * 1e3:8.1f}   cpu/wall {x['cpu_per_wall']:.2f}")
            print(f"  {name:26s} busy / quiet median: {r['busy_over_quiet']:.2f}x")
    rival = rival_comparison((n_small, n_large), max(3, reps))
    print_rival(rival)
    samplers = None
    if args.samplers:
        samplers = sampler_comparison(n_small, reps, args.accuracy_draws)
        print_sampler_comparison(samplers)
    write_json(args.out, {
        "machine": machine_line, "config": {"B": B, "H": H, "d": D, "s": S, "causal": True, "dtype": "float32"},
        "median_seconds": {f"{name} @ {n}": t for name, n, t in rows},
        "speedup_vs_sdpa_alibi": speedup, "scaling_ratio": scaling, "peak_memory": mem, "busy": busy,
        "samplers": samplers, "rival": rival,
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
