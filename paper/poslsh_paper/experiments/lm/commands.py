"""``poslsh train``, ``poslsh eval`` and ``poslsh table``: the language-model commands.

Flags come from :class:`TrainCommand`, :class:`EvalCommand` and :class:`TableCommand`
(built by :mod:`poslsh_paper.cli` with tyro, starting from ``--preset``, default ``smoke``).
The training, evaluation and table modules (torch, transformers) are imported when a command
runs, not for ``--help``.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from poslsh_paper.experiments.command import Command, ConfigError
from poslsh_paper.experiments.lm.config import (NOT_RESULTS, PRESET_HELP, PRESETS, EvalCommand, TableCommand,
                                                TrainCommand, TrainConfig, check, config_differences, describe_differences,
                                                experiment_config, parse_method, run_dir)
from poslsh_paper.experiments.paths import check_name

__all__ = ["COMMANDS", "train_main", "eval_main", "table_main", "resume_config"]


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _recorded(run: Path):
    """The run's recorded ``config.json`` as a dict (None when the run has none)."""
    path = run / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"--resume: {path} is not readable JSON ({e}); move the run away or pass --overwrite") \
            from None


def resume_config(cfg: TrainConfig, given=frozenset()) -> TrainConfig:
    """What ``--resume`` runs: the recorded configuration of ``cfg``'s run (its ``config.json``),
    with this invocation's scheduling fields (threads, device, checkpoint cadence); a flag in
    ``given`` that differs from the record is refused in one line. Says so when the preset's
    values differ from the record."""
    from poslsh_paper.experiments.serialize import config_from_dict

    run = run_dir(cfg)
    recorded = _recorded(run)
    if recorded is None:
        return cfg
    diff = config_differences(cfg, recorded)
    where = {k: v for k, v in diff.items() if k in ("preset", "method", "seed")}
    if where:       # the record names another run than the directory it lies in: nothing to continue
        raise ConfigError(f"--resume: {run / 'config.json'} records another run "
                          f"({describe_differences(where, 'recorded')}); move that file away or pass --overwrite")
    flags = {k: v for k, v in diff.items() if k in given}
    if flags:
        raise ConfigError(f"--resume continues the run {run} as recorded in its config.json; these flags differ "
                          f"from it: {describe_differences(flags, 'recorded')}; drop them to continue it, "
                          "or pass --overwrite to start it again with them")
    try:
        saved = config_from_dict(TrainConfig, recorded)
    except ConfigError as e:
        raise ConfigError(f"--resume: {run / 'config.json'}: {e}") from None
    keep = {f: getattr(cfg, f) for f in NOT_RESULTS if f not in ("methods", "seeds", "runs_dir")}
    out = replace(saved, runs_dir=cfg.runs_dir, **keep)
    if diff and _rank0():
        print(f"resuming {run} with its recorded configuration: "
              f"{describe_differences({k: (b, a) for k, (a, b) in diff.items()}, 'not')}", file=sys.stderr)
    return out


def train_main(cmd: TrainCommand, given=frozenset()) -> int:
    """Train (or resume) one method x seed, evaluate it, print the result."""
    from poslsh_paper.experiments.lm.evaluation import format_result
    from poslsh_paper.experiments.lm.loop import train

    if cmd.resume and cmd.overwrite:
        raise ConfigError("pass one of --resume (continue the run) and --overwrite (delete it and start again)")
    cfg = experiment_config(cmd)
    check(cfg)
    if cmd.resume:
        cfg = resume_config(cfg, given)
    try:
        result = train(cfg, resume=cmd.resume, overwrite=cmd.overwrite, progress=cmd.progress)
    except FileExistsError as e:
        raise ConfigError(str(e)) from e
    if _rank0():
        print(format_result(result))
        print(f"run directory: {run_dir(cfg)}")
    return 0


def _eval_path(cfg: TrainConfig, ckpt, initial: bool, streaming: bool, documents: bool = False) -> Path:
    """Where an evaluation is filed: in the run directory, or (another run's checkpoint) next to
    that checkpoint under a name that says what it was evaluated as."""
    check_name("eval_split", cfg.eval_split)
    own = initial or run_dir(cfg).resolve() in ckpt.resolve().parents
    if own:
        tag, where = "-init" if initial else "", run_dir(cfg)
    else:
        recorded = _recorded(ckpt.parent.parent) or {}
        preset = "" if recorded.get("preset", cfg.preset) == cfg.preset else f"{cfg.preset}."
        tag, where = f"-as-{preset}{cfg.method}", ckpt.parent.parent
    mode = "-streaming" if streaming else "-documents" if documents else ""
    return where / f"eval-{cfg.eval_split}{tag}{mode}.json"


def eval_main(cmd: EvalCommand) -> int:
    """Evaluate a checkpoint as ``cmd.method``; writes ``eval-<split>.json`` in the run directory
    (or, for another run's checkpoint, ``eval-<split>-as-<method>.json`` next to that run);
    ``--streaming`` writes ``eval-<split>[-as-<method>]-streaming.json``, ``--documents`` (each window's
    documents kept apart, as ``--pack`` trains) ``eval-<split>[-as-<method>]-documents.json``. ``--checkpoint init``
    evaluates the model as built, before any step (LoRA: the pretrained model with its positional
    scheme replaced; scratch: the initialisation), into ``eval-<split>-init[-streaming].json``.
    The checkpoint must fit the model exactly (every trainable tensor, by name and shape)."""
    cfg = experiment_config(cmd)
    check(cfg)
    if cmd.streaming and parse_method(cfg.method).scheme not in ("poslsh", "fixed_blocks", "alibi-window"):
        raise ConfigError(f"streaming: method {cfg.method} attends to every earlier key (no bounded cache); "
                          "--streaming evaluates poslsh-s<k>, fixed_blocks and the alibi-w<c> / alibi-wcost<s> windows")
    if cmd.streaming and cmd.documents:
        raise ConfigError("documents: --streaming reads the split as one document; pass one of --streaming and "
                          "--documents")
    from poslsh.threads import intra_op_threads

    from poslsh_paper.experiments.lm.checkpoint import load_strict, resolve_checkpoint
    from poslsh_paper.experiments.lm.model import Dist, build_model, load_data, trainable_parameters

    initial = cmd.checkpoint == "init"
    # A BLOOM run trains as original; its other methods are evaluations of that run's weights.
    trained = run_dir(replace(cfg, method="original")) if cfg.model.kind == "bloom" else run_dir(cfg)
    ckpt = None if initial else resolve_checkpoint(cmd.checkpoint, trained)
    out = _eval_path(cfg, ckpt, initial, cmd.streaming, cmd.documents)
    dist = Dist(cfg.device)
    if cmd.streaming and dist.world > 1:
        raise ConfigError("streaming: one sequential stream; run it in a single process, not under torchrun")
    with intra_op_threads(cfg.threads):
        data = load_data(cfg, dist)
        model = build_model(cfg, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
        if not initial:
            load_strict(ckpt, trainable_parameters(model), cfg)
        res = _evaluate(cmd, cfg, model, data, dist, ckpt)
    if dist.main:
        from poslsh_paper.io import atomic_write_text
        atomic_write_text(out, json.dumps(res, indent=1))
        _print_eval(res, cmd.streaming)
    return 0


def _evaluate(cmd: EvalCommand, cfg: TrainConfig, model, data, dist, ckpt) -> dict:
    from poslsh_paper.experiments.lm.evaluation import evaluate, evaluate_streaming

    res = {"method": cfg.method, "seed": cfg.seed, "pack": cfg.pack, "documents": cmd.documents,
           "checkpoint": "init" if ckpt is None else str(ckpt), "split": cfg.eval_split}
    tokens = data.splits[cfg.eval_split]
    if cmd.streaming:
        res["streaming"] = evaluate_streaming(model, tokens, cfg, dist, progress=cmd.progress)
    else:
        sep = data.tokenizer.separator_id if cmd.documents else None
        res["eval"] = evaluate(model, tokens, cfg, dist, progress=cmd.progress, separator_id=sep)
    return res


def _print_eval(res: dict, streaming: bool) -> None:
    if streaming:
        r = res["streaming"]
        print(f"streaming {r['tokens']} tokens ({r['chunk']} per step): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%  "
              f"{r['tokens_per_s']:.0f} tokens/s; cache at most {r['cache']['kept_max']} keys per layer "
              f"(bound {r['cache']['bound_max']})")
        for b in r["by_position"]:
            print(f"  positions [{b['from']}, {b['to']}): ppl {b['ppl']:.3f}  acc {b['acc']:.2f}%")
        return
    for k, r in res["eval"].items():
        print(f"{k} (context {r['context']}): " + (r["skipped"] if "skipped" in r else
                                                     f"ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%"))


def table_main(cmd: TableCommand) -> int:
    """Train every missing ``methods`` x ``seeds`` run (or time them: ``--dry-run``), write and print the table."""
    cfg = experiment_config(cmd)
    if cmd.jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {cmd.jobs}")
    if not cfg.methods or not cfg.seeds:
        raise ConfigError("methods and seeds must each name at least one (e.g. --methods alibi poslsh-s5 --seeds 0 1)")
    for m in cfg.methods:
        check(replace(cfg, method=m), data=not cmd.dry_run and not cmd.aggregate_only)
    from poslsh_paper.experiments.lm.table import dry_run, run_table, table_dir

    out = table_dir(Path(cmd.out), cfg)
    if cmd.dry_run:
        dry_run(cfg, cfg.methods, jobs=cmd.jobs)
        return 0
    command = "poslsh " + shlex.join(sys.argv[1:])
    if cfg.model.kind == "bloom":     # one trained model per seed, evaluated as every method
        from poslsh_paper.experiments.lm.bloom_table import run_bloom_table
        if cmd.jobs != 1:
            raise ConfigError("jobs: a BLOOM table trains one model per seed in this process; pass --jobs 1 (or "
                              "train the seeds in parallel with `poslsh train --method original --seed <k>` first)")
        if not run_bloom_table(cfg, cfg.methods, cfg.seeds, Path(cmd.out), progress=cmd.progress, command=command,
                               train_missing=not cmd.aggregate_only):
            raise ConfigError(f"table: no trained BLOOM under {cfg.runs_dir}: train the seeds first (without "
                              "--aggregate-only)")
        print((out / "table.md").read_text())
        return 0
    results = run_table(cfg, cfg.methods, cfg.seeds, Path(cmd.out), progress=cmd.progress, command=command,
                        train_missing=not cmd.aggregate_only, jobs=cmd.jobs,
                        include=Path(cmd.include_runs) if cmd.include_runs else None)
    if not results:     # an older table.md there is another table's: never print it as this one
        todo = "train them (without --aggregate-only)" if cmd.aggregate_only else \
            "retrain those listed above with `poslsh train ... --overwrite`, or point --runs-dir elsewhere"
        raise ConfigError(f"table: none of the {len(cfg.methods) * len(cfg.seeds)} runs of this table has a result "
                          f"of its config, so no table was written to {out}: {todo}")
    if _rank0() and (out / "table.md").is_file():
        print((out / "table.md").read_text())
    return 0


_TRAINING = ("batch_size", "micro_batch_size", "steps", "lr", "weight_decay", "warmup_ratio", "grad_clip",
             "ckpt_interval", "keep_checkpoints", "context_parallel", "resume", "overwrite")
_TABLE = ("methods", "seeds", "out", "results_dir", "dry_run", "aggregate_only", "include_runs", "jobs")
_EVAL = ("checkpoint", "streaming", "documents")

COMMANDS = [
    Command("train", "train (and evaluate) one language model: a method x seed of a preset",
            TrainCommand, PRESETS, "smoke", "poslsh_paper.experiments.lm.commands:train_main", quick="smoke",
            preset_help=PRESET_HELP, elsewhere={**{k: "table" for k in _TABLE}, **{k: "eval" for k in _EVAL}},
            takes_given=True),
    Command("eval", "evaluate a trained run (PPL / accuracy at 1x, 2x, 4x the training length)",
            EvalCommand, PRESETS, "smoke", "poslsh_paper.experiments.lm.commands:eval_main", quick="smoke",
            preset_help=PRESET_HELP, elsewhere={**{k: "train" for k in _TRAINING}, **{k: "table" for k in _TABLE}}),
    Command("table", "run every method x seed of a preset (resuming) and write the table",
            TableCommand, PRESETS, "smoke", "poslsh_paper.experiments.lm.commands:table_main", quick="smoke",
            preset_help=PRESET_HELP, elsewhere={"method": "train", "seed": "train", "resume": "train",
                                                "overwrite": "train", **{k: "eval" for k in _EVAL}}),
]
