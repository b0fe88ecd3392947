"""The ``encoders`` stage of the first GPU run (``bash benchmarks/gpu_first_run.sh``): an ALiBi encoder loaded with
``load_alibi_encoder`` (DNABERT-2's layout and shapes: 768 wide, 12 heads, random BERT init), bf16, against
float64, and its time and peak memory against the original's padded dense path.

* **exact** and **certified** (``tol=1e-3``) on a batch of 8 rows of 96-512 tokens (padding) and on one
  4,096-token row: the last hidden states at real tokens against the float64 exact model, judged against the
  original's own bf16 dense forward's error (within 3x, plus ``tol`` for certified windows; padded
  positions exactly 0);
* **time and peak memory** of one forward at 4k and 16k: the dense baseline (``encoders_dense.dense_forward``,
  its ``[B, H, n, n]`` bias), exact and certified (CUDA events, ``max_memory_allocated`` above the inputs).

``--dry-run``: the same code on the CPU, float32, a 2-layer encoder of width 48 with 4 heads, rows of 5-97
tokens and one of 300, contexts 128 and 256. Rows go to ``<out>/results.md`` / ``results.csv``; exit status 1
when a check fails.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import torch

from gpu_common import rel_error  # noqa: E402  (puts the repository on sys.path)
from gpu_models import _attempt, run_stage, stage_arguments, timed  # noqa: E402
from gpu_rows import Recorder  # noqa: E402
from encoders_dense import dense_forward, random_state, write_checkpoint  # noqa: E402

TOL = 1e-3


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    layers: int
    intermediate: int
    vocab: int
    batch: Tuple[int, ...]
    long: int
    contexts: Tuple[int, ...]
    dtype: torch.dtype
    device: str


GPU = Shape(768, 12, 12, 3072, 4096, (512, 448, 384, 330, 270, 210, 150, 96), 4096, (4096, 16384), torch.bfloat16,
            "cuda")
DRY = Shape(48, 4, 2, 96, 97, (97, 60, 31, 5), 300, (128, 256), torch.float32, "cpu")


def _checkpoint(sh: Shape, where: Path) -> Tuple[Path, dict, dict]:
    cfg = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "alibi_starting_size": 512,
           "auto_map": {"AutoModel": "bert_layers.BertModel"}, "hidden_size": sh.hidden,
           "num_attention_heads": sh.heads, "num_hidden_layers": sh.layers, "intermediate_size": sh.intermediate,
           "vocab_size": sh.vocab, "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.1,
           "layer_norm_eps": 1e-12}
    state = random_state("mosaic", hidden=sh.hidden, heads=sh.heads, layers=sh.layers, intermediate=sh.intermediate,
                         vocab=sh.vocab, bert_init=True)
    return write_checkpoint(where, cfg, state), cfg, state


def _batch(sh: Shape, lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(5, sh.vocab, (len(lengths), n), generator=g)
    mask = (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).long()
    return (ids * mask).to(sh.device), mask.to(sh.device)


def encoders(args) -> int:
    from poslsh.integrations.hf import load_alibi_encoder

    sh = DRY if args.dry_run else GPU
    rec = Recorder(args.out, args.stage)
    rec.row("config", "info", detail=f"MosaicBERT / DNABERT-2 layout: {sh.layers} layers, width {sh.hidden}, "
            f"{sh.heads} heads, vocabulary {sh.vocab}, random BERT init; {str(sh.dtype).split('.')[-1]} on {sh.device}")
    tmp = Path(tempfile.mkdtemp(prefix="poslsh-gpu-encoders-"))
    ckpt, cfg, state = _checkpoint(sh, tmp)
    lowp = {k: v.to(sh.device, sh.dtype) for k, v in state.items()}
    f64 = load_alibi_encoder(ckpt, dtype=torch.float64, device=sh.device)
    models = {"exact": load_alibi_encoder(ckpt, dtype=sh.dtype, device=sh.device),
              "certified": load_alibi_encoder(ckpt, window="certified", tol=TOL, dtype=sh.dtype, device=sh.device)}

    def check(name, lengths):
        ids, mask = _batch(sh, lengths)
        with torch.no_grad():
            want = f64(ids, mask).last_hidden_state
            dense = dense_forward("mosaic", cfg, lowp, ids, mask)["last_hidden_state"]
            real = mask.bool()
            e_dense = rel_error(dense[real], want[real])
            for method, model in models.items():
                got = model(ids, mask).last_hidden_state
                e = rel_error(got[real], want[real])
                zero = bool((got[~real] == 0).all())
                slack = 1e-6 if method == "exact" else TOL        # certified: each query drops <= tol of its mass
                ok = e <= 3 * e_dense + slack and zero and bool(torch.isfinite(got).all())
                rec.row(f"{method} vs float64 exact, {name}", "PASS" if ok else "FAIL", e, "rel err", n=max(lengths),
                        detail=f"bound 3 x the original's own {e_dense:.2e} + {slack:g}; padded rows zero: {zero}")
    _attempt(rec, "encoder batch", lambda: check(f"{len(sh.batch)} padded rows", list(sh.batch)), max(sh.batch))
    _attempt(rec, "encoder long row", lambda: check("one row", [sh.long]), sh.long)
    del f64
    for L in sh.contexts:
        ids, mask = _batch(sh, [L], seed=L)

        def one(L=L, ids=ids, mask=mask):
            for method in ("dense", "exact", "certified"):
                fn = (lambda: dense_forward("mosaic", cfg, lowp, ids, mask)["last_hidden_state"]) if method == "dense" \
                    else (lambda m=models[method]: m(ids, mask).last_hidden_state)
                timed(fn, sh.device)                                                   # warm-up
                _, secs, peak = timed(fn, sh.device)
                rec.row(f"{method} forward time", "ok", 1e3 * secs, "ms", n=L,
                        detail=f"one row, {sh.layers} layers" + ("" if peak is None else f"; peak {peak:.0f} MiB"))
                if sh.device == "cuda":
                    torch.cuda.empty_cache()
        _attempt(rec, f"encoder times at {L}", one, L)
    return 1 if rec.failures else 0


def main(argv=None) -> int:
    args = stage_arguments(__doc__, "encoders", "CPU, float32, a tiny encoder", argv)
    return run_stage(args, "gpu_encoders", "ALiBi encoders", encoders)


if __name__ == "__main__":
    sys.exit(main())
