"""CPU benchmark: the ALiBi encoders loaded by ``load_alibi_encoder`` against the original design's own
torch path (``encoders_dense.dense_forward``: padded ``softmax(q k^T / sqrt(d) + bias) v`` with the
dense ``[B, H, n, n]`` float32 bias, the linear layers on the unpadded tokens as MosaicBERT runs them),
side by side in one run.

Model: DNABERT-2's shapes (768 wide, 12 heads of 64, GLU MLP 3072, vocabulary 4096), random BERT
initialisation, float32, forward under ``no_grad`` in eval mode, ``--layers`` of the real 12 (named
in every row; the 12-layer numbers by arithmetic: time x 12 / layers, peak + the weights of the layers
not built, since under no_grad a layer's activations are freed before the next runs).
Inputs: ``512``: a batch of 8 rows of different real lengths (512 down to 96, mean 300), right padded;
``4096``: one sequence of 4096 tokens; ``32768``: one sequence through all 12 layers (ours only: the
original would need a 51 GB bias and as many scores per layer).
Methods: ``dense`` (the baseline), ``exact`` (``load_alibi_encoder(path)``), ``certified``
(``window="certified", tol=1e-3``; the windows reported, and the largest difference of the mean-pooled
embedding from exact's) and, timed only, ``floor`` (``window=0``: each token sees itself; the model's
projections, MLP and norms with almost no attention, the floor under any attention method's time).
Time: the methods of one input timed in interleaved rounds, best kept (``bench_common.best_of_rounds``).
Peak memory: each (method, input) runs one forward in a fresh subprocess (``--worker``): after the model
and inputs are built its peak resident set is restarted (``/proc/self/clear_refs``) and the forward's
peak (``VmHWM``: interpreter, torch and weights included), the resident set before it and their difference
(``forward_gib``: what the forward itself adds; the library's process also holds transformers and triton,
imported by ``poslsh.integrations.hf``, which the baseline's does not) are reported.

Run: ``python benchmarks/bench_encoders.py [--layers 2] [--rounds 3] [--skip-32k] [--out results/encoders/bench.json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, best_of_rounds, machine, markdown_table, write_json  # noqa: E402

SHAPE = dict(hidden=768, heads=12, intermediate=3072, vocab=4096)
FULL_LAYERS = 12
BATCH_512 = [512, 448, 384, 330, 270, 210, 150, 96]
TOL = 1e-3
GIB = 2 ** 30
LAYER_BYTES = 4 * (768 * 2304 + 2304 + 768 * 768 + 768 + 4 * 768 + 6144 * 768 + 3072 * 768 + 768)


def config(layers: int) -> dict:
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "alibi_starting_size": 512,
            "auto_map": {"AutoModel": "bert_layers.BertModel"}, "hidden_size": 768, "num_attention_heads": 12,
            "num_hidden_layers": layers, "intermediate_size": 3072, "vocab_size": 4096,
            "attention_probs_dropout_prob": 0.0, "hidden_dropout_prob": 0.1, "layer_norm_eps": 1e-12}


def make_checkpoint(directory: Path, layers: int) -> Path:
    from encoders_dense import random_state, write_checkpoint
    state = random_state("mosaic", **SHAPE, layers=layers, bert_init=True)
    return write_checkpoint(directory, config(layers), state)


def inputs(name: str):
    import torch
    g = torch.Generator().manual_seed(0)
    lengths = BATCH_512 if name == "512" else [int(name)]
    n = max(lengths)
    ids = torch.randint(5, 4096, (len(lengths), n), generator=g)
    mask = (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask, lengths


def contender(method: str, ckpt: Path):
    """A ``(ids, mask) -> last_hidden_state`` callable of ``method`` on the checkpoint in ``ckpt``."""
    import torch
    if method == "dense":
        from encoders_dense import dense_forward
        from safetensors.torch import load_file
        cfg, state = json.loads((ckpt / "config.json").read_text()), load_file(str(ckpt / "model.safetensors"))
        return lambda ids, mask: dense_forward("mosaic", cfg, state, ids, mask)["last_hidden_state"]
    from poslsh.integrations.hf.encoders import load_alibi_encoder
    kwargs = {"certified": {"window": "certified", "tol": TOL}, "floor": {"window": 0}}.get(method, {})
    model = load_alibi_encoder(ckpt, **kwargs)
    fn = lambda ids, mask: model(ids, mask).last_hidden_state  # noqa: E731
    fn.model = model
    return fn


def worker(method: str, name: str, ckpt: Path) -> dict:
    """One forward in this fresh process: the peak resident set of the forward alone restarted after
    the model and inputs exist (``clear_refs``), and its wall time."""
    import torch
    fn = contender(method, ckpt)
    ids, mask, _ = inputs(name)
    status = Path("/proc/self/status")
    rss = lambda key: int(next(line.split()[1] for line in status.read_text().splitlines() if line.startswith(key))) * 1024  # noqa: E731
    before = rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(ids, mask)
    peak = rss("VmHWM")
    return {"seconds": time.perf_counter() - t0, "peak_gib": peak / GIB, "before_gib": before / GIB,
            "forward_gib": (peak - before) / GIB}


def run_worker(method: str, name: str, ckpt: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", method, name, str(ckpt)], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_by_side(name: str, ckpt: Path, rounds: int, methods) -> dict:
    import torch
    ids, mask, lengths = inputs(name)
    fns = {m: contender(m, ckpt) for m in methods}
    with torch.no_grad():
        timed = best_of_rounds({m: (lambda f=f: f(ids, mask)) for m, f in fns.items()}, rounds=rounds)
        pooled = {m: ((f(ids, mask) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)) for m, f in fns.items()}
    tokens = sum(lengths)
    row = {"input": name, "lengths": lengths, "tokens": tokens, "methods": {}}
    for m in methods:
        row["methods"][m] = {"best_s": timed[m]["best"], "median_s": timed[m]["median"],
                             "tokens_per_s": tokens / timed[m]["best"]}
    if "certified" in fns:
        stats = fns["certified"].model.attention_stats()
        row["certified_windows"] = [s["window"] for s in stats]
        row["certified_pooled_max_diff"] = float((pooled["certified"] - pooled["exact"]).abs().max())
    if "dense" in fns:
        with torch.no_grad():
            gap = (fns["exact"](ids, mask) - fns["dense"](ids, mask)) * mask[..., None]
        row["exact_vs_dense_max_diff"] = float(gap.abs().max())
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="layers built for the 512 and 4096 inputs (of 12)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-32k", action="store_true", help="leave out the 32,768-token sequence (minutes)")
    ap.add_argument("--out", default=str(ROOT / "results" / "encoders" / "bench.json"))
    ap.add_argument("--worker", nargs=3, metavar=("METHOD", "INPUT", "CKPT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], Path(args.worker[2]))))
        return
    result = {"machine": machine(), "load_before": os.getloadavg(), "layers": args.layers, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "few", args.layers)
        for name in ("512", "4096"):
            load = os.getloadavg()[0]
            row = side_by_side(name, ckpt, args.rounds, ("dense", "exact", "certified", "floor"))
            row["memory"] = {m: run_worker(m, name, ckpt) for m in ("dense", "exact", "certified")}
            row["load"] = [load, os.getloadavg()[0]]
            result["rows"].append(row)
            print(json.dumps(row)[:400], flush=True)
        if not args.skip_32k:
            full = make_checkpoint(Path(tmp) / "full", FULL_LAYERS)
            for m in ("certified", "exact"):
                load = os.getloadavg()[0]
                got = run_worker(m, "32768", full)
                result["rows"].append({"input": "32768", "layers": FULL_LAYERS, "method": m, **got,
                                       "load": [load, os.getloadavg()[0]]})
                print(result["rows"][-1], flush=True)
    result["load_after"] = os.getloadavg()
    result["layer_weights_gib"] = LAYER_BYTES / GIB
    write_json(args.out, result)
    rows = []
    for r in result["rows"]:
        if "methods" not in r:
            continue
        d = r["methods"]["dense"]["best_s"]
        for m, t in r["methods"].items():
            mem = r["memory"].get(m, {})
            rows.append((r["input"], m, f"{t['best_s']:.3f}", f"{d / t['best_s']:.2f}x", f"{t['tokens_per_s']:.0f}",
                         f"{mem.get('peak_gib', float('nan')):.2f}"))
    print(markdown_table(("input", "method", f"s ({args.layers} layers)", "vs dense", "tokens/s", "peak GiB"), rows))


if __name__ == "__main__":
    main()
