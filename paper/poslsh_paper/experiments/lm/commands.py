"""``poslsh train``, ``poslsh eval`` and ``poslsh table``: the language-model commands.

Flags come from :class:`TrainCommand`, :class:`EvalCommand` and :class:`TableCommand`
(built by :mod:`poslsh_paper.cli` with tyro, starting from ``--preset``, default ``smoke``).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from poslsh_paper.io import atomic_write_text
from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.lm.checkpoint import load_checkpoint_params, resolve_checkpoint
from poslsh_paper.experiments.lm.config import (PRESETS, EvalCommand, TableCommand, TrainCommand, check, experiment_config, parse_method,
                     run_dir)
from poslsh_paper.experiments.lm.evaluation import evaluate, evaluate_streaming, format_result
from poslsh_paper.experiments.lm.loop import train
from poslsh_paper.experiments.lm.model import Dist, build_model, load_data
from poslsh_paper.experiments.lm.table import dry_run, run_table

__all__ = ["COMMANDS", "train_main", "eval_main", "table_main"]


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def train_main(cmd: TrainCommand) -> int:
    """Train (or resume) one method x seed, evaluate it, print the result."""
    cfg = experiment_config(cmd)
    try:
        result = train(cfg, resume=cmd.resume, overwrite=cmd.overwrite, progress=cmd.progress)
    except FileExistsError as e:
        raise ConfigError(str(e)) from e
    if _rank0():
        print(format_result(result))
        print(f"run directory: {run_dir(cfg)}")
    return 0


def eval_main(cmd: EvalCommand) -> int:
    """Evaluate a checkpoint as ``cmd.method``; writes ``eval-<split>.json`` in the run directory
    (or, for another run's checkpoint, ``eval-<split>-as-<method>.json`` next to that run);
    ``--streaming`` writes ``eval-<split>[-as-<method>]-streaming.json``. ``--checkpoint init``
    evaluates the model as built, before any step (LoRA: the pretrained model with its positional
    scheme replaced; scratch: the initialisation), into ``eval-<split>-init[-streaming].json``."""
    cfg = experiment_config(cmd)
    check(cfg)
    if cmd.streaming and parse_method(cfg.method).scheme not in ("poslsh", "fixed_blocks"):
        raise ConfigError(f"streaming: method {cfg.method} attends to every earlier key (no bounded cache); "
                          "--streaming evaluates poslsh-s<k> and fixed_blocks")
    initial = cmd.checkpoint == "init"
    ckpt = None if initial else resolve_checkpoint(cmd.checkpoint, run_dir(cfg))
    dist = Dist(cfg.device)
    if cmd.streaming and dist.world > 1:
        raise ConfigError("streaming: one sequential stream; run it in a single process, not under torchrun")
    data = load_data(cfg, dist)
    model = build_model(cfg, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
    params = {} if initial else load_checkpoint_params(ckpt)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in params:
                p.copy_(params[n])
    res = {"method": cfg.method, "seed": cfg.seed, "checkpoint": "init" if initial else str(ckpt),
           "split": cfg.eval_split}
    if cmd.streaming:
        res["streaming"] = evaluate_streaming(model, data.splits[cfg.eval_split], cfg, dist, progress=cmd.progress)
    else:
        res["eval"] = evaluate(model, data.splits[cfg.eval_split], cfg, dist, progress=cmd.progress)
    if dist.main:
        # Another run's checkpoint evaluated as this method is filed with the checkpoint, under
        # a name that says so, never over this run's own evaluation.
        own = initial or run_dir(cfg).resolve() in ckpt.resolve().parents
        tag = "-init" if initial else ("" if own else f"-as-{cfg.method}")
        name = f"eval-{cfg.eval_split}{tag}" + ("-streaming" if cmd.streaming else "")
        out = (run_dir(cfg) if own else ckpt.parent.parent) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(res, indent=1))
        if cmd.streaming:
            r = res["streaming"]
            print(f"streaming {r['tokens']} tokens ({r['chunk']} per step): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%  "
                  f"{r['tokens_per_s']:.0f} tokens/s; cache at most {r['cache']['kept_max']} keys per layer "
                  f"(bound {r['cache']['bound_max']})")
            for b in r["by_position"]:
                print(f"  positions [{b['from']}, {b['to']}): ppl {b['ppl']:.3f}  acc {b['acc']:.2f}%")
            return 0
        for k, r in res["eval"].items():
            print(f"{k} (context {r['context']}): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%")
    return 0


def table_main(cmd: TableCommand) -> int:
    """Train every missing ``methods`` x ``seeds`` run (or time them: ``--dry-run``), write and print the table."""
    cfg = experiment_config(cmd)
    if cmd.jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {cmd.jobs}")
    if not cfg.methods or not cfg.seeds:
        raise ConfigError("methods and seeds must each name at least one (e.g. --methods alibi poslsh-s5 --seeds 0 1)")
    for m in cfg.methods:
        check(replace(cfg, method=m))
    if cmd.dry_run:
        dry_run(cfg, cfg.methods, jobs=cmd.jobs)
        return 0
    command = "poslsh " + shlex.join(sys.argv[1:])
    run_table(cfg, cfg.methods, cfg.seeds, Path(cmd.results_dir), progress=cmd.progress, command=command,
              train_missing=not cmd.aggregate_only, jobs=cmd.jobs, include=Path(cmd.include_runs) if cmd.include_runs else None)
    if _rank0():
        print((Path(cmd.results_dir) / cfg.preset / "table.md").read_text())
    return 0


COMMANDS = [
    Command("train", "train (and evaluate) one language model: a method x seed of a preset",
            TrainCommand, PRESETS, "smoke", train_main),
    Command("eval", "evaluate a trained run (PPL / accuracy at 1x, 2x, 4x the training length)",
            EvalCommand, PRESETS, "smoke", eval_main),
    Command("table", "run every method x seed of a preset (resuming) and write the table",
            TableCommand, PRESETS, "smoke", table_main),
]
