"""What a vision run is: the ViT and training config, the positional methods, named presets.

A :class:`VisionConfig` fixes an experiment (every run's ``config.json``); :class:`VisionCommand`
adds the options of one invocation. Every field's trailing comment is its ``--help``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, NamedTuple, Tuple

import tyro

from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.paths import check_name, inside
from poslsh_paper.experiments.serialize import config_fingerprint

__all__ = ["METHODS", "ViTConfig", "VisionConfig", "VisionCommand", "PRESETS", "Method", "parse_method",
           "method_label", "check", "experiment_config", "run_dir", "head_sigmas"]

METHODS = ("learned", "alibi-1d", "alibi-2d", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "fixed-boxes")


@dataclass
class ViTConfig:
    patch_size: int = 4               # pixels per patch side (28 x 28 images -> 7 x 7 = 49 patch tokens)
    dim: int = 64                     # token width
    depth: int = 4                    # transformer blocks (pre-norm)
    heads: int = 4                    # attention heads (head dim = dim / heads)
    mlp_ratio: int = 2                # MLP width = mlp_ratio * dim
    sigma_scale: float = 0.25         # head h's 2-D ALiBi sigma = alibi_sigmas(heads)[h] * sigma_scale (4 heads: 1, 4, 16, 64 patches)
    fixed_box: int = 4                # side, in patches, of the fixed 2-D boxes baseline


@dataclass
class VisionConfig:
    preset: str = "custom"            # name of the preset this config came from (part of the run directory)
    dataset: str = "fashion-mnist"    # fashion-mnist (Debian package dataset-fashion-mnist) or synthetic (tests)
    train_images: int = 20000         # training images: a fixed seeded subset of the 60,000 (0 = all)
    test_images: int = 5000           # test images evaluated: a fixed seeded subset of the 10,000 (0 = all)
    model: ViTConfig = field(default_factory=ViTConfig)  # the ViT
    epochs: int = 3                   # passes over the training subset
    batch_size: int = 128             # images per optimizer step
    lr: float = 2e-3                  # peak learning rate (AdamW, linear warmup then cosine decay to 0)
    weight_decay: float = 0.05        # AdamW weight decay (matrices only)
    warmup_ratio: float = 0.1         # fraction of the steps spent warming up
    eval_scales: Tuple[int, ...] = (1, 2)  # test resolutions as multiples of 28 px (bilinear upsampling; 2 = 4x the patches)
    eval_scaled_sigma: bool = True    # also evaluate bias/box methods at k x resolution with sigma and box sides times k
    eval_batch_size: int = 250        # images per evaluation forward pass
    eval_seed: int = 12345            # seeds the fixed evaluation partitions of PosLSH models
    backend: str = "torch"            # PosLSH / fixed-box attention: torch (near-linear op) or reference (dense)
    methods: Tuple[str, ...] = METHODS  # positional methods of the table
    seeds: Tuple[int, ...] = (0, 1, 2)  # seeds of the table (init, data order, partitions)
    # optimizer steps between checkpoints (and one at the end)
    ckpt_interval: Annotated[int, tyro.conf.arg(aliases=("--ckpt-every",))] = 100
    keep_checkpoints: int = 2         # checkpoints kept per run
    threads: int = 0                  # torch intra-op threads per run (0 = torch's default; jobs > 1: cores / jobs)
    runs_dir: str = "outputs/vision/runs"  # runs live in <runs_dir>/<preset>-<config hash>/<method>/seed<k>/
    figure_method: str = "alibi-2d"   # trained model (seed 0) whose patch Q/K/V feed the convergence figure
    figure_layer: int = 1             # its attention layer used for the figure
    figure_images: int = 8            # test images (inputs) of the figure: mean +- std over them
    figure_scale: int = 2             # resolution of the figure's images (x 28 px; 2: 14 x 14 = 196 tokens)
    figure_samples: Tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)  # sample sizes s of the figure
    delta: float = 1e-3               # confidence 1 - delta of the eq. (3) bound drawn in the figure


@dataclass
class VisionCommand(VisionConfig):
    preset: tyro.conf.Suppress[str] = "custom"   # set by --preset / --quick / --config-json only
    out: str = "outputs/vision"       # table + figures go here (pass --out results/vision for the committed copy)
    jobs: int = 1                     # runs trained in parallel (processes; each gets cores / jobs threads)
    aggregate_only: bool = False      # only tabulate finished runs, train nothing
    skip_figure: bool = False         # do not compute the convergence figure
    progress: bool = True             # print progress lines


class Method(NamedTuple):
    """A positional method: ``kind`` in learned, alibi-1d, alibi-2d, poslsh, fixed-boxes; ``s`` samples."""

    kind: str
    num_samples: int = 1


def parse_method(method: str) -> Method:
    """``"poslsh-s10"`` -> ``Method("poslsh", 10)``."""
    if method in ("learned", "alibi-1d", "alibi-2d", "fixed-boxes"):
        return Method(method)
    if method.startswith("poslsh-s") and method[8:].isdigit() and int(method[8:]) >= 1:
        return Method("poslsh", int(method[8:]))
    raise ConfigError(f"methods: unknown method {method!r}; use learned, alibi-1d, alibi-2d, fixed-boxes or "
                      "poslsh-s<k> (e.g. poslsh-s10)")


LABELS = {"learned": "Learned absolute positions", "alibi-1d": "1-D ALiBi (raster order)",
          "alibi-2d": "2-D ALiBi (exact)", "fixed-boxes": "Fixed 2-D boxes"}


def method_label(method: str) -> str:
    if method.startswith("poslsh-s"):
        return f"2-D PosLSH, s={method[8:]}"
    return LABELS.get(method, method)


def head_sigmas(cfg: ViTConfig):
    """Per-head bandwidths in patches (float64 ``[heads]``): ALiBi's geometric series times ``sigma_scale``."""
    from poslsh.alibi import alibi_sigmas
    return alibi_sigmas(cfg.heads) * cfg.sigma_scale


def check(cfg: VisionConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the field) for a config no run can use."""
    check_name("preset", cfg.preset)
    for m in cfg.methods:
        parse_method(m)
    parse_method(cfg.figure_method)
    if not cfg.methods or not cfg.seeds:
        raise ConfigError("methods and seeds must each name at least one (e.g. --methods alibi-2d --seeds 0)")
    if cfg.dataset not in ("fashion-mnist", "synthetic"):
        raise ConfigError(f"dataset must be fashion-mnist or synthetic, got {cfg.dataset!r}")
    if cfg.backend not in ("torch", "reference"):
        raise ConfigError(f"backend must be torch or reference, got {cfg.backend!r}")
    for name in ("epochs", "batch_size", "eval_batch_size", "ckpt_interval", "keep_checkpoints", "figure_images",
                 "figure_scale"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("train_images", "test_images", "threads"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if not cfg.eval_scales or min(cfg.eval_scales) < 1:
        raise ConfigError(f"eval_scales must be positive integers, got {cfg.eval_scales}")
    if not cfg.figure_samples or min(cfg.figure_samples) < 1:
        raise ConfigError(f"figure_samples must be positive integers, got {cfg.figure_samples}")
    if not cfg.lr > 0 or not 0 <= cfg.warmup_ratio < 1:
        raise ConfigError(f"lr must be > 0 and warmup_ratio in [0, 1), got {cfg.lr} and {cfg.warmup_ratio}")
    if not 0 < cfg.delta < 1:
        raise ConfigError(f"delta must lie in (0, 1), got {cfg.delta}")
    m = cfg.model
    if min(m.patch_size, m.dim, m.depth, m.heads, m.mlp_ratio, m.fixed_box) < 1 or m.dim % m.heads:
        raise ConfigError(f"model: sizes must be >= 1 and dim ({m.dim}) a multiple of heads ({m.heads})")
    if 28 % m.patch_size:
        raise ConfigError(f"model.patch_size must divide the 28-pixel images, got {m.patch_size}")
    if not m.sigma_scale > 0:
        raise ConfigError(f"model.sigma_scale must be > 0, got {m.sigma_scale}")
    if not 0 <= cfg.figure_layer < m.depth:
        raise ConfigError(f"figure_layer must lie in [0, {m.depth}), got {cfg.figure_layer}")


# Fields that do not change what a run computes: excluded from the run directory's hash.
_NOT_IN_RUN = ("methods", "seeds", "threads", "runs_dir", "figure_method", "figure_layer", "figure_images",
               "figure_scale", "figure_samples", "delta", "ckpt_interval", "keep_checkpoints", "eval_batch_size")


def experiment_config(cmd: VisionConfig) -> VisionConfig:
    """The :class:`VisionConfig` part of a command config."""
    return VisionConfig(**{f.name: getattr(cmd, f.name) for f in fields(VisionConfig)})


def run_dir(cfg: VisionConfig, method: str, seed: int) -> Path:
    """``<runs_dir>/<preset>-<hash of what runs compute>/<method>/seed<k>``: a changed config is a new run."""
    tag = config_fingerprint(experiment_config(cfg), exclude=_NOT_IN_RUN)[:10]
    parse_method(method)
    path = Path(cfg.runs_dir) / f"{check_name('preset', cfg.preset)}-{tag}" / method / f"seed{int(seed)}"
    return inside(cfg.runs_dir, path, "runs_dir")


PRESET_HELP = {"smoke": "synthetic stripes, a 2-block ViT, two methods, one seed (for tests)",
               "cpu": "Fashion-MNIST, 8 methods x 3 seeds, 4 epochs of 20,000 images (the table)"}

PRESETS = {
    # Tests: seconds. Synthetic stripes, a 2-block ViT, two methods, one seed.
    "smoke": VisionConfig(
        preset="smoke", dataset="synthetic", train_images=256, test_images=128,
        model=ViTConfig(dim=32, depth=2, heads=4, mlp_ratio=2, fixed_box=4), epochs=1, batch_size=64,
        eval_batch_size=128, methods=("learned", "poslsh-s2"), seeds=(0,), ckpt_interval=2, threads=1, figure_method="poslsh-s2",
        figure_layer=0, figure_images=2, figure_samples=(1, 4, 16)),
    # The table on 2 CPU cores: 8 methods x 3 seeds, run with --jobs 2 (two 1-thread runs at a time).
    # Each run: 20,000 training images x 4 epochs = 624 steps of 128 (100-150 CPU-seconds), then
    # 5,000 test images at 28 px, 56 px and 56 px with sigma x 2 (15-70 CPU-seconds). Measured: 4,054
    # CPU-seconds for all 24 runs, i.e. 34 min on 2 quiet cores (README, "Vision").
    "cpu": VisionConfig(preset="cpu", train_images=20000, test_images=5000, epochs=4),
}
