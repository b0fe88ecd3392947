"""CPU benchmark: unmodified transformers BLOOM and MPT, eager against ``patch_alibi`` (exact ALiBi and
the certified window), forward of the base model, side by side in one run.

Models (random init, float32, batch 1, ``use_cache=False``, no grad, ``eval()``; the same weights
in every contender and every process, ``torch.manual_seed(0)`` before building):

* ``bloom``: BLOOM-560m's shapes (``BloomModel``: 1024 wide, 16 heads of 64, MLP 4096) with the
  vocabulary shrunk from 250,880 to ``--vocab`` (the embedding is looked up, not multiplied: a
  1 GiB table would only add resident memory) and fewer than 24 layers where a row would take too
  long (``--bloom-layers``; every row says its layers). The 32k rows give the peak of 24 layers by
  arithmetic too: the measured peak plus the weights of the layers not built (under ``no_grad`` a
  layer's activations are freed before the next runs, so layers add only weights; the
  ``--check-layers`` row measures one more layer to show it).
* ``mpt``: MPT-7B's attention shapes (``MptModel``: 4096 wide, 32 heads of 128, MLP 16384) in
  ``--mpt-layers`` layers, the vocabulary shrunk likewise; ``max_seq_len`` 4096 where eager runs
  (MPT refuses longer inputs) and MPT-7B's own 2048 at 16k (the patched model runs past it).

Methods: ``eager`` (transformers as it is: BLOOM's ``baddbmm`` and MPT's ``matmul`` of every
``n x n`` score), ``exact`` (``patch_alibi(model)``: exact ALiBi through the window op) and
``certified`` (``patch_alibi(model, window="certified", tol=1e-3)``: per call and head the
smallest window whose bound on the dropped softmax mass is ``<= tol``; the windows chosen are
reported). Part ``floor`` times eager against ``patch_alibi(model, window=0)`` (each query sees its
own key only) at the second BLOOM size: the model's own projections, MLP and norms with almost no
attention, the floor under any attention method's time there. Time: the methods of one size timed in interleaved rounds, the best kept
(:func:`bench_common.best_of_rounds`), in this process; the load before and after each size.
Peak memory: each (method, size) runs one forward in a fresh subprocess (this script with
``--worker``): after the model is built its peak resident set is restarted (``/proc/self/clear_refs``),
and the peak of the forward (``VmHWM``: the interpreter, torch, transformers and the weights
included) and the resident set before it are reported (building the model peaks higher than a
short forward; that peak, ``ru_maxrss``, is kept as ``process_peak_gib``); the
32k and MPT 16k rows are timed by that one forward only. Where eager cannot run (its score
tensors exceed the machine), what it would need is given by arithmetic: BLOOM holds three
``[H, n, n]`` float32 tensors at once (scores, scores plus mask, probabilities) and the float causal
mask ``[n, n]``; MPT two (the masked scores and the probabilities) and a boolean mask.

Run: ``python benchmarks/bench_alibi_models.py [--part bloom|bloom32k|mpt|all] [--quick]
[--out results/alibi-models/bench.json]``. Each part writes its rows into the output file and keeps
the other parts' rows.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, best_of_rounds, machine, markdown_table, peak_rss_gib, write_json  # noqa: E402

TOL = 1e-3
METHODS = ("eager", "exact", "certified")
EXTRA_METHODS = ("floor",)
SHAPES = {   # family: (width, heads, layers of the real model)
    "bloom": (1024, 16, 24),
    "mpt": (4096, 32, 32),
}
GIB = 2 ** 30


def build(family: str, layers: int, vocab: int, max_seq_len: int = 4096):
    """The base model of ``family`` with its real shapes but ``layers`` layers and ``vocab`` tokens."""
    import torch
    from transformers import BloomConfig, BloomModel, MptConfig, MptModel

    torch.manual_seed(0)
    if family == "bloom":
        cfg = BloomConfig(vocab_size=vocab, hidden_size=1024, n_layer=layers, n_head=16, use_cache=False)
        return BloomModel(cfg).eval()
    cfg = MptConfig(d_model=4096, n_heads=32, n_layers=layers, expansion_ratio=4, max_seq_len=max_seq_len,
                    vocab_size=vocab, use_cache=False)
    return MptModel(cfg).eval()


def prepare(model, method: str):
    from poslsh.integrations.hf import patch_alibi

    if method == "eager":
        return model
    if method == "exact":
        return patch_alibi(model)
    if method == "certified":
        return patch_alibi(model, window="certified", tol=TOL)
    if method == "floor":
        return patch_alibi(model, window=0)
    raise ValueError(f"method must be one of {METHODS + EXTRA_METHODS}, got {method!r}")


def inputs(n: int, vocab: int):
    import torch

    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(1))


def forward(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).last_hidden_state


def windows(model, method: str):
    """The certified windows of the last call (layer 0 and the mean over layers), else None."""
    if method != "certified":
        return None
    from poslsh.integrations.hf import alibi_stats

    st = alibi_stats(model)
    per = [s["window"] for s in st]
    return {"layer0": per[0], "mean_keys_per_head": sum(map(sum, per)) / (len(per) * len(per[0])),
            "logit_range_layer0": [round(r, 2) for r in st[0]["logit_range"]]}


def layer_weight_bytes(family: str) -> int:
    """Bytes of one layer's float32 weights (from a one-layer model's parameters)."""
    m = build(family, 1, 8)
    blocks = m.h if family == "bloom" else m.blocks
    return sum(p.numel() * p.element_size() for p in blocks[0].parameters())


def eager_needs_gib(family: str, n: int) -> float:
    """The ``n x n`` tensors eager attention holds at once, by arithmetic (one layer, batch 1)."""
    H = SHAPES[family][1]
    if family == "bloom":
        return (3 * H * n * n * 4 + n * n * 4) / GIB
    return (2 * H * n * n * 4 + n * n) / GIB


# ---------------------------------------------------------------------------------------------- worker

def _status_gib(key: str) -> float:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(key + ":")) / 2 ** 20


def worker(spec: dict) -> dict:
    """One forward of one (family, method, n, layers) in this fresh process: its time and memory."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    model = prepare(build(spec["family"], spec["layers"], spec["vocab"], spec["max_seq_len"]), spec["method"])
    ids = inputs(spec["n"], spec["vocab"])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")         # the peak resident set restarts from here
    rss = _status_gib("VmRSS")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = forward(model, ids)
    seconds = time.perf_counter() - t0
    return {"peak_rss_gib": _status_gib("VmHWM"), "rss_before_gib": rss, "process_peak_gib": peak_rss_gib(),
            "seconds": seconds, "load": load,
            "finite": bool(torch.isfinite(out).all()), "windows": windows(model, spec["method"])}


def run_worker(spec: dict) -> dict:
    """:func:`worker` in a fresh subprocess (the library from this process's ``sys.path``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                         env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode or not lines:
        raise RuntimeError(f"worker {spec} failed (rc {res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------- rows

def timed_size(family: str, n: int, layers: int, args, methods=METHODS, max_seq_len: int = 4096,
               rounds: int = 0) -> list:
    """The methods at ``n``: interleaved timing here, peak memory in fresh processes."""
    import torch

    load0 = os.getloadavg()[0]
    models = {m: prepare(build(family, layers, args.vocab, max_seq_len), m) for m in methods}
    ids = inputs(n, args.vocab)
    outs = {m: forward(models[m], ids) for m in methods}          # also the warm-up call
    diff = {m: float((outs[m] - outs["eager"]).abs().max()) for m in methods if "eager" in outs and m != "eager"}
    del outs
    rounds = rounds or args.rounds
    t = best_of_rounds({m: (lambda m=m: forward(models[m], ids)) for m in methods}, rounds=rounds, warmup=0)
    wins = {m: windows(models[m], m) for m in methods}
    del models
    load1 = os.getloadavg()[0]
    rows = []
    for m in methods:
        mem = (run_worker(dict(family=family, method=m, n=n, layers=layers, vocab=args.vocab, max_seq_len=max_seq_len,
                               threads=args.threads)) if not args.no_memory else {})
        rows.append(dict(family=family, n=n, layers=layers, method=m, seconds=t[m]["best"], median=t[m]["median"],
                         rounds=rounds, timed="best of interleaved rounds", load_before=load0, load_after=load1,
                         threads=torch.get_num_threads(), max_abs_diff_to_eager=diff.get(m),
                         peak_rss_gib=mem.get("peak_rss_gib"), rss_before_gib=mem.get("rss_before_gib"),
                         windows=wins[m] or mem.get("windows"), eager_tensors_gib=eager_needs_gib(family, n)))
        print(f"  {family} n={n} L={layers} {m}: {t[m]['best']:.2f} s, peak {mem.get('peak_rss_gib', float('nan')):.2f}"
              f" GiB (load {load0:.1f} -> {load1:.1f})", flush=True)
    return rows


def single_run(family: str, n: int, layers: int, method: str, args, max_seq_len: int = 4096) -> dict:
    """One forward in a fresh process: its time and peak (rows too long to repeat)."""
    import torch

    r = run_worker(dict(family=family, method=method, n=n, layers=layers, vocab=args.vocab, max_seq_len=max_seq_len,
                        threads=args.threads))
    print(f"  {family} n={n} L={layers} {method}: {r['seconds']:.1f} s, peak {r['peak_rss_gib']:.2f} GiB "
          f"(load {r['load']:.1f})", flush=True)
    return dict(family=family, n=n, layers=layers, method=method, seconds=r["seconds"], median=None, rounds=1,
                timed="one forward in a fresh process", load_before=r["load"], load_after=os.getloadavg()[0],
                threads=args.threads or torch.get_num_threads(), max_abs_diff_to_eager=None,
                peak_rss_gib=r["peak_rss_gib"], rss_before_gib=r["rss_before_gib"], windows=r["windows"],
                finite=r["finite"], eager_tensors_gib=eager_needs_gib(family, n), max_seq_len=max_seq_len)


def part_bloom(args) -> list:
    rows = []
    for spec in args.bloom_layers:
        n, layers = map(int, spec.split(":"))
        rows += timed_size("bloom", n, layers, args)
    return rows


def part_bloom32k(args) -> list:
    n, L = args.long_n, args.long_layers
    per_layer = layer_weight_bytes("bloom") / GIB
    rows = [single_run("bloom", n, L, m, args) for m in ("exact", "certified")]
    if args.check_layers:
        rows.append(single_run("bloom", n, L + 1, "certified", args))
    for r in rows:
        r["peak_24_layers_gib"] = r["peak_rss_gib"] + (SHAPES["bloom"][2] - r["layers"]) * per_layer
        r["layer_weights_gib"] = per_layer
    return rows


def part_mpt(args) -> list:
    rows = timed_size("mpt", args.mpt_n, args.mpt_layers, args, max_seq_len=max(args.mpt_n, 2048),
                      rounds=args.mpt_rounds)
    for m in args.mpt_long_methods:
        rows.append(single_run("mpt", args.mpt_long_n, args.mpt_layers, m, args, max_seq_len=2048))
    return rows


def part_bloom32k_24(args) -> list:
    """The certified window at 32k with all 24 layers of BLOOM-560m: the peak measured, not added up."""
    r = single_run("bloom", args.long_n, SHAPES["bloom"][2], "certified", args)
    r["peak_24_layers_gib"] = r["peak_rss_gib"]
    return [r]


def part_floor(args) -> list:
    n, layers = map(int, args.bloom_layers[min(1, len(args.bloom_layers) - 1)].split(":"))
    return timed_size("bloom", n, layers, args, methods=("eager", "floor"))


PARTS = {"bloom": part_bloom, "bloom32k": part_bloom32k, "mpt": part_mpt, "floor": part_floor,
         "bloom32k-24": part_bloom32k_24}


def table(rows: list) -> str:
    eager = {(r["family"], r["n"], r["layers"]): r for r in rows if r["method"] == "eager"}
    out = []
    for r in rows:
        e = eager.get((r["family"], r["n"], r["layers"]))
        speed = f"{e['seconds'] / r['seconds']:.2f}x" if e and r["method"] != "eager" else "—"
        mem = (f"{r['peak_rss_gib'] / e['peak_rss_gib']:.2f}" if e and r["method"] != "eager" and r["peak_rss_gib"]
               and e["peak_rss_gib"] else "—")
        w = r.get("windows")
        if r["method"] == "floor":
            w = None
        out.append([r["family"], f"{r['n']:,}", r["layers"], r["method"], f"{r['seconds']:.2f}", speed,
                    f"{r['peak_rss_gib']:.2f}" if r["peak_rss_gib"] else "—", mem,
                    f"{r['eager_tensors_gib']:.1f}", f"{w['mean_keys_per_head']:.0f}" if w else "—",
                    f"{r['load_before']:.1f} → {r['load_after']:.1f}"])
    return markdown_table(["model", "n", "layers", "method", "s", "eager / this", "peak GiB", "peak / eager's",
                           "eager n x n GiB", "mean window", "load"], out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=[*PARTS, "all"], default="all",
                   help="all: every part but bloom32k-24 (24 layers at 32k: half an hour here)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round: checks the script runs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary of the shrunk models")
    p.add_argument("--bloom-layers", nargs="+", default=["2048:2", "4096:2", "8192:1"],
                   help="BLOOM sizes and their layers, n:layers")
    p.add_argument("--long-n", type=int, default=32768)
    p.add_argument("--long-layers", type=int, default=1, help="layers of the 32k BLOOM rows")
    p.add_argument("--check-layers", action="store_true", help="also the 32k certified row with one more layer")
    p.add_argument("--mpt-layers", type=int, default=1)
    p.add_argument("--mpt-rounds", type=int, default=1, help="timed rounds at --mpt-n (after one warm-up)")
    p.add_argument("--mpt-n", type=int, default=4096, help="MPT size where eager runs too")
    p.add_argument("--mpt-long-n", type=int, default=16384)
    p.add_argument("--mpt-long-methods", nargs="*", default=["certified"])
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "alibi-models" / "bench.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.bloom_layers, args.long_n, args.mpt_n, args.mpt_long_n = 1, ["256:1"], 512, 128, 2304
        args.mpt_long_methods = ["certified"]
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"parts": {}}
    for name in ([p for p in PARTS if p != "bloom32k-24"] if args.part == "all" else [args.part]):
        start, m0 = time.time(), machine()
        print(f"{name}: {m0}", flush=True)
        rows = PARTS[name](args)
        data["parts"][name] = {"machine": m0, "machine_after": machine(), "wall_s": time.time() - start,
                               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
                               "args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows}
        write_json(out, data)
        print(table(rows), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
