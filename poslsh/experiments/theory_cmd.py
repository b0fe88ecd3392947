"""``poslsh theory``: the guarantees of Theorems 2.1 and 2.2 for given (n, sigma, s, delta).

Prints Psi_sigma, the spectral-norm bounds of eqs. (1)-(2) (with the universal
constant C explicit), the max-norm deviation of eq. (3), the samples needed for
a target max-norm error, and the block-size bound of eq. (4) with the running
time it implies. With ``--measure`` it also draws partitions and prints the
realised norms and largest block next to the bounds.
"""
from __future__ import annotations

import argparse
import math
from typing import List

import torch

from .. import theory
from ..alibi import alibi_sigmas
from ..partitions import sample_partitions


def theory_rows(n: int, sigmas: List[float], samples: List[int], delta: float, C: float) -> List[dict]:
    rows = []
    for sigma in sigmas:
        for s in samples:
            rows.append({
                "sigma": sigma, "s": s, "psi": theory.psi(sigma),
                "spectral_expectation": theory.spectral_expectation_bound(n, s, sigma, C),
                "spectral_deviation": theory.spectral_deviation_bound(n, s, sigma, delta, C),
                "max_deviation": theory.max_norm_deviation_bound(n, s, delta),
                "block_bound": theory.block_size_bound(sigma, s, delta) if delta < 1 / math.e else float("nan"),
            })
    return rows


def main(args: argparse.Namespace) -> int:
    sigmas = args.sigma or alibi_sigmas(args.heads).tolist()
    print(f"n={args.n}, delta={args.delta:g}, C={args.C:g} (the theorems' universal constant; "
          f"`poslsh audit` measures the smallest C that holds)")
    print(f"eq.(3): s >= log(2n^2/delta)/(2 eps^2) = {theory.samples_for_max_norm(args.eps, args.n, args.delta)} "
          f"samples give ||L*-M~||_max < {args.eps:g} with probability >= {1 - args.delta:g}\n")
    header = f"{'sigma':>7} {'s':>6} {'Psi':>8} | {'eq.(1) E||.||':>13} {'eq.(2) eps':>11} | " \
             f"{'eq.(3) eps':>10} | {'eq.(4) b_max':>12}"
    if args.measure:
        header += f" | {'||L*-M~||':>9} {'||.||_max':>9} {'b_max':>6}"
    print(header)
    for row in theory_rows(args.n, sigmas, args.s, args.delta, args.C):
        line = (f"{row['sigma']:7.2f} {row['s']:6d} {row['psi']:8.2f} | {row['spectral_expectation']:13.3f} "
                f"{row['spectral_deviation']:11.3f} | {row['max_deviation']:10.4f} | {row['block_bound']:12.1f}")
        if args.measure:
            parts = sample_partitions(torch.tensor([row["sigma"]]), row["s"], seed=args.seed)
            errs = theory.mask_error_norms(parts, args.n)
            line += f" | {float(errs.spectral[0]):9.3f} {float(errs.max[0]):9.4f} {parts.max_block_size(args.n):6d}"
        print(line)
    return 0


def register(sub) -> None:
    p = sub.add_parser("theory", help="bounds of Theorems 2.1/2.2 for given n, sigma, s, delta",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4, help="use the ALiBi sigmas of this many heads (default 4)")
    p.add_argument("--sigma", type=float, nargs="+", help="explicit bandwidths instead of ALiBi's")
    p.add_argument("--s", type=int, nargs="+", default=[1, 10, 100, 1000])
    p.add_argument("--delta", type=float, default=0.05, help="failure probability (default 0.05)")
    p.add_argument("--eps", type=float, default=0.05, help="target max-norm error for the sample count")
    p.add_argument("--C", type=float, default=1.0, help="universal constant of eqs. (1)-(2) (default 1)")
    p.add_argument("--measure", action="store_true", help="also draw partitions and print realised norms")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)
