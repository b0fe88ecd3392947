"""How the torch backend should count a grouped tile: difference array or lattice formula?

The torch backend builds ``count[i, j]`` (in how many masks query ``i`` and key ``j`` share a
block) for a tile of ``M`` query rows x ``R`` keys with a difference array: ``+1`` at each
row's block start, ``-1`` at its end (``2 s`` scatters per row), one cumulative sum. For grouped
partitions the count can also be formed group by group, ``sum_g max(0, k_g - |lat_g(i) -
lat_g(j)|)`` (``poslsh.partitions.group_count``): ``G`` elementwise passes over the tile. This
script times both on the same tile sizes, one thread, side by side, and prints the ratio
(medians). Contents do not matter for the cost (random bounds and lattice indices).

    python benchmarks/bench_count.py [--rows 4096] [--keys 256] [--samples 20] [--group-size 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--keys", type=int, default=256)
    p.add_argument("--samples", type=int, nargs="+", default=[5, 10, 20, 40])
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=21)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    M, R = a.rows, a.keys
    print(f"count of a {M} x {R} tile, one thread, median of {a.repeats} (ms)")
    print(f"{'s':>4} {'G':>3} {'difference array':>17} {'lattice':>8} {'lattice / difference':>21}")
    for s in a.samples:
        G = max(2, -(-s // a.group_size))
        starts = torch.randint(0, R, (M, s), generator=g)
        ends = torch.clamp(starts + torch.randint(1, R, (M, s), generator=g), max=R)
        lat_r = torch.randint(0, 10 * R, (G, M, 1), generator=g, dtype=torch.int32)
        lat_c = torch.randint(0, 10 * R, (G, 1, R), generator=g, dtype=torch.int32)
        k = torch.full((G, 1, 1), a.group_size, dtype=torch.int32)
        one = torch.ones_like(starts)

        def difference():
            d = torch.zeros(M, R + 1, dtype=torch.int64)
            d.scatter_add_(1, starts, one).scatter_add_(1, ends, -one)
            return torch.cumsum(d, 1)

        def lattice():
            c = torch.zeros(M, R, dtype=torch.int32)
            for i in range(G):
                c += (k[i] - (lat_r[i] - lat_c[i]).abs_()).clamp_(min=0)
            return c

        for f in (difference, lattice):         # warm-up: allocations, page faults
            for _ in range(3):
                f()
        times = {f.__name__: [] for f in (difference, lattice)}
        for _ in range(a.repeats):              # interleaved: both see the same machine load
            for f in (difference, lattice):
                t0 = time.perf_counter()
                f()
                times[f.__name__].append(time.perf_counter() - t0)
        d, l_ = (statistics.median(times[n]) * 1e3 for n in ("difference", "lattice"))
        print(f"{s:>4} {G:>3} {d:>17.2f} {l_:>8.2f} {l_ / d:>20.2f}x")


if __name__ == "__main__":
    main()
