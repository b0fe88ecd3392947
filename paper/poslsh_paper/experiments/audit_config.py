"""``poslsh audit``'s configuration and presets (the job is :mod:`poslsh_paper.experiments.audit`),
and which convergence rows ``--convergence-rows auto`` means. Imports nothing heavy."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Dict, Optional, Tuple

import tyro

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.model_inputs import ModelInputs, check_out_dir, check_samplers

__all__ = ["AuditConfig", "PRESETS", "USER_ROWS", "REFERENCE_ROWS", "auto_rows", "COMMANDS"]

# --convergence-rows auto: the user's own `poslsh convergence` runs (full and --quick), the most
# recently written first; else the committed reference
USER_ROWS = ("outputs/convergence/rows.csv", "outputs/convergence/quick/rows.csv")
REFERENCE_ROWS = "results/convergence/rows.csv"


def auto_rows() -> Optional[str]:
    """The rows ``--convergence-rows auto`` audits: the newest of :data:`USER_ROWS` that exists,
    else :data:`REFERENCE_ROWS` when it exists, else None."""
    mine = [p for p in USER_ROWS if Path(p).is_file()]
    if mine:
        return max(mine, key=lambda p: Path(p).stat().st_mtime)
    return REFERENCE_ROWS if Path(REFERENCE_ROWS).is_file() else None


@dataclass
class AuditConfig(ModelInputs):
    delta: float = 0.05                                 # confidence: every check is at level 1 - delta
    samplers: Tuple[str, ...] = ("iid", "grouped")      # each against its own bound (also grouped-k<k>, grouped-sqrt)
    # matrix checks (no model needed)
    num_heads: int = 9                                  # ALiBi slopes for this head count (SmolLM2: 9)
    n_matrix: int = 1024                                # n for the matrix checks
    trials: int = 60                                    # independent draws for the matrix checks
    samples: Tuple[int, ...] = (1, 10, 100, 1000, 10000)  # s for the matrix checks
    slope_tol: float = 0.1                              # accepted |slope + 1/2| for the spectral decay
    fit_min_s: int = 100                                # the slope is fitted on s >= this (analysis.records.FIT_MIN_S)
    # Theorem 2.2 on real Q/K/V
    n_output: int = 2048                                # n for Theorem 2.2 on real Q/K/V
    num_inputs: Annotated[int, tyro.conf.arg(aliases=("--inputs",))] = 8  # real inputs for Theorem 2.2
    draws: int = 4                                      # independent draws per input
    output_samples: Tuple[int, ...] = (100, 1000, 10000)  # s for Theorem 2.2
    skip_output: bool = False                           # matrix checks only (no model needed)
    # also audit a convergence run's rows.csv ('' skips; auto: the newest of your outputs/convergence/rows.csv
    # and outputs/convergence/quick/rows.csv, else the committed results/convergence/rows.csv)
    convergence_rows: str = "auto"
    out: str = "outputs/audit"                          # output directory (results/audit: the reference)

    def check(self) -> None:
        self.check_inputs()
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")
        check_samplers(self.samplers)
        for name in ("num_heads", "n_matrix", "trials", "n_output", "num_inputs", "draws"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        for name in ("samples", "output_samples"):
            got = list(getattr(self, name))
            if not got or min(got) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: give sample sizes >= 1, got {got}")
        if self.heads is not None and max(self.heads) >= self.num_heads:
            raise ConfigError(f"--heads: {list(self.heads)} out of range for --num-heads {self.num_heads}")
        if self.convergence_rows not in ("", "auto") and not Path(self.convergence_rows).is_file():
            raise ConfigError(f"--convergence-rows: no such file {self.convergence_rows} ('' to skip, auto to "
                              f"use your latest convergence run, else the committed rows)")
        check_out_dir("--out", self.out)


PRESETS: Dict[str, AuditConfig] = {
    "default": AuditConfig(),
    "quick": AuditConfig(n_matrix=512, trials=20, samples=(1, 10, 100, 1000), n_output=1024, num_inputs=2, draws=2,
                         output_samples=(100, 1000), out="outputs/audit/quick"),
}


PRESET_HELP = {"default": "n=1024 x 60 matrix trials, Theorem 2.2 at n=2048 on 8 inputs -> outputs/audit",
               "quick": "n=512 x 20 trials, Theorem 2.2 at n=1024 on 2 inputs -> outputs/audit/quick"}

COMMANDS = [Command(name="audit", help="check the empirical errors against Theorems 2.1/2.2 (pass/fail table)",
                    config=AuditConfig, presets=PRESETS, default_preset="default",
                    main="poslsh_paper.experiments.audit:main", quick="quick", preset_help=PRESET_HELP)]
