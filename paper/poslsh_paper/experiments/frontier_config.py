"""The ``poslsh frontier`` job's configuration and presets (no heavy imports: ``--help`` reads this).
The job itself is :mod:`poslsh_paper.experiments.frontier`."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Dict, Literal, Optional, Tuple

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.model_inputs import ModelInputs, check_out_dir, check_samplers
from poslsh_paper.experiments.serialize import config_to_dict

__all__ = ["FrontierConfig", "PRESETS", "PRESET_HELP", "VERSION", "COMMANDS"]

VERSION = 1     # bump when a unit's computation changes (invalidates checkpoints)


@dataclass
class FrontierConfig(ModelInputs):
    heads: Optional[Tuple[int, ...]] = None             # query heads (None: all of the model's)
    lengths: Tuple[int, ...] = (1024, 4096, 16384)      # sequence lengths n
    real_inputs: Tuple[int, ...] = (4, 2, 1)            # text segments per length (0: none), each x --layers
    # SmolLM2 or the corpus not installed: stop, naming what to install (stop), or measure without the
    # real-text inputs and say so in one line (random: the quick preset, so that it runs on any machine)
    if_missing: Literal["stop", "random"] = "stop"
    random_logit_std: Tuple[float, ...] = (1.0, 2.0)    # Gaussian Q/K/V with these logit stds (empty: none)
    random_inputs: Tuple[int, ...] = (2, 1, 1)          # random inputs per length and std
    random_geometry: Tuple[int, int, int] = (9, 3, 64)  # (Hq, Hkv, d) of random inputs without a model
    draws: Tuple[int, ...] = (6, 3, 2)                  # partition / hybrid draws per length
    samples: Tuple[int, ...] = (1, 2, 5, 10, 20, 40, 80)  # positional LSH sample sizes s
    samplers: Tuple[str, ...] = ("iid", "grouped")      # positional LSH samplers
    window_c: Tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)  # windows w_h = round(c sigma_h)
    hybrid_shares: Tuple[float, ...] = (0.25, 0.5)      # hybrid: share of the keys in the sampled tail
    causal: bool = True                                 # causal attention (keys j <= i)
    chunk: int = 256                                    # query rows per chunk of the float64 oracle
    timing: bool = True                                 # time every method on the torch backend
    timing_rounds: int = 3                              # interleaved timing rounds (best kept)
    only_timing: bool = False                           # re-time OUT/frontier.json's methods, keep its errors
    only_write: bool = False                            # rewrite the tables and figure of OUT/frontier.json
    out: str = "outputs/frontier"                       # output directory (results/frontier: the reference)
    checkpoints: Optional[str] = None                   # per-input checkpoints (None: OUT/checkpoints)
    resume: bool = True                                 # reuse matching checkpoints
    plot: bool = True                                   # draw frontier.png

    def per_length(self, values: Tuple, i: int):
        return values[i] if i < len(values) else values[-1]

    def unit_fingerprint(self, n: int, draws: int) -> str:
        """What the rows of one input of length ``n`` depend on (not the other lengths, the number of
        inputs, where they are written or the timing): a checkpoint is reused only when it matches."""
        keys = ("samples", "samplers", "window_c", "hybrid_shares", "causal", "seed", "heads", "model", "rope",
                "corpora", "layers", "inputs_from", "random_geometry")
        d = {k: v for k, v in config_to_dict(self).items() if k in keys}
        return hashlib.sha256(json.dumps(dict(d, n=n, draws=draws, version=VERSION), sort_keys=True).encode()
                              ).hexdigest()[:16]

    def check(self) -> None:
        self.check_inputs()
        if not self.lengths or min(self.lengths) < 2:
            raise ConfigError(f"--lengths: give sequence lengths >= 2, got {list(self.lengths)}")
        for flag, vals in (("--real-inputs", self.real_inputs), ("--random-inputs", self.random_inputs),
                           ("--draws", self.draws)):
            if not vals or min(vals) < (1 if flag == "--draws" else 0):
                raise ConfigError(f"{flag}: one count per length (the last repeats), got {list(vals)}")
        if not self.samples or min(self.samples) < 1:
            raise ConfigError(f"--samples: give sample sizes >= 1, got {list(self.samples)}")
        check_samplers(self.samplers)
        if any(c <= 0 for c in self.window_c) or any(not 0 < x < 1 for x in self.hybrid_shares):
            raise ConfigError(f"--window-c must be > 0 and --hybrid-shares in (0, 1), got {list(self.window_c)}, "
                              f"{list(self.hybrid_shares)}")
        if any(x <= 0 for x in self.random_logit_std) or min(self.random_geometry) < 1 or \
                self.random_geometry[0] % self.random_geometry[1]:
            raise ConfigError("--random-logit-std must be > 0 and --random-geometry (Hq, Hkv, d) with Hkv | Hq")
        if self.chunk < 1 or self.timing_rounds < 1:
            raise ConfigError(f"--chunk and --timing-rounds must be >= 1, got {self.chunk}, {self.timing_rounds}")
        check_out_dir("--out", self.out)


PRESETS: Dict[str, FrontierConfig] = {
    "default": FrontierConfig(),
    "quick": FrontierConfig(lengths=(256,), real_inputs=(1,), random_logit_std=(2.0,), random_inputs=(1,), draws=(2,),
                            samples=(1, 5, 20), window_c=(1.0, 4.0), hybrid_shares=(0.5,), timing_rounds=1,
                            if_missing="random", out="outputs/frontier/quick"),
}

PRESET_HELP = {"default": "SmolLM2 Q/K/V of real text and random Q/K/V, n = 1k/4k/16k -> outputs/frontier",
               "quick": "one short input per source, n = 256 (seconds; random Q/K/V only where SmolLM2 or the corpus "
                        "is not installed) -> outputs/frontier/quick"}

COMMANDS = [Command(name="frontier", help="positional LSH vs exact ALiBi cut at a per-head window at equal cost and time",
                    config=FrontierConfig, presets=PRESETS, default_preset="default",
                    main="poslsh_paper.experiments.frontier:main", quick="quick", preset_help=PRESET_HELP)]
