"""``poslsh theory``: the guarantees of Theorems 2.1 and 2.2 for given (n, sigma, s, delta).

Prints Psi_sigma, the spectral-norm bounds of eqs. (1)-(2) (with the universal
constant C explicit), the max-norm deviation of eq. (3), the samples needed for
a target max-norm error, and the block-size bound of eq. (4) with the running
time it implies. With ``--measure`` it also draws partitions and prints the
realised norms and largest block next to the bounds; with ``--out DIR`` it also
writes the table to ``DIR/bounds.csv``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Dict, List, Optional, Tuple

import tyro

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.model_inputs import check_out_dir

__all__ = ["BoundsConfig", "BoundsResult", "PRESETS", "theory_rows", "run", "write", "main", "format_table",
           "COMMANDS"]


@dataclass
class BoundsConfig:
    n: int = 4096                                   # sequence length
    # use the ALiBi sigmas of this many heads
    num_heads: Annotated[int, tyro.conf.arg(aliases=("--heads",))] = 4
    sigma: Optional[Tuple[float, ...]] = None       # explicit bandwidths instead of ALiBi's
    # sample sizes s
    samples: Annotated[Tuple[int, ...], tyro.conf.arg(aliases=("--s",))] = (1, 10, 100, 1000)
    delta: float = 0.05                             # failure probability
    eps: float = 0.05                               # target max-norm error for the sample count
    # universal constant C of eqs. (1)-(2)
    bound_c: Annotated[float, tyro.conf.arg(aliases=("--C", "--bound-C"))] = 1.0
    measure: bool = False                           # also draw partitions and print realised norms
    seed: int = 0                                   # seed of the partitions drawn by --measure
    out: Optional[str] = None                       # also write the table to OUT/bounds.csv

    def check(self) -> None:
        if self.n < 1:
            raise ConfigError(f"--n: must be >= 1, got {self.n}")
        if self.sigma is None and self.num_heads < 1:
            raise ConfigError(f"--num-heads: must be >= 1, got {self.num_heads}")
        if self.sigma is not None and (not self.sigma or min(self.sigma) <= 0):
            raise ConfigError(f"--sigma: give one or more bandwidths > 0, got {list(self.sigma)}")
        if not self.samples or min(self.samples) < 1:
            raise ConfigError(f"--samples: give sample sizes >= 1, got {list(self.samples)}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")
        if self.eps <= 0:
            raise ConfigError(f"--eps: must be > 0, got {self.eps}")
        if not self.bound_c > 0:
            raise ConfigError(f"--bound-c: must be > 0, got {self.bound_c}")
        if self.out is not None:
            check_out_dir("--out", self.out)


PRESETS: Dict[str, BoundsConfig] = {"default": BoundsConfig()}

FIELDS = ["sigma", "s", "psi", "spectral_expectation", "spectral_deviation", "max_deviation", "block_bound",
          "spectral", "max", "b_max"]


@dataclass
class BoundsResult:
    config: BoundsConfig
    samples_for_eps: int      # eq. (3): s that gives ||L*-M~||_max < eps with probability >= 1 - delta
    rows: List[dict]          # one per (sigma, s): the FIELDS (measured ones only with --measure)


def theory_rows(n: int, sigmas: List[float], samples: List[int], delta: float, C: float) -> List[dict]:
    """The bounds of eqs. (1)-(4) for every (sigma, s)."""
    from poslsh import theory

    rows = []
    for sigma in sigmas:
        for s in samples:
            rows.append({
                "sigma": sigma, "s": s, "psi": theory.psi(sigma),
                "spectral_expectation": theory.spectral_expectation_bound(n, s, sigma, C),
                "spectral_deviation": theory.spectral_deviation_bound(n, s, sigma, delta, C),
                "max_deviation": theory.max_norm_deviation_bound(n, s, delta),
                "block_bound": (theory.block_size_bound(num_samples=s, sigma=sigma, delta=delta)
                                if delta < 1 / math.e else float("nan")),
            })
    return rows


def run(cfg: BoundsConfig) -> BoundsResult:
    import torch

    from poslsh import theory
    from poslsh.alibi import alibi_sigmas
    from poslsh.partitions import sample_partitions

    cfg.check()
    sigmas = list(cfg.sigma) if cfg.sigma is not None else alibi_sigmas(cfg.num_heads).tolist()
    rows = theory_rows(cfg.n, sigmas, list(cfg.samples), cfg.delta, cfg.bound_c)
    if cfg.measure:
        for row in rows:
            parts = sample_partitions(torch.tensor([row["sigma"]]), row["s"], seed=cfg.seed)
            errs = theory.mask_error_norms(parts, cfg.n)
            row.update(spectral=float(errs.spectral[0]), max=float(errs.max[0]), b_max=parts.max_block_size(cfg.n))
    return BoundsResult(cfg, theory.samples_for_max_norm(cfg.eps, cfg.n, cfg.delta), rows)


def write(result: BoundsResult, out) -> Path:
    """``bounds.csv`` (one row per (sigma, s)) under ``out``, atomically."""
    from poslsh_paper.io import atomic_write_text, csv_text

    return atomic_write_text(Path(out) / "bounds.csv", csv_text(result.rows, FIELDS, float_format=".9g"))


def format_table(result: BoundsResult) -> str:
    cfg = result.config
    lines = [f"n={cfg.n}, delta={cfg.delta:g}, C={cfg.bound_c:g} (the theorems' universal constant; "
             f"`poslsh audit` measures the smallest C that holds)",
             f"eq.(3): s >= log(2n^2/delta)/(2 eps^2) = {result.samples_for_eps} "
             f"samples give ||L*-M~||_max < {cfg.eps:g} with probability >= {1 - cfg.delta:g}", ""]
    header = f"{'sigma':>7} {'s':>6} {'Psi':>8} | {'eq.(1) E||.||':>13} {'eq.(2) eps':>11} | " \
             f"{'eq.(3) eps':>10} | {'eq.(4) b_max':>12}"
    if cfg.measure:
        header += f" | {'||L*-M~||':>9} {'||.||_max':>9} {'b_max':>6}"
    lines.append(header)
    for row in result.rows:
        line = (f"{row['sigma']:7.2f} {row['s']:6d} {row['psi']:8.2f} | {row['spectral_expectation']:13.3f} "
                f"{row['spectral_deviation']:11.3f} | {row['max_deviation']:10.4f} | {row['block_bound']:12.1f}")
        if cfg.measure:
            line += f" | {row['spectral']:9.3f} {row['max']:9.4f} {row['b_max']:6d}"
        lines.append(line)
    return "\n".join(lines)


def main(cfg: BoundsConfig) -> int:
    result = run(cfg)
    print(format_table(result))
    if cfg.out is not None:
        print(f"\nwrote {write(result, cfg.out)}")
    return 0


COMMANDS = [Command(name="theory", help="bounds of Theorems 2.1/2.2 for given n, sigma, s, delta",
                    config=BoundsConfig, presets=PRESETS, default_preset="default", main=main,
                    preset_help={"default": "n=4096, the 4 ALiBi sigmas of 4 heads, s in 1, 10, 100, 1000"})]
