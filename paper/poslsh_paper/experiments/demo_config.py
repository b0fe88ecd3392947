"""``poslsh demo``'s configuration and presets (the job is :mod:`poslsh_paper.experiments.demo`).

Imports nothing heavy: ``poslsh demo --help`` is built from this module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Dict, Literal, Tuple

import tyro

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.model_inputs import (ModelInputs, check_out_dir, check_samplers, is_reference,
                                                   missing_prerequisites)

__all__ = ["DemoConfig", "PRESETS", "MODEL_HEADS", "COMMANDS"]

# SmolLM2 has 9 query heads; ALiBi for 9 heads gives these four sigma = 4, 16, 64, 256.
MODEL_HEADS = (1, 3, 5, 7)


@dataclass
class DemoConfig:
    n: int = 4096                       # sequence length
    num_heads: int = 4                  # ALiBi heads (random Q/K/V; their sigmas)
    head_dim: int = 64                  # head dimension of random Q/K/V
    samples: Tuple[int, ...] = (1, 5, 10, 20, 100)  # sample sizes s
    samplers: Tuple[str, ...] = ("iid", "grouped")  # side by side (also stratified, grouped-k<size>, grouped-sqrt)
    delta: float = 0.05                 # confidence for the eq. (3) max-norm bound
    # the universal constant C of eq. (1), shown explicitly
    bound_c: Annotated[float, tyro.conf.arg(aliases=("--C", "--bound-C"))] = 1.0
    seed: int = 0                       # seed of random Q/K/V and of the partition draws
    qkv: Literal["auto", "random", "model"] = "auto"  # Q/K/V: SmolLM2 if installed (auto), random, or require it
    # output directory (results/demo: the committed reference)
    out: Annotated[str, tyro.conf.arg(aliases=("--out-dir",))] = "outputs/demo"
    figure_head: int = 1                # head drawn in Figure 1 (sigma = 16 for 4 heads)
    figure_window: int = 96             # positions shown in Figure 1
    crossover_s: int = 10               # s at which the crossover length is searched (0: no search)
    crossover_from: int = 256           # smallest n of the crossover search (doubling up to n, then 2n if needed)

    def check(self) -> None:
        """Every value, the output directory and (for --qkv model, or the committed
        results/) the model and corpus: before any work."""
        if self.n < 2:
            raise ConfigError(f"--n: need a sequence length >= 2, got {self.n}")
        for name in ("num_heads", "head_dim", "figure_window", "crossover_from"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if not self.samples or min(self.samples) < 1:
            raise ConfigError(f"--samples: give sample sizes >= 1, got {list(self.samples)}")
        check_samplers(self.samplers)
        if not 0 <= self.figure_head < self.num_heads:
            raise ConfigError(f"--figure-head: must lie in [0, {self.num_heads}), got {self.figure_head}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")
        if not self.bound_c > 0:
            raise ConfigError(f"--bound-c: must be > 0, got {self.bound_c}")
        if self.crossover_s < 0:
            raise ConfigError(f"--crossover-s: must be >= 0 (0: no crossover search), got {self.crossover_s}")
        gib = exact_bytes(max(self.num_heads, len(MODEL_HEADS)), self.n) / 2 ** 30
        if gib > 0.5 * memory_gib():
            raise ConfigError(f"--n: exact ALiBi at n={self.n} materialises about {gib:.0f} GiB and this machine "
                              f"has {memory_gib():.0f} GiB; choose a smaller --n")
        check_out_dir("--out", self.out)
        why = real_qkv_missing() if self.qkv == "model" or (self.qkv == "auto" and is_reference(self.out)) else ""
        if why and self.qkv == "model":
            raise ConfigError(f"--qkv model: real Q/K/V unavailable: {why}")
        if why:     # the committed demo is on SmolLM2 Q/K/V: replacing it with random ones must be asked for
            raise ConfigError(f"--out {self.out}: the committed reference uses SmolLM2 Q/K/V, unavailable "
                              f"here ({why}); pass --qkv random to write random-Q/K/V results there on purpose")


PRESETS: Dict[str, DemoConfig] = {
    "default": DemoConfig(),
    "quick": DemoConfig(n=1024, samples=(1, 10, 100), out="outputs/demo/quick"),
}
PRESET_HELP = {"default": "n=4096, s in 1, 5, 10, 20, 100 (what `make demo` runs) -> outputs/demo",
               "quick": "n=1024, s in 1, 10, 100 -> outputs/demo/quick"}


def exact_bytes(heads: int, n: int) -> int:
    return 3 * heads * n * n * 4      # float32 bias + scores + probabilities


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return float("inf")


def real_qkv_missing() -> str:
    """Why SmolLM2 Q/K/V on real text cannot be had here ('' when they can): the
    demo takes whichever default corpus is installed."""
    from poslsh_paper.data.corpus import DEFAULT_CORPORA, available_corpora

    return "; ".join(missing_prerequisites(ModelInputs(corpora=tuple(available_corpora()) or DEFAULT_CORPORA)))


COMMANDS = [Command(name="demo", help="norms, bounds, output error and timing at n=4096; draws Figure 1",
                    config=DemoConfig, presets=PRESETS, default_preset="default",
                    main="poslsh_paper.experiments.demo:main", quick="quick", preset_help=PRESET_HELP)]
