"""Training and evaluating one vision run (a method x seed), resumable.

Everything random is a function of ``(seed, step)``: the initialisation (``seed``), the order of
epoch ``e`` (a permutation seeded by ``(seed, e)``) and the PosLSH boxes of step ``t`` and layer
``l`` (``(seed, t, l)``), so a resumed run repeats the uninterrupted one bit for bit. Checkpoints
are safetensors, written atomically with a manifest (:mod:`poslsh_paper.experiments.checkpoints`);
``result.json`` is written atomically at the end.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from poslsh_paper.data.images import ImageSet, load_images, subset, to_float, upsample
from poslsh_paper.io import atomic_write_text
from poslsh.seeding import stable_seed
from poslsh.threads import intra_op_threads
from poslsh_paper.experiments.checkpoints import (latest_checkpoint, load_checkpoint, prepare_resume, run_lock,
                                                 save_checkpoint)
from poslsh_paper.experiments.serialize import config_to_dict
from poslsh_paper.experiments.vision.config import VisionConfig, check, parse_method, run_dir
from poslsh_paper.experiments.vision.model import ViT

__all__ = ["load_splits", "build_model", "lr_at", "train_run", "evaluate", "result_line", "main", "RESULT"]

RESULT = "result.json"


def load_splits(cfg: VisionConfig) -> Dict[str, ImageSet]:
    """The fixed training and test subsets (the same images for every method and seed)."""
    train = subset(load_images(cfg.dataset, "train", synthetic_count=max(cfg.train_images, 64)), cfg.train_images,
                   stable_seed("vision-subset", "train"))
    test = subset(load_images(cfg.dataset, "test", synthetic_count=max(cfg.test_images, 64)), cfg.test_images,
                  stable_seed("vision-subset", "test"))
    return {"train": train, "test": test}


def build_model(cfg: VisionConfig, method: str, seed: int) -> ViT:
    """The ViT of ``method``, initialised from ``seed``."""
    torch.manual_seed(stable_seed("vision-init", seed))
    model = ViT(cfg.model, parse_method(method), backend=cfg.backend)
    model.set_seeds(seed, cfg.eval_seed)
    return model


def steps_per_epoch(cfg: VisionConfig, n_train: int) -> int:
    return max(1, n_train // cfg.batch_size)     # the last partial batch of an epoch is dropped


def lr_at(step: int, total: int, cfg: VisionConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_ratio`` of the steps, then cosine decay to 0."""
    warm = max(1, round(cfg.warmup_ratio * total))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def _optimizer(model: ViT, cfg: VisionConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.999))


def _batch(data: ImageSet, cfg: VisionConfig, seed: int, step: int, per_epoch: int):
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(stable_seed("vision-order", seed, epoch)))
    idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]
    return to_float(data.images[idx]), data.labels[idx]


@torch.no_grad()
def evaluate(model: ViT, data: ImageSet, cfg: VisionConfig) -> Dict[str, dict]:
    """Test accuracy (%) and mean cross-entropy at each of ``cfg.eval_scales`` (images upsampled
    bilinearly: scale 2 = 56 x 56 pixels, 4x the patch tokens), keys ``"1x"``, ``"2x"``; with
    ``eval_scaled_sigma`` the bias/box methods also at ``"2x-scaled"``: sigma and box sides times
    the scale (distances in training patches). Eval mode: fixed partitions."""
    was_training = model.training
    model.eval()
    out = {}
    runs = [(scale, 1) for scale in cfg.eval_scales]
    if cfg.eval_scaled_sigma and model.method.kind != "learned":
        runs += [(scale, scale) for scale in cfg.eval_scales if scale > 1]
    for scale, mult in runs:
        model.set_sigma_mult(mult)
        correct, loss, t0 = 0, 0.0, time.perf_counter()
        for lo in range(0, len(data), cfg.eval_batch_size):
            x = upsample(to_float(data.images[lo:lo + cfg.eval_batch_size]), scale)
            y = data.labels[lo:lo + cfg.eval_batch_size]
            logits = model(x)
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        g = 28 * scale // model.cfg.patch_size
        out[f"{scale}x" + ("-scaled" if mult > 1 else "")] = {
            "scale": scale, "sigma_mult": mult, "pixels": 28 * scale, "grid": [g, g], "acc": 100.0 * correct / len(data),
            "loss": loss / len(data), "images": len(data), "seconds": round(time.perf_counter() - t0, 1)}
    model.set_sigma_mult(1)
    model.train(was_training)
    return out


def train_run(cfg: VisionConfig, method: str, seed: int, *, splits: Optional[Dict[str, ImageSet]] = None,
              progress: Optional[Callable[[str], None]] = None, overwrite: bool = False) -> dict:
    """Train (resuming from the newest complete checkpoint) and evaluate one run; returns the
    result, also written to ``<run dir>/result.json``. A finished run is returned as is."""
    check(cfg)
    out = run_dir(cfg, method, seed)
    if (out / RESULT).is_file() and not overwrite:
        return json.loads((out / RESULT).read_text())
    with run_lock(out), intra_op_threads(cfg.threads):
        return _train(cfg, method, seed, splits or load_splits(cfg), progress)


def _train(cfg: VisionConfig, method: str, seed: int, splits: Dict[str, ImageSet], progress) -> dict:
    out = run_dir(cfg, method, seed)
    model = build_model(cfg, method, seed)
    params = list(model.named_parameters())
    opt = _optimizer(model, cfg)
    per_epoch = steps_per_epoch(cfg, len(splits["train"]))
    total = cfg.epochs * per_epoch
    state = {"step": 0, "history": [], "elapsed_s": 0.0, "cpu_s": 0.0}
    for line in prepare_resume(out):      # older-layout checkpoints adopted, damaged ones moved aside
        print(line, file=sys.stderr)
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        saved = load_checkpoint(ckpt, params, opt, torch.device("cpu"))
        state = {k: saved.get(k, state[k]) for k in state}
        print(f"resuming {out} from step {state['step']} ({ckpt})", file=sys.stderr)
    atomic_write_text(out / "config.json", json.dumps({"method": method, "seed": seed, **config_to_dict(cfg)},
                                                      indent=1))
    model.train()
    for step in range(state["step"], total):
        t0, c0 = time.perf_counter(), time.process_time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg)
        x, y = _batch(splits["train"], cfg, seed, step, per_epoch)
        loss = F.cross_entropy(model(x, step), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["elapsed_s"] += time.perf_counter() - t0
        state["cpu_s"] += time.process_time() - c0        # CPU time: what the run costs on quiet cores
        state["step"] = step + 1
        state["history"].append([step + 1, round(loss.item(), 5)])
        if state["step"] % cfg.ckpt_interval == 0 or state["step"] == total:
            save_checkpoint(out, state["step"], params, opt, {**state, "method": method}, cfg.keep_checkpoints)
        if progress and (state["step"] % max(1, total // 5) == 0 or state["step"] == total):
            progress(f"{method} seed{seed}: step {state['step']}/{total} loss {loss.item():.3f} "
                     f"({state['elapsed_s']:.0f} s)")
    t0, c0 = time.perf_counter(), time.process_time()
    evals = evaluate(model, splits["test"], cfg)
    result = {"method": method, "seed": seed, "steps": total, "train_images": len(splits["train"]),
              "test_images": len(splits["test"]), "train_time_s": round(state["elapsed_s"], 3),
              "train_cpu_s": round(state["cpu_s"], 3), "eval_time_s": round(time.perf_counter() - t0, 3),
              "eval_cpu_s": round(time.process_time() - c0, 3), "threads": torch.get_num_threads(),
              "final_train_loss": state["history"][-1][1] if state["history"] else None,
              "eval": evals, "history": state["history"], "data": splits["train"].source,
              "config": config_to_dict(cfg)}
    atomic_write_text(out / RESULT, json.dumps(result, indent=1))
    if progress:
        progress(result_line(result))
    return result


def result_line(result: dict) -> str:
    """``poslsh-s2 seed0: acc@1x 81.25%, acc@2x 70.31%``: one finished run in one line."""
    return f"{result['method']} seed{result['seed']}: " + ", ".join(f"acc@{k} {v['acc']:.2f}%"
                                                                   for k, v in result["eval"].items())


def main(argv: Sequence[str]) -> int:
    """A sweep's worker (:func:`.table.run_all` with ``jobs > 1``): ``python -m
    poslsh_paper.experiments.vision.train CONFIG.json METHOD SEED`` trains one run (resuming) and
    prints its result line."""
    from poslsh_paper.experiments.serialize import config_from_dict

    path, method, seed = argv
    cfg = config_from_dict(VisionConfig, json.loads(Path(path).read_text()))
    print(result_line(train_run(cfg, method, int(seed))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
