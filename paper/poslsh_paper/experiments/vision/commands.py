"""``poslsh vision``: train every method x seed of a preset (resuming), write the table and the
2-D Figure-2 analog. Flags come from :class:`~.config.VisionCommand` (tyro), default preset ``smoke``."""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.lm.config import check_directory
from poslsh_paper.experiments.vision.config import PRESET_HELP, PRESETS, VisionCommand, check, experiment_config

__all__ = ["COMMANDS", "vision_main"]


def vision_main(cmd: VisionCommand) -> int:
    cfg = experiment_config(cmd)
    check(cfg)
    if cmd.jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {cmd.jobs}")
    check_directory("runs_dir", cfg.runs_dir)
    check_directory("out", cmd.out)
    say = print if cmd.progress else (lambda *_: None)
    t0 = time.perf_counter()
    import torch

    from poslsh_paper.data.images import ImagesNotFound
    from poslsh_paper.experiments.vision.table import run_all, write_table
    try:
        if not cmd.aggregate_only:
            run_all(cfg, jobs=cmd.jobs, progress=say)
        extra = {"jobs": cmd.jobs, "torch": torch.__version__}
        if not cmd.aggregate_only:
            extra["wall_s_this_call"] = round(time.perf_counter() - t0, 1)
        table = write_table(cfg, Path(cmd.out), "poslsh " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["vision"]
                            else f"poslsh vision --preset {cfg.preset}", extra)
        if not cmd.skip_figure:
            from poslsh_paper.experiments.vision.figure import write_figure
            try:
                say(f"figure: {write_figure(cfg, Path(cmd.out))}")
            except FileNotFoundError as e:
                print(f"figure skipped: {e}", file=sys.stderr)
    except ImagesNotFound as e:
        raise ConfigError(str(e)) from None
    print(table.read_text())
    say(f"wrote {table} ({time.perf_counter() - t0:.0f} s)")
    return 0


COMMANDS = [Command("vision", "a ViT on Fashion-MNIST patches, one positional method per run (learned, 1-D / 2-D "
                              "ALiBi, 2-D PosLSH, fixed boxes): accuracy at 1x and 2x resolution, the 2-D Figure 2",
                    VisionCommand, PRESETS, "smoke", vision_main, quick="smoke", preset_help=PRESET_HELP)]
