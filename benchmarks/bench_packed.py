"""Packed documents on the torch backend: one packed row against the same documents run one by
one, and against the same tokens as one unpacked sequence, side by side in one run.

A row of ``--total`` tokens (default 65,536) is cut into documents whose lengths follow a
log-normal law (median ``--median``, log-std ``--spread``: many short documents, a few long ones;
the last one is cut to fit). The same positional-LSH partitions (ALiBi sigmas, ``--heads`` heads,
``--samples`` samples) and the same q, k, v (float32, head dim ``--dim``, causal) run three ways:

* ``packed``: one call with ``cu_seqlens`` (positions restart in every document);
* ``alone``: every document as its own call, the times summed;
* ``unpacked``: one call over the whole row as a single sequence (attention across documents).

Rounds are interleaved (the order rotates every round) and the best round of each way is kept;
the time is CPU time of this process (``time.process_time``, one intra-op thread: on a shared
machine wall time mostly measures the other tenants; wall time is reported next to it). Also
reported: the scores each way computes (the plans' cost, machine-independent), a check that
``packed`` equals ``alone``, and the load average before and after. The run fails (exit 1) unless
packed <= 1.1x alone and packed < unpacked, forward and forward+backward.

Writes ``results/bench_packed.json`` (``--out``). Run:
``python benchmarks/bench_packed.py [--total 65536] [--rounds 7] [--no-backward]``.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import poslsh
from poslsh.documents import make_documents
from poslsh.ops.torch import ops as torch_ops, tiles as torch_tiles
from poslsh.ops.torch.plan import Layout, Span
from bench_common import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("packed", "alone", "unpacked")


def load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def document_lengths(total: int, median: float, spread: float, seed: int) -> list:
    """Log-normal lengths (at least 1) summing to ``total``; the last one is cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while used < total:
        draw = math.exp(math.log(median) + spread * float(torch.randn((), generator=g)))
        n = max(1, min(int(round(draw)), total - used))
        lengths.append(n)
        used += n
    return lengths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--total", type=int, default=65536, help="tokens in the packed row")
    ap.add_argument("--median", type=float, default=400.0, help="median document length")
    ap.add_argument("--spread", type=float, default=1.5, help="log-std of the document lengths")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-backward", dest="backward", action="store_false", help="forward only")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_packed.json"))
    args = ap.parse_args(argv)
    for name in ("total", "heads", "dim", "samples", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    out_path = Path(args.out)
    if out_path.suffix != ".json" or out_path.is_dir():
        ap.error(f"--out must name a .json file, got {args.out!r}")
    torch.set_num_threads(args.threads)
    torch_ops.SINGLE_THREAD_WHEN_BUSY = False      # the thread count is ours to set here

    lengths = document_lengths(args.total, args.median, args.spread, args.seed)
    H, n = args.heads, args.total
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), args.samples, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(1, H, n, args.dim, generator=g) for _ in range(3))
    grad = torch.randn(1, H, n, args.dim, generator=g)
    cu = torch.tensor([0] + lengths).cumsum(0)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def attend(q, k, v, **kw):
        return poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch", **kw)

    # every document alone is its own input (its gradients are its own, no full-row accumulation)
    pieces = [[x[:, :, a:b].contiguous() for x in (q, k, v)] for a, b in bounds]

    def run(way: str, backward: bool):
        if way == "alone":
            outs = [(attend(*(x.detach().requires_grad_(backward) for x in xs)), slice(a, b))
                    for xs, (a, b) in zip(pieces, bounds)]
        else:
            xs = [x.detach().requires_grad_(backward) for x in (q, k, v)]
            outs = [(attend(*xs, **({"cu_seqlens": cu} if way == "packed" else {})), slice(None))]
        if backward:
            for out, cols in outs:
                out.backward(grad[:, :, cols])
        return outs

    # the plans' cost: scores computed per way (machine-independent)
    docs = make_documents(1, n, cu_seqlens=cu)
    plan = lambda m, layout=None: torch_ops.make_plan("sequence", parts.widths, parts.offsets,  # noqa: E731
                                                       Span.self_attention(m), layout, True, "cpu").groups
    scores = {"packed": torch_tiles.score_elements(plan(n, Layout(docs.start[0], docs.end[0]))),
              "alone": sum(torch_tiles.score_elements(plan(b - a)) for a, b in bounds),
              "unpacked": torch_tiles.score_elements(plan(n))}

    with torch.no_grad():
        packed_out = run("packed", False)[0][0]
        alone_out = torch.cat([o for o, _ in run("alone", False)], 2)
    max_diff = float((packed_out - alone_out).abs().max())

    print(f"{len(lengths)} documents, {n} tokens: lengths min {min(lengths)}, median "
          f"{sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}; H={H}, d={args.dim}, s={args.samples}, causal, "
          f"float32, {args.threads} thread(s); load {load()}", flush=True)
    print("scores computed: " + ", ".join(f"{w} {scores[w]:.3e}" for w in WAYS) + f"; packed vs alone max |diff| "
          f"{max_diff:.1e}", flush=True)
    modes = [("forward", False)] + ([("forward+backward", True)] if args.backward else [])
    load_before = load()
    results = {}
    for mode, backward in modes:
        cpu = {w: [] for w in WAYS}
        wall = {w: [] for w in WAYS}
        run("packed", backward)                      # warm-up
        for r in range(args.rounds):
            for w in WAYS[r % 3:] + WAYS[:r % 3]:     # rotate the order every round
                t_wall, t_cpu = time.perf_counter(), time.process_time()
                ctx = torch.no_grad() if not backward else torch.enable_grad()
                with ctx:
                    run(w, backward)
                cpu[w].append(time.process_time() - t_cpu)
                wall[w].append(time.perf_counter() - t_wall)
            print(f"{mode} round {r + 1}: " + ", ".join(f"{w} {cpu[w][-1]:.2f} s cpu ({wall[w][-1]:.2f} s wall)"
                                                        for w in WAYS), flush=True)
        best = {w: min(cpu[w]) for w in WAYS}
        best_wall = {w: min(wall[w]) for w in WAYS}
        ratios = {"packed/alone": best["packed"] / best["alone"], "packed/unpacked": best["packed"] / best["unpacked"],
                  "wall packed/alone": best_wall["packed"] / best_wall["alone"],
                  "wall packed/unpacked": best_wall["packed"] / best_wall["unpacked"]}
        print(f"{mode}: best cpu s " + ", ".join(f"{w} {best[w]:.2f}" for w in WAYS) + "; "
              + ", ".join(f"{k} {x:.3f}" for k, x in ratios.items()), flush=True)
        results[mode] = {"best_cpu_s": best, "best_wall_s": best_wall, "cpu_s": cpu, "wall_s": wall, "ratios": ratios}
    ok = all(r["ratios"]["packed/alone"] <= 1.1 and r["ratios"]["packed/unpacked"] < 1 for r in results.values())
    record = {
        "machine": machine(), "threads": args.threads, "load_before": load_before, "load_after": load(),
        "config": {"total": n, "documents": len(lengths), "median": args.median, "spread": args.spread,
                   "heads": H, "dim": args.dim, "samples": args.samples, "causal": True, "dtype": "float32",
                   "sigmas": parts.sigma.tolist(), "seed": args.seed, "rounds": args.rounds},
        "lengths": lengths, "scores": scores, "packed_vs_alone_max_abs_diff": max_diff, "results": results,
        "packed_within_1.1x_of_alone_and_below_unpacked": ok,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, record)
    print(f"wrote {out_path}; packed <= 1.1x alone and < unpacked: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
