"""CPU benchmark: 2-D positional LSH (``poslsh_attention_nd``) vs exact 2-D ALiBi, side by side.

Configuration: float32, B = 1, H = 4 heads, d = 64, s = 10, non-causal (images), square grids of
64 x 64 and 128 x 128 tokens (n = 4,096 and 16,384). Exact 2-D ALiBi is
``F.scaled_dot_product_attention`` with the materialised ``[1, H, n, n]`` float bias
``-||x_i - x_j||_1 / sigma_h`` (built outside the timed region; 4 GiB at 128 x 128).
Two head sets: 2-D ALiBi bandwidths sized for images, sigma = 1, 2, 4, 8 patches (the default), and
the 1-D ALiBi series sigma = 4, 16, 64, 256 (``--alibi-sigmas``), whose wide heads cover the whole
grid in most samples (no saving possible there: their boxes are the grid).

Both run on one thread; the time reported is the median **CPU time** of the process per call
(``time.process_time``), which on one thread is the compute time and, unlike wall-clock time, does not
count the time the process waits for a core on this shared, often oversubscribed VM; the wall-clock
medians are recorded next to it. Prints medians, the speed-up over exact at each size and the
scaling time(128^2) / time(64^2) (4 = linear in n, 16 = quadratic); writes ``outputs/bench_2d.json``
atomically (``--out results/bench_2d.json`` for the committed copy).
Run: ``python benchmarks/bench_2d.py [--quick]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import poslsh
from bench_common import machine, sample_seconds, write_json

B, D, S = 1, 64, 10
SIGMAS = {"image": (1.0, 2.0, 4.0, 8.0), "alibi": (4.0, 16.0, 64.0, 256.0)}


def median_cpu_and_wall(fn, repeats: int):
    """Median (CPU seconds, wall seconds) of ``fn()`` over ``repeats`` calls after one warm-up call."""
    wall, cpu = sample_seconds(fn, repeats)
    return statistics.median(cpu), statistics.median(wall)


def inputs(G: int, sigma, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, len(sigma), G * G, D, generator=g) for _ in range(3))
    return q, k, v, poslsh.sample_partitions_nd(torch.tensor(sigma, dtype=torch.float64), S, seed=seed)


def time_poslsh(G: int, sigma, repeats: int, backward: bool = False) -> float:
    q, k, v, parts = inputs(G, sigma)
    if not backward:
        with torch.no_grad():
            return median_cpu_and_wall(lambda: poslsh.poslsh_attention_nd(q, k, v, parts, grid=(G, G)), repeats)
    for t in (q, k, v):
        t.requires_grad_(True)
    return median_cpu_and_wall(lambda: poslsh.poslsh_attention_nd(q, k, v, parts, grid=(G, G)).sum().backward(), repeats)


def time_exact(G: int, sigma, repeats: int) -> float:
    q, k, v, _ = inputs(G, sigma)
    mask = poslsh.reference.alibi_bias_nd(poslsh.partitions_nd.grid_coords(G, G), 1.0 / torch.tensor(sigma, dtype=torch.float64),
                                dtype=torch.float32)[None]
    with torch.no_grad():
        return median_cpu_and_wall(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32 x 32 and 64 x 64 only, one repeat")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both (default 1: the shared 2-core VM is oversubscribed; 2 threads there make many small ops wait on each other)")
    ap.add_argument("--heads", choices=("image", "alibi", "both"), default="both", help="head sets to run")
    ap.add_argument("--out", default="outputs/bench_2d.json", help="where to write the JSON results")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grids = (32, 64) if args.quick else (64, 128)
    repeats = 1 if args.quick else 5
    sets = ("image", "alibi") if args.heads == "both" else (args.heads,)
    machine_line = f"{machine()} (load at start), {args.threads} threads"
    print(f"bench_2d: float32, B={B}, H=4, d={D}, s={S}, non-causal; {machine_line}")
    res = {"config": {"B": B, "H": 4, "d": D, "s": S, "causal": False, "grids": grids, "threads": args.threads},
           "machine": machine_line, "timing": "median CPU time (process_time) per call, one thread; wall medians in wall_ms",
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": []}
    for name in sets:
        sigma = SIGMAS[name]
        times = {}
        for G in grids:
            (fwd, fwd_w), (fb, fb_w) = time_poslsh(G, sigma, repeats), time_poslsh(G, sigma, repeats, backward=True)
            exact, exact_w = time_exact(G, sigma, repeats)
            times[G] = (fwd, fb, exact)
            row = {"heads": name, "sigma": sigma, "grid": f"{G}x{G}", "n": G * G, "poslsh_fwd_ms": fwd * 1e3,
                   "poslsh_fwd_bwd_ms": fb * 1e3, "exact_sdpa_ms": exact * 1e3, "speedup_fwd": exact / fwd,
                   "wall_ms": {"poslsh_fwd": fwd_w * 1e3, "poslsh_fwd_bwd": fb_w * 1e3, "exact_sdpa": exact_w * 1e3}}
            res["rows"].append(row)
            print(f"  sigma={sigma} {G}x{G} (n={G * G}): poslsh fwd {fwd * 1e3:8.0f} ms, fwd+bwd {fb * 1e3:8.0f} ms | "
                  f"exact SDPA + bias {exact * 1e3:8.0f} ms | speed-up {exact / fwd:5.2f}x  (CPU time; wall "
                  f"{fwd_w * 1e3:.0f} / {fb_w * 1e3:.0f} / {exact_w * 1e3:.0f} ms)", flush=True)
        lo, hi = grids
        scaling = {"poslsh_fwd": times[hi][0] / times[lo][0], "poslsh_fwd_bwd": times[hi][1] / times[lo][1],
                   "exact": times[hi][2] / times[lo][2]}
        res.setdefault("scaling", {})[name] = scaling
        print(f"  scaling {hi}^2/{lo}^2 (4x the tokens): poslsh fwd {scaling['poslsh_fwd']:.2f}, fwd+bwd "
              f"{scaling['poslsh_fwd_bwd']:.2f}, exact {scaling['exact']:.2f}")
    print(f"wrote {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
