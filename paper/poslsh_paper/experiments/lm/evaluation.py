"""Perplexity and next-token accuracy at the training length and beyond.

At ``L`` (= ``seq_len``) and ``kL`` (``k`` in ``eval_multipliers``), as in the
paper's section 6.2: a window of ``kL`` tokens slides over the eval stream with
stride ``L``; the first window scores all its targets, every later one only its
last ``L`` (each with at least ``(k-1)L`` tokens of context). Every length scores
the same targets (the first ``eval_tokens`` of the split), so the columns differ
only in the context given. With ``eval_full_context`` every window scores only its last ``L``
and the targets are the ``eval_tokens`` after the longest context's first window, so each target
has at least ``(k-1)L`` tokens of context at ``kL`` (none of them a window's early tokens). The windows cross document boundaries (the stream's separators),
for every run alike, packed or not; ``poslsh eval --documents`` (``separator_id`` given) keeps the
documents of each window apart instead, as ``--pack`` trains (positions restart at every
separator, no attention across documents).

Streaming (:func:`evaluate_streaming`, ``poslsh eval --streaming``, poslsh and
fixed_blocks): the first ``eval_tokens + 1`` tokens of the split are read as one long
document, ``eval_batch_tokens`` per forward pass, through the bounded KV cache
(:mod:`poslsh.integrations.hf.cache`): every target sees its whole past, exactly as
one full-context forward would, in memory that does not grow with the length.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from poslsh_paper.data.tokens import document_positions
from poslsh_paper.experiments.lm.config import TrainConfig, method_label
from poslsh_paper.experiments.lm.model import Dist, autocast_for
from poslsh_paper.experiments.lm.bloom import eager_skip

__all__ = ["scored_tokens", "eval_windows", "eval_forward_tokens", "evaluate", "format_result",
           "position_bins", "streaming_scores", "evaluate_streaming"]


def scored_tokens(n_tokens: int, cfg: TrainConfig) -> int:
    """Targets scored at every length: ``eval_tokens`` rounded down to a multiple of
    ``seq_len``, at most what the split holds; at least one window of the longest length
    (``eval_full_context``: at least one ``seq_len``, after the longest context's first window)."""
    L, longest = cfg.seq_len, cfg.seq_len * max(cfg.eval_multipliers)
    if cfg.eval_full_context:
        T = min(cfg.eval_tokens, n_tokens - 1 - (longest - L)) // L * L
        if T < L:
            raise ValueError(f"the eval split has {n_tokens} tokens: fewer than one {longest}-token window "
                             f"(seq_len {L} x {max(cfg.eval_multipliers)}) needs; lower the multipliers")
        return T
    T = min(cfg.eval_tokens, n_tokens - 1) // L * L
    if T < longest:
        raise ValueError(f"the eval split has {n_tokens} tokens: fewer than one {longest}-token window "
                         f"(seq_len {L} x {max(cfg.eval_multipliers)}) needs; raise eval_tokens or lower the "
                         "multipliers")
    return T


def eval_windows(total: int, context: int, stride: int) -> List[int]:
    """Window starts: ``[0, stride, 2 stride, ...]`` while the window ends by target ``total``."""
    return list(range(0, total - context + 1, stride))


def full_context_windows(total: int, k: int, cfg: TrainConfig) -> List[int]:
    """``eval_full_context``: the starts of the ``k x seq_len`` windows whose last ``seq_len``
    targets are the ``total`` targets that follow the longest context's first window."""
    L, K = cfg.seq_len, max(cfg.eval_multipliers)
    return [(K - k) * L + j * L for j in range(total // L)]


def eval_forward_tokens(cfg: TrainConfig, n_tokens: Optional[int] = None) -> int:
    """Tokens run through the model by :func:`evaluate` (for time estimates)."""
    T = cfg.eval_tokens // cfg.seq_len * cfg.seq_len if n_tokens is None else scored_tokens(n_tokens, cfg)
    if cfg.eval_full_context:
        return sum(T // cfg.seq_len * k * cfg.seq_len for k in cfg.eval_multipliers)
    return sum(len(eval_windows(T, k * cfg.seq_len, cfg.seq_len)) * k * cfg.seq_len for k in cfg.eval_multipliers)


def _batches(mine: List[int], per_batch: int) -> List[List[int]]:
    """Window starts grouped into forward passes; the first window (all ``C`` targets scored)
    runs alone, the others (their last ``L``) ``per_batch`` at a time."""
    groups = [[0]] if 0 in mine else []
    rest = [b for b in mine if b != 0]
    return groups + [rest[i: i + per_batch] for i in range(0, len(rest), per_batch)]


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, cfg: TrainConfig, dist: Dist, progress: bool = False,
             separator_id: Optional[int] = None) -> Dict[str, dict]:
    """``{"1x": {"context", "ppl", "acc", "nll", "tokens", "windows", "seconds"}, "2x": ...}``;
    ``acc`` in %. Windows are split over DDP ranks and the sums all-reduced. ``separator_id``
    given: each window's documents are kept apart (packed, :func:`document_positions`)."""
    was_training = model.training
    model.eval()
    L = cfg.seq_len
    T = scored_tokens(len(tokens), cfg)
    out = {}
    for k in cfg.eval_multipliers:
        C = k * L
        full = cfg.eval_full_context
        starts = full_context_windows(T, k, cfg) if full else eval_windows(T, C, L)
        per_batch = max(1, cfg.eval_batch_tokens // C)
        skip = eager_skip(cfg, per_batch, C) if cfg.model.kind == "bloom" else None
        if skip:
            out[f"{k}x"] = {"context": C, "skipped": skip}
            if progress and dist.main:
                print(f"eval {k}x (context {C}): {skip}", file=sys.stderr)
            continue
        nll = correct = count = 0.0
        t0 = time.perf_counter()
        mine = starts[dist.rank::dist.world]
        groups = [mine[i: i + per_batch] for i in range(0, len(mine), per_batch)] if full else _batches(mine, per_batch)
        for g in groups:
            keep = C if g == [0] and not full else L
            inputs = np.stack([tokens[b: b + C] for b in g]).astype(np.int64)
            x = torch.from_numpy(inputs).to(dist.device)
            packed = {} if separator_id is None else {
                "position_ids": torch.from_numpy(document_positions(inputs, separator_id)).to(dist.device)}
            y = torch.from_numpy(np.stack([tokens[b + C - keep + 1: b + C + 1] for b in g]).astype(np.int64))
            y = y.to(dist.device).reshape(-1)
            with autocast_for(cfg, dist.device):
                logits = model(input_ids=x, use_cache=False, logits_to_keep=keep, **packed).logits
            logits = logits.float().reshape(-1, logits.shape[-1])
            nll += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += float((logits.argmax(-1) == y).sum())
            count += y.numel()
        nll, correct, count = dist.sum([nll, correct, count])
        r = out[f"{k}x"] = {"context": C, "ppl": math.exp(nll / count), "acc": 100.0 * correct / count,
                            "nll": nll / count, "tokens": int(count), "windows": len(starts),
                            "seconds": round(time.perf_counter() - t0, 1)}
        if progress and dist.main:
            print(f"eval {k}x (context {C}): ppl {r['ppl']:.3f} acc {r['acc']:.2f}% "
                  f"({r['tokens']} tokens, {r['seconds']}s)", file=sys.stderr)
    model.train(was_training)
    return out


def format_result(result: dict) -> str:
    """A run's ``result.json`` as a few lines for the terminal."""
    lines = [f"{method_label(result['method'])}, seed {result['seed']}: final train loss "
             f"{result['final_train_loss']}, {result['train_tokens_per_s']} tokens/s"]
    for k, r in (result.get("eval") or {}).items():
        if "skipped" in r:
            lines.append(f"  {k} (context {r['context']}): {r['skipped']}")
            continue
        lines.append(f"  {k} (context {r['context']}): ppl {r['ppl']:.3f}  acc {r['acc']:.2f}%")
    return "\n".join(lines)


def position_bins(total: int, first: int) -> List[int]:
    """Bin edges ``[0, first, 2 first, 4 first, ..., total]`` for PPL vs position."""
    edges, e = [0], max(1, first)
    while e < total:
        edges.append(e)
        e *= 2
    return edges + [total]


@torch.no_grad()
def streaming_scores(model, tokens: np.ndarray, chunk: int, device, cfg: Optional[TrainConfig] = None,
                     on_chunk=None):
    """Next-token NLL (float64 ``[T]``) and hits (bool ``[T]``) of ``tokens[1:T+1]`` given all
    earlier tokens, ``chunk`` tokens per forward through a bounded cache; returns them and the cache."""
    from poslsh.integrations import hf

    T = len(tokens) - 1
    cache = hf.generation_cache(model)
    nll, hit = np.empty(T), np.empty(T, dtype=bool)
    for lo in range(0, T, chunk):
        hi = min(lo + chunk, T)
        x = torch.from_numpy(np.asarray(tokens[lo:hi], dtype=np.int64))[None].to(device)
        y = torch.from_numpy(np.asarray(tokens[lo + 1:hi + 1], dtype=np.int64)).to(device)
        with autocast_for(cfg, device) if cfg is not None else torch.autocast(device.type, enabled=False):
            logits = model(input_ids=x, cache=cache, use_cache=True).logits[0]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        nll[lo:hi] = F.cross_entropy(logits, y, reduction="none").double().cpu().numpy()
        hit[lo:hi] = (logits.argmax(-1) == y).cpu().numpy()
        if on_chunk is not None:
            on_chunk(hi, nll[:hi])
    return nll, hit, cache


def evaluate_streaming(model, tokens: np.ndarray, cfg: TrainConfig, dist: Dist, progress: bool = False) -> dict:
    """``{"tokens", "chunk", "ppl", "acc", "nll", "seconds", "tokens_per_s", "cache", "by_position": [...]}``:
    perplexity of the first ``eval_tokens`` targets of the split read as one document, and per
    position bin (:func:`position_bins` from ``seq_len``)."""
    was_training = model.training
    model.eval()
    T = min(cfg.eval_tokens, len(tokens) - 1)
    if T < 1:
        raise ValueError(f"the eval split has {len(tokens)} tokens: nothing to score")
    t0 = time.perf_counter()

    def report(done, nll):
        if progress and dist.main:
            print(f"streaming: {done}/{T} tokens, ppl so far {math.exp(nll.mean()):.3f} "
                  f"({done / (time.perf_counter() - t0):.0f} tokens/s)", file=sys.stderr)

    nll, hit, cache = streaming_scores(model, tokens[:T + 1], cfg.eval_batch_tokens, dist.device, cfg, report)
    seconds = time.perf_counter() - t0
    edges = position_bins(T, cfg.seq_len)
    bins = [{"from": a, "to": b, "tokens": b - a, "ppl": math.exp(nll[a:b].mean()), "acc": 100.0 * hit[a:b].mean()}
            for a, b in zip(edges[:-1], edges[1:])]
    st = cache.stats()
    model.train(was_training)
    return {"tokens": T, "chunk": cfg.eval_batch_tokens, "ppl": math.exp(nll.mean()), "acc": 100.0 * hit.mean(),
            "nll": float(nll.mean()), "seconds": round(seconds, 1), "tokens_per_s": round(T / seconds, 1),
            "cache": {"kept_max": max(x["kept"] for x in st), "peak_max": max(x["peak"] for x in st),
                      "bound_max": max(x["bound"] or 0 for x in st), "mib": round(cache.nbytes() / 2**20, 3)},
            "by_position": bins}
