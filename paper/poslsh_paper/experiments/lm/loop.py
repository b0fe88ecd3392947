"""Training one run: ``train(cfg)`` trains, checkpoints and evaluates one method x seed.

Everything random is a function of the step, so a resumed run repeats the
uninterrupted one bit for bit and DDP ranks split one global batch: the batch of
step ``t`` is :func:`poslsh_paper.data.tokens.batch_windows` of ``(seed, t)``, the
partitions come from ``(seed, t, layer)`` (the step is passed to the model as
``poslsh_step`` and reaches the attention functions), dropout from
``(seed, t, rank)``. Runs under ``torchrun`` use DDP; with ``context_parallel = P``
the ranks form a 2-D device mesh (data x context): the ``P`` ranks of a context
group share each of their sequences, one contiguous shard each
(:mod:`poslsh.distributed`, passed to the model as ``poslsh_context``), and DDP
all-reduces over all ranks. With ``pack`` the same windows are packed documents: the position
ids restart at every separator (:func:`poslsh_paper.data.tokens.document_positions`) and the model
attends within documents only.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from pathlib import Path

from poslsh_paper.data.tokens import batch_windows, document_positions
from poslsh.distributed import ContextShard, shard_range
from poslsh_paper.io import atomic_write_text
from poslsh.seeding import stable_seed
from poslsh.threads import intra_op_threads
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.experiments.checkpoints import (latest_checkpoint, load_checkpoint, recorded_config, run_lock,
                                                 save_checkpoint)
from poslsh_paper.experiments.lm.checkpoint import prepare_resume
from poslsh_paper.experiments.lm.config import (TrainConfig, check, config_differences, describe_differences,
                                                experiment_config, run_dir)
from poslsh_paper.experiments.paths import remove_run
from poslsh_paper.experiments.lm.evaluation import eval_forward_tokens, evaluate as evaluate_model
from poslsh_paper.experiments.lm.model import Dist, autocast_for, build_model, load_data, trainable_parameters

__all__ = ["train", "make_optimizer", "lr_scheduler", "warmup_steps", "train_step", "estimate_minutes",
           "code_version"]


# ------------------------------------------------------------------ optimizer
def make_optimizer(params, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW as in the paper (betas 0.9/0.999, eps 1e-8); no weight decay on norms and biases."""
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)


def warmup_steps(cfg: TrainConfig) -> int:
    return max(1, round(cfg.warmup_ratio * cfg.steps))


def lr_scheduler(optimizer, cfg: TrainConfig, start: int = 0):
    """Hugging Face's linear schedule: lr rises from 0 (at step 0) to ``cfg.lr`` over the
    warmup, then falls linearly to 0 at ``cfg.steps``. Built at ``start`` when resuming
    (the restored optimizer carries ``initial_lr``), so step ``t`` gets the same lr either way."""
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(optimizer, warmup_steps(cfg), cfg.steps, last_epoch=start - 1)


# ------------------------------------------------------------ resume or fresh
@dataclass
class RunState:
    """What a checkpoint carries besides tensors."""

    step: int = 0                                   # optimizer steps done
    history: List[list] = field(default_factory=list)   # [[step, train loss], ...]
    elapsed_s: float = 0.0                          # training wall time so far


def _has_run(out_dir) -> bool:
    """Whether ``out_dir`` holds a run's progress (a result, or checkpoints of any state)."""
    return (out_dir / "result.json").exists() or any((out_dir / "checkpoints").glob("step-*"))


def _check_recorded(cfg: TrainConfig, out_dir) -> None:
    """A resumed run continues its recorded configuration: refuse any other (one line)."""
    recorded = None
    if (out_dir / "config.json").is_file():
        try:
            recorded = json.loads((out_dir / "config.json").read_text())
        except ValueError:
            recorded = None
    if recorded is None:
        newest = latest_checkpoint(out_dir, report=False)
        recorded = recorded_config(newest) if newest is not None else None
    diff = config_differences(cfg, recorded) if recorded else {}
    if diff:
        raise ConfigError(f"{out_dir} was trained with another configuration: {describe_differences(diff, 'recorded')}"
                          f"; resume it as recorded (poslsh train --config-json {out_dir / 'config.json'} --resume) "
                          "or pass --overwrite to start it again")


def start_run(cfg: TrainConfig, params, optimizer, dist: Dist, resume: bool, overwrite: bool) -> RunState:
    """Restore the latest checkpoint (``resume``: of this very configuration; older-layout
    checkpoints adopted, damaged ones moved aside), or start fresh: refuse to touch an existing
    run unless ``overwrite``. Writes the run's ``config.json`` when the run starts."""
    out_dir = run_dir(cfg)
    if resume and overwrite:
        raise ConfigError("pass one of resume (continue the run) and overwrite (delete it and start again)")
    state = RunState()
    exists = _has_run(out_dir)
    if resume:
        _check_recorded(cfg, out_dir)         # read-only: every rank refuses alike, none waits on a barrier
        if dist.main:
            for line in prepare_resume(out_dir, cfg):
                print(line, file=sys.stderr)
        dist.barrier()
        ckpt = latest_checkpoint(out_dir)
        if ckpt is not None:
            saved = load_checkpoint(ckpt, params, optimizer, dist.device)
            state = RunState(saved["step"], saved.get("history", []), saved.get("elapsed_s", 0.0))
            if dist.main:
                print(f"resuming {out_dir} from step {state.step} ({ckpt})", file=sys.stderr)
        elif dist.main and exists:
            print(f"no checkpoint to resume in {out_dir / 'checkpoints'} (see above): starting {out_dir} from the "
                  "first step", file=sys.stderr)
    elif exists and not overwrite:
        raise FileExistsError(f"{out_dir} already has a run: pass --resume to continue it or --overwrite")
    elif overwrite and dist.main and out_dir.exists() and any(out_dir.iterdir()):
        remove_run(out_dir, cfg.runs_dir)
    dist.barrier()
    if dist.main and not (resume and (out_dir / "config.json").is_file()):
        atomic_write_text(out_dir / "config.json", json.dumps(config_to_dict(cfg), indent=1))
    return state


# -------------------------------------------------------------- data x context
class Mesh(NamedTuple):
    """This rank's place: data-parallel ``rank`` of ``world`` replicas, and (context
    parallelism) its shard ``tokens`` of every sequence with the model's ``context``."""

    rank: int
    world: int
    tokens: slice
    context: Optional[ContextShard] = None


def parallel_mesh(cfg: TrainConfig, dist: Dist) -> Mesh:
    """The world as a ``(world / P) x P`` device mesh ("data", "context"), ``P = cfg.context_parallel``;
    a context group's ranks are adjacent (one node's fast links carry the halos)."""
    P = cfg.context_parallel
    if P == 1:
        return Mesh(dist.rank, dist.world, slice(0, cfg.seq_len))
    if dist.world % P:
        raise ConfigError(f"context_parallel {P} must divide the world size {dist.world}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(dist.device.type, (dist.world // P, P), mesh_dim_names=("data", "context"))
    start, end = shard_range(cfg.seq_len, mesh.get_local_rank("context"), P)
    return Mesh(mesh.get_local_rank("data"), dist.world // P, slice(start, end),
                ContextShard(mesh.get_group("context"), start, cfg.seq_len))


# ------------------------------------------------------------------- one step
def train_step(model, optimizer, scheduler, params, batch: torch.Tensor, step: int, cfg: TrainConfig,
               dist: Dist, micro: int, mesh: Optional[Mesh] = None, positions: Optional[torch.Tensor] = None) -> float:
    """One optimizer step on this rank's rows ``batch`` (``[rows, seq_len + 1]`` token ids),
    ``micro`` rows per forward pass; with context parallelism (``mesh``) on this rank's shard
    of them, whose targets run one token past it; ``positions`` (``[rows, seq_len]``, packed
    documents) are the inputs' position ids. Returns the mean train loss per token over all ranks."""
    torch.manual_seed(stable_seed("dropout", cfg.seed, step, dist.rank))   # LoRA dropout
    mesh = mesh or Mesh(dist.rank, dist.world, slice(0, cfg.seq_len))
    extra = {} if mesh.context is None else {"poslsh_context": mesh.context}
    # DDP averages over all ranks, data x context: scaled so the sum is the global mean.
    n_tok = batch.shape[0] * cfg.seq_len / cfg.context_parallel
    loss_total = 0.0
    for lo in range(0, batch.shape[0], micro):
        last = lo + micro >= batch.shape[0]
        # DDP all-reduces gradients on the last micro-batch only.
        with nullcontext() if (last or dist.world == 1) else model.no_sync():
            x, y = batch[lo: lo + micro, :-1][:, mesh.tokens], batch[lo: lo + micro, 1:][:, mesh.tokens]
            if positions is not None:
                extra["position_ids"] = positions[lo: lo + micro][:, mesh.tokens]
            with autocast_for(cfg, dist.device):
                logits = model(input_ids=x, use_cache=False, poslsh_step=step, **extra).logits
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            (loss_sum / n_tok).backward()
        loss_total += float(loss_sum.detach())
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return dist.sum([loss_total])[0] / (cfg.batch_size * cfg.seq_len)


# ---------------------------------------------------------------- logging, ETA
def estimate_minutes(cfg: TrainConfig, train_tok_s: float, step: int = 0) -> float:
    """Rough wall time left: remaining steps at ``train_tok_s``, plus evaluation (forward
    only, about 3x faster per token; cost grows with the context multiplier)."""
    train_s = (cfg.steps - step) * cfg.batch_size * cfg.seq_len / train_tok_s
    eval_s = eval_forward_tokens(cfg) / (3.0 * train_tok_s)
    return (train_s + eval_s) / 60.0


class Meter:
    """A progress bar (or, without one, a log line every 5% of the run) on rank 0, and an
    estimate of the time left once three steps after the first have been timed."""

    def __init__(self, cfg: TrainConfig, start: int, dist: Dist, progress: bool):
        self.cfg, self.start, self.main = cfg, start, dist.main
        self.bar = None
        if progress and dist.main:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.preset} {cfg.method} seed{cfg.seed}",
                            mininterval=1.0, dynamic_ncols=True)
        self.t_run, self.tokens, self.t_first = time.perf_counter(), 0, 0.0

    def update(self, step: int, loss: float, lr: float) -> None:
        cfg = self.cfg
        step_tokens = cfg.batch_size * cfg.seq_len
        self.tokens += step_tokens
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t_run)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}", refresh=False)
            self.bar.update(1)
        elif self.main and (step + 1) % max(1, cfg.steps // 20) == 0:
            print(f"step {step + 1}/{cfg.steps} loss {loss:.4f} lr {lr:.2e} {rate:.0f} tokens/s",
                  file=sys.stderr, flush=True)
        if step == self.start:
            self.t_first = time.perf_counter()   # the first step includes warm-up: time the next ones
        elif step == self.start + 3 and self.main:
            rate = 3 * step_tokens / max(1e-9, time.perf_counter() - self.t_first)
            print(f"\n[estimate] {rate:.0f} tokens/s: about {estimate_minutes(cfg, rate, step + 1):.1f} min "
                  f"left for this run (training + evaluation)", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------- train
def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
          evaluate: bool = True) -> dict:
    """Train ``cfg`` (resuming from the latest checkpoint when ``resume``), then evaluate it.
    Returns the result dict, also written to ``<run dir>/result.json``."""
    cfg = experiment_config(cfg)   # a command config's run options are not part of the run
    check(cfg)
    # Rank 0 holds the run directory's lock: two jobs never write one run.
    lock = run_lock(run_dir(cfg)) if int(os.environ.get("RANK", "0")) == 0 else nullcontext()
    with lock, intra_op_threads(cfg.threads):
        return _train(cfg, resume, overwrite, progress, evaluate)


def _train(cfg: TrainConfig, resume: bool, overwrite: bool, progress: bool, evaluate: bool) -> dict:
    dist = Dist(cfg.device)
    mesh = parallel_mesh(cfg, dist)
    if cfg.batch_size % mesh.world:
        raise ConfigError(f"batch_size {cfg.batch_size} must be divisible by the data-parallel size {mesh.world}")
    per_rank = cfg.batch_size // mesh.world
    micro = min(cfg.micro_batch_size, per_rank)
    if per_rank % micro:
        raise ConfigError(f"micro_batch_size {micro} must divide the per-rank batch {per_rank}")
    out_dir = run_dir(cfg)
    code = code_version()      # the code this process loaded (not what the checkout holds when it ends)
    data = load_data(cfg, dist)
    model = build_model(cfg, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
    params = trainable_parameters(model)
    optimizer = make_optimizer(params, cfg)
    state = start_run(cfg, params, optimizer, dist, resume, overwrite)
    scheduler = lr_scheduler(optimizer, cfg, state.step)
    ddp_model = model
    if dist.world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    rows = slice(mesh.rank * per_rank, (mesh.rank + 1) * per_rank)   # this replica's share of the global batch
    kill_after = int(os.environ.get("POSLSH_KILL_AFTER_STEP", "-1"))   # test hook: simulate a crash

    def checkpoint(step: int) -> None:
        info = {"history": state.history, "elapsed_s": state.elapsed_s, "config": config_to_dict(cfg)}
        save_checkpoint(out_dir, step, params, optimizer, info, cfg.keep_checkpoints)

    start = state.step
    meter = Meter(cfg, start, dist, progress)
    model.train()
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            windows = batch_windows(data.splits["train"], cfg.seq_len, step, cfg.batch_size, cfg.seed, rows)
            positions = (torch.from_numpy(document_positions(windows[:, :-1], data.tokenizer.separator_id))
                         .to(dist.device) if cfg.pack else None)
            batch = torch.from_numpy(windows).to(dist.device)
            loss = train_step(ddp_model, optimizer, scheduler, params, batch, step, cfg, dist, micro, mesh, positions)
            state.elapsed_s += time.perf_counter() - t0
            state.history.append([step + 1, round(loss, 5)])
            meter.update(step, loss, lr)
            done = step + 1
            if done % cfg.ckpt_interval == 0 or done == cfg.steps:
                if dist.main:
                    checkpoint(done)
                dist.barrier()
            if done == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    except KeyboardInterrupt:
        if dist.world == 1 and state.history and state.history[-1][0] > start:
            last = state.history[-1][0]
            if latest_checkpoint(out_dir, report=False) != out_dir / "checkpoints" / f"step-{last:08d}":
                checkpoint(last)          # not when the step's own checkpoint is already there
            print(f"\ninterrupted: checkpoint at step {last} saved; rerun with --resume", file=sys.stderr)
        raise
    finally:
        meter.close()
    tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    result = {"preset": cfg.preset, "method": cfg.method, "seed": cfg.seed, "steps": cfg.steps, "pack": cfg.pack,
              "final_train_loss": state.history[-1][1] if state.history else None,
              "train_time_s": round(state.elapsed_s, 1), "train_tokens": tokens,
              "train_tokens_per_s": round(tokens / max(state.elapsed_s, 1e-9), 1),
              "world_size": dist.world, "data": data.meta.get("splits"), "code": code,
              "config": config_to_dict(cfg)}
    if evaluate:
        t0 = time.perf_counter()
        result["eval"] = evaluate_model(model, data.splits[cfg.eval_split], cfg, dist, progress=progress)
        result["eval_time_s"] = round(time.perf_counter() - t0, 1)
        result["eval_split"] = cfg.eval_split
    if dist.main:
        atomic_write_text(out_dir / "result.json", json.dumps(result, indent=1))
    dist.barrier()
    return result


def code_version() -> Optional[dict]:
    """``{"commit": <git HEAD>, "modified": <tracked files changed>}`` of the checkout this code runs
    from (which code trained a run: tables may mix runs of several versions), or None outside git."""
    repo = Path(__file__).resolve().parents[4]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
        changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode or changed.returncode:
        return None
    return {"commit": head.stdout.strip(), "modified": bool(changed.stdout.strip())}
