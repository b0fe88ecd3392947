"""Evaluation and tables for :mod:`poslsh.experiments.train`.

Perplexity and next-token accuracy at the training length ``L`` and at ``kL``
(``k`` in ``eval_multipliers``), as in the paper's section 6.2: a sliding window
of ``kL`` tokens moves over the test stream with stride ``L``; the first window
scores all its targets, every later one only its last ``L`` (each with at least
``(k-1)L`` tokens of context). Every length scores the same targets (the first
``eval_tokens`` of the split), so the columns differ only in the context given.

``poslsh table --preset cpu`` trains every method x seed of the preset that has
no result yet (resuming interrupted runs), then writes
``results/<preset>/table.md``, ``table.csv`` and ``table.json`` (mean +- sample
std over seeds) and checks the paper's claims against the numbers.
"""
from __future__ import annotations

import ast
import csv
import io
import subprocess
import json
import math
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

from ..io import atomic_write_text

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["scored_tokens", "eval_windows", "eval_forward_tokens", "evaluate", "aggregate", "render_markdown",
           "write_table", "run_table", "format_result", "register"]

METHOD_LABELS = {"original": "Original (RoPE)", "alibi": "ALiBi", "fixed_blocks": "Fixed blocks"}


def method_label(method: str) -> str:
    if method.startswith("poslsh-s"):
        return f"Positional LSH, s={method[8:]}"
    return METHOD_LABELS.get(method, method)


# -------------------------------------------------------------------- windows
def scored_tokens(n_tokens: int, cfg) -> int:
    """Targets scored at every length: ``eval_tokens`` rounded down to a multiple of
    ``seq_len``, at most what the split holds; at least one window of the longest length."""
    L, longest = cfg.seq_len, cfg.seq_len * max(cfg.eval_multipliers)
    T = min(cfg.eval_tokens, n_tokens - 1) // L * L
    if T < longest:
        raise ValueError(f"the eval split has {n_tokens} tokens: fewer than one {longest}-token window "
                         f"(seq_len {L} x {max(cfg.eval_multipliers)}) needs; raise eval_tokens or lower the multipliers")
    return T


def eval_windows(total: int, context: int, stride: int) -> List[int]:
    """Window starts: ``[0, stride, 2 stride, ...]`` while the window ends by target ``total``."""
    return list(range(0, total - context + 1, stride))


def eval_forward_tokens(cfg, n_tokens: Optional[int] = None) -> int:
    """Tokens run through the model by :func:`evaluate` (for time estimates)."""
    T = cfg.eval_tokens // cfg.seq_len * cfg.seq_len if n_tokens is None else scored_tokens(n_tokens, cfg)
    return sum(len(eval_windows(T, k * cfg.seq_len, cfg.seq_len)) * k * cfg.seq_len for k in cfg.eval_multipliers)


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, cfg, dist, progress: bool = False) -> Dict[str, dict]:
    """``{"1x": {"context", "ppl", "acc", "nll", "tokens", "windows"}, "2x": ...}``; ``acc`` in %.
    Windows are split over DDP ranks and the sums all-reduced."""
    from .train import autocast_for

    was_training = model.training
    model.eval()
    L = cfg.seq_len
    T = scored_tokens(len(tokens), cfg)
    out = {}
    for k in cfg.eval_multipliers:
        C = k * L
        starts = eval_windows(T, C, L)
        mine = starts[dist.rank::dist.world]
        per_batch = max(1, cfg.eval_batch_tokens // C)
        nll = correct = count = 0.0
        # The first window scores all C targets, the others their last L.
        groups = [[0]] if 0 in mine else []
        rest = [b for b in mine if b != 0]
        groups += [rest[i: i + per_batch] for i in range(0, len(rest), per_batch)]
        t0 = time.perf_counter()
        for g in groups:
            keep = C if g == [0] else L
            x = torch.from_numpy(np.stack([tokens[b: b + C] for b in g]).astype(np.int64)).to(dist.device)
            y = torch.from_numpy(np.stack([tokens[b + C - keep + 1: b + C + 1] for b in g]).astype(np.int64))
            y = y.to(dist.device)
            with autocast_for(cfg, dist.device):
                logits = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits
            logits = logits.float().reshape(-1, logits.shape[-1])
            nll += float(F.cross_entropy(logits, y.reshape(-1), reduction="sum"))
            correct += float((logits.argmax(-1) == y.reshape(-1)).sum())
            count += y.numel()
        nll, correct, count = dist.sum([nll, correct, count])
        out[f"{k}x"] = {"context": C, "ppl": math.exp(nll / count), "acc": 100.0 * correct / count,
                        "nll": nll / count, "tokens": int(count), "windows": len(starts),
                        "seconds": round(time.perf_counter() - t0, 1)}
        if progress and dist.main:
            r = out[f"{k}x"]
            print(f"eval {k}x (context {C}): ppl {r['ppl']:.3f} acc {r['acc']:.2f}% "
                  f"({r['tokens']} tokens, {r['seconds']}s)", file=sys.stderr)
    model.train(was_training)
    return out


def format_result(result: dict) -> str:
    lines = [f"{method_label(result['method'])}, seed {result['seed']}: final train loss "
             f"{result['final_train_loss']}, {result['train_tokens_per_s']} tokens/s"]
    for k, r in (result.get("eval") or {}).items():
        lines.append(f"  {k} (context {r['context']}): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------- tables
def _mean_std(xs: List[float]):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def aggregate(results: List[dict], methods: List[str]) -> List[dict]:
    """One row per (method, length): mean and sample std over seeds."""
    rows = []
    for m in methods:
        runs = [r for r in results if r["method"] == m and r.get("eval")]
        if not runs:
            continue
        for k in runs[0]["eval"]:
            ppl, ppl_sd = _mean_std([r["eval"][k]["ppl"] for r in runs])
            acc, acc_sd = _mean_std([r["eval"][k]["acc"] for r in runs])
            rows.append({"method": m, "label": method_label(m), "length": k, "context": runs[0]["eval"][k]["context"],
                         "seeds": len(runs), "ppl_mean": ppl, "ppl_std": ppl_sd, "acc_mean": acc, "acc_std": acc_sd,
                         "ppl_by_seed": {r["seed"]: r["eval"][k]["ppl"] for r in runs}})
    return rows


def _get(rows, method, length, key="ppl_mean"):
    for r in rows:
        if r["method"] == method and r["length"] == length:
            return r[key]
    return None


def findings(rows: List[dict]) -> List[str]:
    """The paper's claims, checked against ``rows`` (each line says holds / does not hold)."""
    out = []
    lengths = sorted({r["length"] for r in rows}, key=lambda s: int(s[:-1]))
    if not lengths:
        return out
    train_len = lengths[0]
    lsh = sorted((int(r["method"][8:]), r["method"]) for r in rows if r["method"].startswith("poslsh-s")
                 and r["length"] == train_len)
    ok = lambda c: "holds" if c else "does NOT hold"  # noqa: E731
    if len(lsh) > 1:
        ppls = [_get(rows, m, train_len) for _, m in lsh]
        mono = all(a >= b for a, b in zip(ppls, ppls[1:]))
        out.append(f"PPL improves as s grows ({', '.join(f's={s}: {p:.3f}' for (s, _), p in zip(lsh, ppls))}): "
                   f"{ok(mono)}.")
    alibi = _get(rows, "alibi", train_len)
    if lsh and alibi:
        s_max, m_max = lsh[-1]
        gap = 100.0 * (_get(rows, m_max, train_len) / alibi - 1.0)
        # Runs with the same seed share initialisation and data order, so per-seed gaps are paired.
        a_seeds = _get(rows, "alibi", train_len, "ppl_by_seed") or {}
        l_seeds = _get(rows, m_max, train_len, "ppl_by_seed") or {}
        paired = [100.0 * (l_seeds[k] / a_seeds[k] - 1.0) for k in sorted(set(a_seeds) & set(l_seeds))]
        per_seed = f"; per seed: {', '.join(f'{g:+.2f}%' for g in paired)}" if len(paired) > 1 else ""
        out.append(f"PosLSH s={s_max} within about 1% of ALiBi at the training length "
                   f"(PPL gap {gap:+.2f}%{per_seed}; counted as holding up to 1.5%): {ok(abs(gap) <= 1.5)}.")
    fixed = _get(rows, "fixed_blocks", train_len)
    if lsh and fixed:
        beats = [s for s, m in lsh if _get(rows, m, train_len) < fixed]
        out.append(f"PosLSH beats fixed blocks at the training length (fixed: {fixed:.3f}; beaten by s in "
                   f"{beats or 'none'}): {ok(len(beats) == len(lsh))}.")
    for length in lengths[1:]:
        rope = _get(rows, "original", length)
        if rope is None:
            continue
        better = [m for m in ["alibi"] + [m for _, m in lsh] if (_get(rows, m, length) or math.inf) < rope]
        cands = ["alibi"] + [m for _, m in lsh]
        present = [m for m in cands if _get(rows, m, length) is not None]
        out.append(f"ALiBi/PosLSH extrapolate better than RoPE at {length} (RoPE PPL {rope:.3f}; better: "
                   f"{', '.join(better) or 'none'}): {ok(present and len(better) == len(present))}.")
    return out


def render_markdown(rows: List[dict], meta: dict) -> str:
    lengths = sorted({r["length"] for r in rows}, key=lambda s: int(s[:-1]))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ctx = {r["length"]: r["context"] for r in rows}
    head = ["Method", "Seeds"]
    for i, k in enumerate(lengths):
        tag = " (training)" if i == 0 else " (extrapolation)"
        head += [f"PPL @{ctx[k]}{tag}", f"Acc % @{ctx[k]}"]
    lines = [f"# {meta.get('title', 'Length extrapolation')}", ""]
    for key in ("command", "setup", "evaluation"):
        if meta.get(key):
            lines += [f"**{key.capitalize()}:** {meta[key]}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        n_seeds = _get(rows, m, lengths[0], "seeds")
        cells = [method_label(m), str(n_seeds)]
        for k in lengths:
            p, ps = _get(rows, m, k), _get(rows, m, k, "ppl_std")
            a, as_ = _get(rows, m, k, "acc_mean"), _get(rows, m, k, "acc_std")
            if p is None:
                cells += ["-", "-"]
            elif n_seeds > 1:
                cells += [f"{p:.2f} ± {ps:.2f}", f"{a:.2f} ± {as_:.2f}"]
            else:  # one seed: no spread to report
                cells += [f"{p:.2f}", f"{a:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Mean ± sample standard deviation over the seeds counted in the Seeds column.", ""]
    found = findings(rows)
    if found:
        lines += ["## The paper's findings, checked", ""] + [f"- {f}" for f in found] + [""]
    return "\n".join(lines)


def write_table(results: List[dict], methods: List[str], out_dir: Path, meta: dict) -> List[dict]:
    """Write ``table.md``, ``table.csv`` and ``table.json`` under ``out_dir`` atomically."""
    rows = aggregate(results, methods)
    buf = io.StringIO()
    fields = ["method", "label", "length", "context", "seeds", "ppl_mean", "ppl_std", "acc_mean", "acc_std"]
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(out_dir / "table.csv", buf.getvalue())
    slim = [{k: v for k, v in r.items() if k != "config"} for r in results]
    atomic_write_text(out_dir / "table.json", json.dumps({"meta": meta, "rows": rows, "findings": findings(rows),
                                                          "runs": slim}, indent=1))
    atomic_write_text(out_dir / "table.md", render_markdown(rows, meta))
    return rows


def _describe(cfg, results: List[dict]) -> dict:
    m = cfg.model
    if m.kind == "scratch":
        model = (f"Qwen3-style model from scratch: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} query / "
                 f"{m.num_kv_heads} key-value heads of dim {m.head_dim}")
    else:
        model = f"{m.base} + LoRA (r {m.lora_r}, alpha {m.lora_alpha}, {'/'.join(m.lora_targets)}), RoPE replaced"
    data = results[0].get("data") if results else None
    train_tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    setup = (f"{model}; corpora {', '.join(cfg.data.corpora)} (split by document), tokenizer {cfg.data.tokenizer}; "
             f"{cfg.steps} steps x {cfg.batch_size} sequences x {cfg.seq_len} tokens = {train_tokens:,} training "
             f"tokens; AdamW lr {cfg.lr}, weight decay {cfg.weight_decay}, warmup {cfg.warmup_ratio}; fixed blocks "
             f"of {cfg.fixed_block_size}.")
    if data:
        setup += " Split sizes (tokens): " + ", ".join(f"{k} {v['tokens']:,}" for k, v in data.items()) + "."
    scored = results[0]["eval"]["1x"]["tokens"] if results and results[0].get("eval") else cfg.eval_tokens
    evaluation = (f"{cfg.eval_split} split, the same {scored:,} target tokens at every length; lengths "
                  f"{', '.join(str(k * cfg.seq_len) for k in cfg.eval_multipliers)} use a sliding window whose "
                  f"stride is the training length ({cfg.seq_len}), as in the paper; PosLSH evaluates with fixed "
                  f"partitions seeded by the run's seed.")
    return {"setup": setup, "evaluation": evaluation}


def run_table(cfg, methods, seeds, results_dir: Path, *, progress: bool = True, command: str = "",
              train_missing: bool = True, jobs: int = 1) -> List[dict]:
    """Train (or resume) every missing method x seed run, ``jobs`` at a time, then write the table."""
    from .train import run_dir, train

    runs = [replace(cfg, method=m, seed=s) for m in methods for s in seeds]
    # Seed-major training order: a table cut short still has every method at the first seeds.
    todo = [replace(cfg, method=m, seed=s) for s in seeds for m in methods]
    todo = [r for r in todo if not (run_dir(r) / "result.json").exists()]
    if train_missing and todo:
        if jobs > 1:
            _train_parallel(todo, jobs)
        else:
            for r in todo:
                train(r, resume=True, progress=progress)
    results = [json.loads((run_dir(r) / "result.json").read_text()) for r in runs
               if (run_dir(r) / "result.json").exists()]
    if int(os.environ.get("RANK", "0")) == 0 and results:
        title = ("Length extrapolation, trained from scratch (Table 1 analog)" if cfg.model.kind == "scratch"
                 else "Length extrapolation, LoRA fine-tuning (Table 2 analog)")
        meta = {"title": f"{title}: preset `{cfg.preset}`", "command": f"`{command}`" if command else "",
                **_describe(cfg, results)}
        write_table(results, list(methods), Path(results_dir) / cfg.preset, meta)
    return results


def _train_parallel(cfgs, jobs: int) -> None:
    """Run ``poslsh train --resume`` for each config in a subprocess, ``jobs`` at a time, each
    with ``cpu_count // jobs`` threads (independent small runs scale better than threads do).
    Logs go to ``<run dir>/train.log``; Ctrl-C makes every child checkpoint and stop."""
    from tqdm.auto import tqdm
    from .train import config_to_dict, run_dir

    threads = max(1, (os.cpu_count() or 1) // jobs)
    pending, running, failed = list(cfgs), [], []
    bar = tqdm(total=len(pending), desc=f"runs ({jobs} in parallel)", unit="run")
    try:
        while pending or running:
            while pending and len(running) < jobs:
                c = pending.pop(0)
                c = c if c.threads else replace(c, threads=threads)
                d = run_dir(c)
                d.mkdir(parents=True, exist_ok=True)
                atomic_write_text(d / "requested-config.json", json.dumps(config_to_dict(c), indent=1))
                log = open(d / "train.log", "a")
                cmd = [sys.executable, "-m", "poslsh.experiments.train", "train", "--config-json",
                       str(d / "requested-config.json"), "--resume", "--no-progress"]
                env = {**os.environ, "OMP_NUM_THREADS": str(c.threads)}
                running.append((c, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
                tqdm.write(f"[start] {c.method} seed {c.seed}: log {d / 'train.log'}")
            time.sleep(1.0)
            for item in [r for r in running if r[1].poll() is not None]:
                c, proc, log = item
                running.remove(item)
                log.close()
                bar.update(1)
                tqdm.write(f"[{'done' if proc.returncode == 0 else 'FAILED'}] {c.method} seed {c.seed}")
                if proc.returncode:
                    failed.append(f"{c.method} seed {c.seed} (exit {proc.returncode}, see {run_dir(c) / 'train.log'})")
    except KeyboardInterrupt:
        for c, proc, log in running:
            proc.send_signal(signal.SIGINT)
        for c, proc, log in running:
            proc.wait()
        raise
    finally:
        bar.close()
    if failed:
        raise RuntimeError("runs failed: " + "; ".join(failed))


def dry_run(cfg, methods, steps: int = 3, jobs: int = 1) -> float:
    """Time a few training steps of each method on random tokens (with the threads each of
    ``jobs`` parallel runs gets); print and return the estimated wall minutes of the table."""
    from .train import build_model, estimate_minutes
    from ..integrations import hf

    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // jobs))
    spec = cfg.data.tokenizer
    vocab = int(spec[4:]) if spec.startswith("bpe:") else 49152
    total = 0.0
    for method in methods:
        run_cfg = replace(cfg, method=method)
        model = build_model(run_cfg, vocab)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.seq_len + 1))
        times = []
        for i in range(steps + 1):
            hf.set_training_step(model, i)
            t0 = time.perf_counter()
            logits = model(input_ids=x[:, :-1]).logits
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        rate = cfg.micro_batch_size * cfg.seq_len / statistics.median(times[1:])
        minutes = estimate_minutes(run_cfg, rate) * len(cfg.seeds)
        total += minutes
        print(f"{method:14s} {rate:8.0f} tokens/s  ~{minutes:6.1f} min for {len(cfg.seeds)} seed(s)")
    total /= jobs
    print(f"estimated total with {jobs} run(s) in parallel: {total:.0f} min ({total / 60:.1f} h); the timing "
          f"assumes the CPU is otherwise idle")
    return total


# ----------------------------------------------------------------------------- CLI
def apply_overrides(cfg, items):
    """``["steps=100", "model.hidden_size=256", "methods=alibi,poslsh-s5"]`` applied to ``cfg``."""
    from .train import config_from_dict, config_to_dict

    d = config_to_dict(cfg)
    for item in items or ():
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        *parents, leaf = key.strip().split(".")
        node = d
        for p in parents:
            if p not in node or not isinstance(node[p], dict):
                raise ValueError(f"unknown config key {key!r}")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"unknown config key {key!r}; known: {sorted(node)}")
        old = node[leaf]
        if isinstance(old, list):
            parts = [p for p in raw.split(",") if p != ""]
            node[leaf] = [_literal(p) for p in parts]
        elif isinstance(old, str) or old is None and not _is_number(raw):
            node[leaf] = None if raw in ("None", "none") else raw
        else:
            node[leaf] = _literal(raw)
    return config_from_dict(d)


def _is_number(s: str) -> bool:
    try:
        return float(s) is not None
    except ValueError:
        return False


def _literal(s: str):
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s




def add_config_arguments(p) -> None:
    from .train import PRESETS
    p.add_argument("--preset", default="smoke", help=f"named config: {', '.join(PRESETS)} (default smoke)")
    p.add_argument("--config-json", help="start from this config file (a run's config.json) instead of a preset")
    p.add_argument("--seed", type=int, help="training seed (data order, init, partitions)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--runs-dir", help="where runs live (default runs/)")
    p.add_argument("--cache-dir", help="token cache (default ~/.cache/poslsh or $POSLSH_CACHE)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.hidden_size=256 --set lr=1e-3")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args):
    from .train import config_from_dict, get_preset
    if getattr(args, "config_json", None):
        cfg = config_from_dict(json.loads(Path(args.config_json).read_text()))
    else:
        cfg = get_preset(args.preset)
    cfg = apply_overrides(cfg, args.set)
    for attr, key in (("seed", "seed"), ("steps", "steps"), ("runs_dir", "runs_dir"), ("cache_dir", "cache_dir"),
                      ("device", "device"), ("method", "method")):
        v = getattr(args, attr, None)
        if v is not None:
            cfg = replace(cfg, **{key: v})
    return cfg



def _cmd_eval(args) -> int:
    from .train import Dist, build_model, latest_checkpoint, load_data, run_dir
    from .train import load_checkpoint_params

    cfg = config_from_args(args)
    ckpt = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run_dir(cfg))
    if ckpt is not None and ckpt.name == "latest" and ckpt.is_file():   # the pointer file itself
        ckpt = ckpt.parent / ckpt.read_text().strip()
    elif ckpt is not None and not (ckpt / "model.safetensors").exists():  # a run directory
        ckpt = latest_checkpoint(ckpt) or ckpt
    if ckpt is None:
        raise SystemExit(f"no checkpoint under {run_dir(cfg)}: train it first (poslsh train ...)")
    if not (ckpt / "model.safetensors").exists():
        raise SystemExit(f"{ckpt} is not a checkpoint (no model.safetensors): pass a checkpoint directory, "
                         "its 'latest' pointer or a run directory")
    dist = Dist(cfg.device)
    data = load_data(cfg, dist)
    model = build_model(cfg, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
    params = load_checkpoint_params(ckpt)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in params:
                p.copy_(params[n])
    res = {"method": cfg.method, "seed": cfg.seed, "checkpoint": str(ckpt), "split": cfg.eval_split,
           "eval": evaluate(model, data.splits[cfg.eval_split], cfg, dist, progress=not args.no_progress)}
    if dist.main:
        # A checkpoint of another run evaluated as this method is filed with the checkpoint, under
        # a name that says so, never over this run's own evaluation.
        own = run_dir(cfg).resolve() in ckpt.resolve().parents
        out = (run_dir(cfg) / f"eval-{cfg.eval_split}.json" if own
               else ckpt.parent.parent / f"eval-{cfg.eval_split}-as-{cfg.method}.json")
        atomic_write_text(out, json.dumps(res, indent=1))
        for k, r in res["eval"].items():
            print(f"{k} (context {r['context']}): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%")
    return 0


def _cmd_table(args) -> int:
    cfg = config_from_args(args)
    methods = args.methods.split(",") if args.methods else list(cfg.methods)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(cfg.seeds)
    cfg = replace(cfg, methods=tuple(methods), seeds=tuple(seeds))
    if args.dry_run:
        dry_run(cfg, methods, jobs=args.jobs)
        return 0
    command = "poslsh " + shlex.join(sys.argv[1:])   # same arguments under `poslsh` and `python -m ...train`
    run_table(cfg, methods, seeds, Path(args.results_dir), progress=not args.no_progress, command=command,
              train_missing=not args.aggregate_only, jobs=args.jobs)
    if int(os.environ.get("RANK", "0")) == 0:
        print((Path(args.results_dir) / cfg.preset / "table.md").read_text())
    return 0


def register(subparsers) -> None:
    from .train import METHODS

    p = subparsers.add_parser("eval", help="evaluate a trained run (PPL / accuracy at 1x, 2x, 4x the training length)")
    add_config_arguments(p)
    p.add_argument("--method", help=f"method of the run: {', '.join(METHODS)}")
    p.add_argument("--checkpoint", help="a checkpoint directory, a run directory or its checkpoints/latest "
                   "pointer (default: this run's latest)")
    p.set_defaults(func=_cmd_eval)

    p = subparsers.add_parser("table", help="run every method x seed of a preset (resuming) and write the table")
    add_config_arguments(p)
    p.add_argument("--methods", help="comma-separated methods (default: the preset's)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the preset's)")
    p.add_argument("--results-dir", default="results", help="where table.md/csv/json go (default results/)")
    p.add_argument("--dry-run", action="store_true", help="time a few steps per method and print an estimate")
    p.add_argument("--aggregate-only", action="store_true", help="only tabulate the finished runs")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs trained in parallel, in subprocesses with cpu_count/jobs threads each (default 1)")
    p.set_defaults(func=_cmd_table)
