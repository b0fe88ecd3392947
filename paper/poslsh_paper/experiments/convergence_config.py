"""``poslsh convergence``'s configuration and presets (the job is
:mod:`poslsh_paper.experiments.convergence`). Imports nothing heavy: ``--help`` is built from it."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Dict, Tuple

import tyro

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.model_inputs import ModelInputs, check_out_dir, check_samplers

__all__ = ["ConvergenceConfig", "PRESETS", "VERSION", "METRICS", "COMMANDS"]

VERSION = 3      # bump when the per-input computation changes (invalidates checkpoints); 2: blake2b draw seeds;
                 # 3: samplers
METRICS = ("spectral", "max", "t_err")


@dataclass
class ConvergenceConfig(ModelInputs):
    n: int = 4096                                       # tokens per input
    num_inputs: Annotated[int, tyro.conf.arg(aliases=("--inputs",))] = 30  # number of input segments
    samples: Tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000)  # sample sizes s
    samplers: Tuple[str, ...] = ("iid", "grouped")      # side by side (also stratified, grouped-k<size>, grouped-sqrt)
    delta: float = 0.05                                 # confidence parameter of the eq. (3) curve
    # universal constant C drawn in eq. (1)
    bound_c: Annotated[float, tyro.conf.arg(aliases=("--C", "--bound-C"))] = 1.0
    out: str = "outputs/convergence"                    # output directory (results/convergence: the reference)
    resume: bool = True                                 # reuse matching checkpoints of a previous run
    cross_check: bool = True                            # compare with the library on input 0
    plot: bool = True                                   # draw convergence.png (else CSV/JSON only)

    def fingerprint(self) -> str:
        """What a checkpoint depends on: inputs, heads, draws and :data:`VERSION`."""
        keys = dict(n=self.n, layers=list(self.layers), heads=None if self.heads is None else list(self.heads),
                    samples=list(self.samples), samplers=list(self.samplers), seed=self.seed, rope=self.rope,
                    model=self.model, corpora=list(self.corpora), inputs_from=self.inputs_from, version=VERSION)
        return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]

    def check(self) -> None:
        self.check_inputs()
        if self.n < 2:
            raise ConfigError(f"--n: need at least 2 tokens per input, got {self.n}")
        if self.num_inputs < 1:
            raise ConfigError(f"--num-inputs: need at least one input, got {self.num_inputs}")
        if not self.samples or min(self.samples) < 1:
            raise ConfigError(f"--samples: give sample sizes >= 1, got {list(self.samples)}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")
        if not self.bound_c > 0:
            raise ConfigError(f"--bound-c: must be > 0, got {self.bound_c}")
        check_samplers(self.samplers)
        check_out_dir("--out", self.out)


PRESETS: Dict[str, ConvergenceConfig] = {
    "default": ConvergenceConfig(),
    "quick": ConvergenceConfig(n=1024, num_inputs=4, samples=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
                               out="outputs/convergence/quick"),
}

PRESET_HELP = {"default": "n=4096, 30 inputs, s from 1 to 10000 (the paper's Figure 2) -> outputs/convergence",
               "quick": "n=1024, 4 inputs, s up to 1000 -> outputs/convergence/quick"}

COMMANDS = [Command(name="convergence",
                    help="norm convergence of ||L*-M~||, ||L*-M~||max, ||T*-T~||max vs s (paper Fig. 2)",
                    config=ConvergenceConfig, presets=PRESETS, default_preset="default",
                    main="poslsh_paper.experiments.convergence:main", quick="quick", preset_help=PRESET_HELP)]
