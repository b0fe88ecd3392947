"""Train language models with positional LSH (the paper's section 6.2, scaled down).

``poslsh train --preset cpu --method poslsh-s10 --seed 0`` trains one model and
evaluates it (:mod:`poslsh.experiments.lm_eval`); ``poslsh table --preset cpu``
runs every method x seed of a preset and writes ``results/<preset>/table.*``.

* Configs are dataclasses; :data:`PRESETS` holds named ones (``smoke``, ``cpu``,
  ``gpu`` pretrain a small Qwen3-style model from scratch, Table 1's analog;
  ``*-lora`` fine-tune SmolLM2-135M with LoRA after swapping RoPE, Table 2's analog).
  ``--set key=value`` overrides any field (``--set model.hidden_size=256``).
* Methods: ``original`` (RoPE), ``alibi``, ``poslsh-s<k>``, ``fixed_blocks``.
* Batches are a pure function of the step (:func:`poslsh.data.tokens.batch_windows`),
  partitions of ``(seed, step, layer)``, dropout of ``(seed, step, rank)``: a resumed
  run repeats the uninterrupted one exactly, and DDP ranks split the same global batch.
* Checkpoints (safetensors: trainable parameters; optimizer tensors + RNG states;
  ``state.json`` alongside) are written to a temp dir and renamed, so a kill never
  leaves a half-written one. Runs under ``torchrun`` use DDP (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..data.tokens import DataConfig, batch_windows, load_token_data
from ..io import atomic_write_text

__all__ = ["ModelConfig", "TrainConfig", "PRESETS", "get_preset", "parse_method", "build_model", "train",
           "run_dir", "atomic_write_text", "load_checkpoint_params", "register"]

METHODS = ("original", "alibi", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "fixed_blocks")


@dataclass
class ModelConfig:
    kind: str = "scratch"             # "scratch": Qwen3-style, random init; "lora": pretrained + LoRA
    base: str = "smollm2"             # lora: "smollm2" or a local Hugging Face model directory
    hidden_size: int = 128            # scratch model shape
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4             # GQA
    head_dim: int = 16
    intermediate_size: int = 384
    lora_r: int = 16                  # the paper's LoRA: r 16, alpha 32, dropout 0.05, q/k/v/o
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_targets: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class TrainConfig:
    preset: str = "custom"
    method: str = "poslsh-s10"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    seq_len: int = 256                # training context length
    batch_size: int = 16              # sequences per optimizer step, over all ranks
    micro_batch_size: int = 16        # sequences per forward pass on one rank
    steps: int = 1000
    lr: float = 1e-3                  # AdamW as in the paper: betas (0.9, 0.999), eps 1e-8,
    weight_decay: float = 0.01        # weight decay 0.01, warmup ratio 0.1, then linear decay
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    fixed_block_size: int = 64        # the fixed-blocks baseline (paper: 512 at 8k context)
    eval_multipliers: Tuple[int, ...] = (1, 2, 4)   # eval context = multiplier x seq_len
    eval_tokens: int = 32768          # scored tokens per eval length (same tokens for every length)
    eval_batch_tokens: int = 8192     # tokens per eval forward pass
    eval_split: str = "test"
    ckpt_interval: int = 200
    keep_checkpoints: int = 2
    device: str = "auto"              # auto | cpu | cuda
    amp: str = "auto"                 # bf16 autocast on CUDA when "auto"; "off" = float32
    threads: int = 0                  # torch intra-op threads (0 = torch default)
    runs_dir: str = "runs"
    cache_dir: str = ""               # token/tokenizer cache ("" = ~/.cache/poslsh or $POSLSH_CACHE)
    methods: Tuple[str, ...] = METHODS  # what `poslsh table` runs
    seeds: Tuple[int, ...] = (0, 1, 2)


def _cpu_model() -> ModelConfig:
    return ModelConfig(hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, intermediate_size=384)


PRESETS = {
    # End-to-end in well under 2 minutes on 2 cores: a few python-doc pages, a 512-token BPE.
    "smoke": TrainConfig(
        preset="smoke", data=DataConfig(corpora=("python-doc",), tokenizer="bpe:512", max_train_docs=40,
                                        max_eval_docs=8),
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=128),
        seq_len=64, batch_size=8, micro_batch_size=8, steps=30, lr=3e-3, fixed_block_size=16,
        eval_tokens=2048, eval_batch_tokens=4096, ckpt_interval=10, seeds=(0, 1)),
    # The from-scratch table (Table 1's analog) on 2 CPU cores in < 3 h: 7 methods x 3 seeds, run as
    # `poslsh table --preset cpu --jobs 2`. Small batches learn far more per token at this scale (the
    # paper uses batch 1): 2 x 256 tokens, 2800 steps = 1.4M tokens per run.
    "cpu": TrainConfig(
        preset="cpu", data=DataConfig(tokenizer="bpe:4096"), model=_cpu_model(),
        seq_len=256, batch_size=2, micro_batch_size=2, steps=2800, lr=3e-3, fixed_block_size=64,
        eval_tokens=32768, eval_batch_tokens=8192, ckpt_interval=400),
    # A larger model and context for one GPU (the paper: Qwen3-0.6B at 8k; this is much smaller).
    "gpu": TrainConfig(
        preset="gpu", data=DataConfig(tokenizer="bpe:16384"),
        model=ModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                          intermediate_size=1536),
        seq_len=1024, batch_size=32, micro_batch_size=16, steps=6000, lr=5e-4, fixed_block_size=128,
        eval_tokens=131072, eval_batch_tokens=65536, ckpt_interval=500),
    # LoRA fine-tuning of SmolLM2-135M with its RoPE replaced (Table 2's analog).
    "smoke-lora": TrainConfig(
        preset="smoke-lora", data=DataConfig(corpora=("python-doc",), tokenizer="smollm2", max_train_docs=20,
                                             max_eval_docs=4),
        model=ModelConfig(kind="lora"), method="alibi", seq_len=64, batch_size=2, micro_batch_size=2, steps=4,
        lr=1e-4, fixed_block_size=16, eval_tokens=256, eval_batch_tokens=1024, ckpt_interval=2,
        methods=("original", "alibi", "poslsh-s5"), seeds=(0,)),
    # Reduced for 2 CPU cores (about an hour; SmolLM2 trains at ~80 tokens/s per core): 100 steps
    # (102k tokens), four methods, one seed, and twice the paper's learning rate as the run is short.
    "cpu-lora": TrainConfig(
        preset="cpu-lora", data=DataConfig(tokenizer="smollm2"), model=ModelConfig(kind="lora"),
        seq_len=256, batch_size=4, micro_batch_size=2, steps=100, lr=2e-4, fixed_block_size=64,
        eval_tokens=4096, eval_batch_tokens=2048, ckpt_interval=20,
        methods=("original", "alibi", "poslsh-s5", "fixed_blocks"), seeds=(0,)),
    # The complete fine-tuning table on a GPU.
    "gpu-lora": TrainConfig(
        preset="gpu-lora", data=DataConfig(tokenizer="smollm2"), model=ModelConfig(kind="lora"),
        seq_len=1024, batch_size=8, micro_batch_size=8, steps=2000, lr=1e-4, fixed_block_size=128,
        eval_tokens=65536, eval_batch_tokens=32768, ckpt_interval=250,
        methods=("original", "alibi", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "fixed_blocks")),
}


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def parse_method(method: str) -> Tuple[str, int]:
    """``"poslsh-s10"`` -> ``("poslsh", 10)``; other methods have ``s = 1``."""
    if method in ("original", "alibi", "fixed_blocks"):
        return method, 1
    if method.startswith("poslsh-s") and method[8:].isdigit() and int(method[8:]) >= 1:
        return "poslsh", int(method[8:])
    raise ValueError(f"unknown method {method!r}; use original, alibi, fixed_blocks or poslsh-s<k> (e.g. poslsh-s10)")


# ------------------------------------------------------------- config (de)serialisation
def config_to_dict(cfg) -> dict:
    return json.loads(json.dumps(asdict(cfg)))


def config_from_dict(d: dict) -> TrainConfig:
    """Inverse of :func:`config_to_dict` (lists become tuples; unknown keys are an error)."""
    nested = {"data": DataConfig, "model": ModelConfig}
    kwargs = {}
    for k, v in d.items():
        if k in nested:
            v = nested[k](**{kk: tuple(vv) if isinstance(vv, list) else vv for kk, vv in v.items()})
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return TrainConfig(**kwargs)


# --------------------------------------------------------------------- utilities
def run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.runs_dir) / cfg.preset / cfg.method / f"seed{cfg.seed}"


class Dist:
    """Process-group facts; a single process is world size 1 (no process group)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        self.device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if use_cuda else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, values) -> list:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()


def load_data(cfg: TrainConfig, dist: Dist):
    """Token arrays; rank 0 builds the cache first, the other ranks then read it."""
    cache = cfg.cache_dir or None
    if dist.main:
        data = load_token_data(cfg.data, cache)
    dist.barrier()
    if not dist.main:
        data = load_token_data(cfg.data, cache)
    return data


# ------------------------------------------------------------------------ models
def build_model(cfg: TrainConfig, vocab_size: int, separator_id: int = 0):
    """The model of ``cfg.method``: a Qwen3-style model from scratch or a LoRA-wrapped
    pretrained model, with the method's positional scheme (RoPE removed unless original)."""
    from ..integrations import hf

    scheme, s = parse_method(cfg.method)
    params = dict(num_samples=s, block_size=cfg.fixed_block_size, seed=cfg.seed, eval_seed=cfg.seed)
    torch.manual_seed(cfg.seed)   # initial weights (scratch) / LoRA init depend on the seed only
    m = cfg.model
    if m.kind == "scratch":
        from transformers import Qwen3Config
        qcfg = Qwen3Config(vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                           num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                           max_position_embeddings=cfg.seq_len * max(cfg.eval_multipliers),
                           tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=separator_id,
                           eos_token_id=separator_id, pad_token_id=separator_id)
        return hf.model_from_config(qcfg, scheme, **params)
    if m.kind != "lora":
        raise ValueError(f"model.kind must be 'scratch' or 'lora', got {m.kind!r}")
    from peft import LoraConfig, get_peft_model
    if m.base == "smollm2":
        from ..models.smollm2 import load_smollm2
        model, _ = load_smollm2()
    else:   # a local directory saved with save_pretrained; nothing is downloaded
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(m.base, local_files_only=True, dtype=torch.float32)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"tokenizer has {vocab_size} tokens but the model only {model.config.vocab_size}: "
                         "use the model's own tokenizer (data.tokenizer)")
    hf.apply_positional_scheme(model, scheme, **params)
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, bias="none",
                      target_modules=list(m.lora_targets), task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def trainable_parameters(model):
    return [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_ratio`` of the steps, then linear decay to 0 (HF's default)."""
    warm = max(1, int(round(cfg.warmup_ratio * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * max(0.0, (cfg.steps - step) / max(1, cfg.steps - warm))


def autocast_for(cfg: TrainConfig, device: torch.device):
    if device.type == "cuda" and cfg.amp in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ------------------------------------------------------------------ checkpoints
def _flatten_optimizer(sd: dict):
    tensors, state = {}, {}
    for k, entry in sd["state"].items():
        state[str(k)] = {}
        for name, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{k}.{name}"] = v.detach().cpu().contiguous()
                state[str(k)][name] = {"tensor": f"opt.{k}.{name}"}
            else:
                state[str(k)][name] = v
    return tensors, {"state": state, "param_groups": sd["param_groups"]}


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {int(k): {n: (tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v)
                      for n, v in entry.items()} for k, entry in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state(device: torch.device):
    tensors = {"rng.torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
    st = np.random.get_state()
    return tensors, {"python": random.getstate(), "numpy": [st[0], st[1].tolist(), *st[2:]]}


def _set_rng_state(tensors: dict, meta: dict, device: torch.device) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"], device)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = meta["numpy"]
    np.random.set_state((np_state[0], np.asarray(np_state[1], dtype=np.uint32), *np_state[2:]))


def save_checkpoint(directory: Path, step: int, model, optimizer, info: dict, keep: int) -> Path:
    from safetensors.torch import save_file

    ckdir = directory / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=ckdir, prefix=".tmp-"))
    save_file({n: p.detach().cpu().contiguous() for n, p in trainable_parameters(model)},
              str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
    rng_tensors, rng_meta = _rng_state(next(unwrap(model).parameters()).device)
    save_file({**opt_tensors, **rng_tensors}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, "optimizer": opt_meta, "rng": rng_meta, **info},
                                               indent=1, default=str))
    os.chmod(tmp, 0o755)
    final = ckdir / f"step-{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write_text(ckdir / "latest", final.name + "\n")
    for old in sorted(p for p in ckdir.glob("step-*") if p.name != final.name)[:-keep or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: Path) -> Optional[Path]:
    pointer = directory / "checkpoints" / "latest"
    if pointer.exists():
        path = directory / "checkpoints" / pointer.read_text().strip()
        if (path / "state.json").exists():
            return path
    return None


def load_checkpoint(path: Path, model, optimizer, device: torch.device) -> dict:
    from safetensors.torch import load_file

    params = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for n, p in trainable_parameters(model):
            p.copy_(params[n])
    tensors = load_file(str(path / "optimizer.safetensors"))
    state = json.loads((path / "state.json").read_text())
    optimizer.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
    _set_rng_state(tensors, state["rng"], device)
    return state


def load_checkpoint_params(path) -> dict:
    """``{name: tensor}`` of a checkpoint's trainable parameters (tests, analysis)."""
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


# ----------------------------------------------------------------------- training
def _loss_sum(model, batch: torch.Tensor) -> Tuple[torch.Tensor, int]:
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"), y.numel()


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False, progress: bool = True,
          evaluate: bool = True) -> dict:
    """Train ``cfg`` (resuming from the latest checkpoint when ``resume``), then evaluate it.
    Returns the result dict, also written to ``<run dir>/result.json``."""
    parse_method(cfg.method)
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, resume, overwrite, progress, evaluate)
    finally:
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, resume: bool, overwrite: bool, progress: bool, evaluate: bool) -> dict:
    from ..integrations import hf
    from . import lm_eval

    dist = Dist(cfg.device)
    if cfg.batch_size % dist.world:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the world size {dist.world}")
    per_rank = cfg.batch_size // dist.world
    micro = min(cfg.micro_batch_size, per_rank)
    if per_rank % micro:
        raise ValueError(f"per-rank batch {per_rank} must be a multiple of micro_batch_size {micro}")
    out_dir = run_dir(cfg)
    data = load_data(cfg, dist)
    model = build_model(cfg, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
    named = trainable_parameters(model)
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]   # norms and biases: no weight decay
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8)
    start, history, elapsed = 0, [], 0.0
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None and resume:
        state = load_checkpoint(ckpt, model, optimizer, dist.device)
        start, history, elapsed = state["step"], state.get("history", []), state.get("elapsed_s", 0.0)
        if dist.main:
            print(f"resuming {out_dir} from step {start}", file=sys.stderr)
    elif (ckpt is not None or (out_dir / "result.json").exists()) and not overwrite:
        raise FileExistsError(f"{out_dir} already has a run: pass --resume to continue it or --overwrite")
    elif overwrite and dist.main and out_dir.exists():
        shutil.rmtree(out_dir)
    dist.barrier()
    if dist.main:
        atomic_write_text(out_dir / "config.json", json.dumps(config_to_dict(cfg), indent=1))
    ddp_model = model
    if dist.world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    train_tokens = data.splits["train"]
    rows = slice(dist.rank * per_rank, (dist.rank + 1) * per_rank)
    kill_after = int(os.environ.get("POSLSH_KILL_AFTER_STEP", "-1"))   # test hook: simulate a crash
    bar = None
    if progress and dist.main:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.preset} {cfg.method} seed{cfg.seed}",
                   mininterval=1.0, dynamic_ncols=True)
    info = lambda: {"history": history, "elapsed_s": elapsed, "config": config_to_dict(cfg)}  # noqa: E731
    model.train()
    t_run, tok_run, t_first = time.perf_counter(), 0, 0.0
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            hf.set_training_step(model, step)
            torch.manual_seed(hf.partition_seed("dropout", cfg.seed, step, dist.rank))
            batch = torch.from_numpy(batch_windows(train_tokens, cfg.seq_len, step, cfg.batch_size, cfg.seed,
                                                   rows)).to(dist.device)
            n_tok = per_rank * cfg.seq_len
            loss_total = 0.0
            for lo in range(0, per_rank, micro):
                last = lo + micro >= per_rank
                sync = nullcontext() if (last or dist.world == 1) else ddp_model.no_sync()
                with sync:
                    with autocast_for(cfg, dist.device):
                        loss_sum, _ = _loss_sum(ddp_model, batch[lo: lo + micro])
                    (loss_sum / n_tok).backward()
                loss_total += float(loss_sum.detach())
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = dist.sum([loss_total])[0] / (cfg.batch_size * cfg.seq_len)
            dt = time.perf_counter() - t0
            elapsed += dt
            history.append([step + 1, round(loss, 5)])
            tok_run += cfg.batch_size * cfg.seq_len
            rate = tok_run / max(1e-9, time.perf_counter() - t_run)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}", refresh=False)
                bar.update(1)
            elif dist.main and (step + 1) % max(1, cfg.steps // 20) == 0:   # logs without a bar
                print(f"step {step + 1}/{cfg.steps} loss {loss:.4f} lr {lr:.2e} {rate:.0f} tokens/s",
                      file=sys.stderr, flush=True)
            if step == start:
                t_first = time.perf_counter()   # the first step includes warm-up: time the next ones
            elif step == start + 3 and dist.main:
                rate = 3 * cfg.batch_size * cfg.seq_len / max(1e-9, time.perf_counter() - t_first)
                print(f"\n[estimate] {rate:.0f} tokens/s: about {estimate_minutes(cfg, rate, step + 1):.1f} min "
                      f"left for this run (training + evaluation)", file=sys.stderr)
            done = step + 1
            if done % cfg.ckpt_interval == 0 or done == cfg.steps:
                if dist.main:
                    save_checkpoint(out_dir, done, model, optimizer, info(), cfg.keep_checkpoints)
                dist.barrier()
            if done == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    except KeyboardInterrupt:
        if dist.world == 1 and history and history[-1][0] > start:
            save_checkpoint(out_dir, history[-1][0], model, optimizer, info(), cfg.keep_checkpoints)
            print(f"\ninterrupted: checkpoint at step {history[-1][0]} saved; rerun with --resume", file=sys.stderr)
        raise
    finally:
        if bar is not None:
            bar.close()
    result = {"preset": cfg.preset, "method": cfg.method, "seed": cfg.seed, "steps": cfg.steps,
              "final_train_loss": history[-1][1] if history else None, "train_time_s": round(elapsed, 1),
              "train_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
              "train_tokens_per_s": round(cfg.steps * cfg.batch_size * cfg.seq_len / max(elapsed, 1e-9), 1),
              "world_size": dist.world, "data": data.meta.get("splits"), "config": config_to_dict(cfg)}
    if evaluate:
        t0 = time.perf_counter()
        result["eval"] = lm_eval.evaluate(model, data.splits[cfg.eval_split], cfg, dist, progress=progress)
        result["eval_time_s"] = round(time.perf_counter() - t0, 1)
        result["eval_split"] = cfg.eval_split
    if dist.main:
        atomic_write_text(out_dir / "result.json", json.dumps(result, indent=1))
    dist.barrier()
    return result


def estimate_minutes(cfg: TrainConfig, train_tok_s: float, step: int = 0) -> float:
    """Rough wall time left: remaining steps at ``train_tok_s``, plus evaluation (forward
    only, about 3x faster per token; cost grows with the context multiplier)."""
    from .lm_eval import eval_forward_tokens
    train_s = (cfg.steps - step) * cfg.batch_size * cfg.seq_len / train_tok_s
    eval_s = eval_forward_tokens(cfg) / (3.0 * train_tok_s)
    return (train_s + eval_s) / 60.0


# ----------------------------------------------------------------------------- CLI
def _cmd_train(args) -> int:
    from .lm_eval import config_from_args
    cfg = config_from_args(args)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:
        from .lm_eval import format_result
        print(format_result(result))
        print(f"run directory: {run_dir(cfg)}")
    return 0


def register(subparsers) -> None:
    from .lm_eval import add_config_arguments
    p = subparsers.add_parser("train", help="train (and evaluate) one language model: a method x seed of a preset",
                              description=__doc__.split("\n\n")[0])
    add_config_arguments(p)
    p.add_argument("--method", help=f"positional scheme: {', '.join(METHODS)} (any poslsh-s<k>)")
    p.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run of the same name first")
    p.set_defaults(func=_cmd_train)


def main(argv=None) -> int:
    """``python -m poslsh.experiments.train {train,eval,table} ...`` (same as the ``poslsh`` CLI)."""
    import argparse
    from . import lm_eval

    parser = argparse.ArgumentParser(prog="python -m poslsh.experiments.train")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    lm_eval.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":   # run the imported module, not __main__, so classes are not duplicated
    from poslsh.experiments.train import main as _main
    sys.exit(_main())
