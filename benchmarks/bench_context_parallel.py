"""Context parallelism: bytes communicated per attention layer per training step by the halo
exchange of :mod:`poslsh.distributed` against ring attention (what exact ALiBi needs).

Measured (gloo on this machine, ``P`` = 2 and 4 spawned processes on 127.0.0.1): one sequence
(``B = 1``) of ``n`` tokens split into even contiguous shards; every rank runs
:func:`poslsh.distributed.context_parallel_attention` forward and backward and counts what its
exchanges received (:data:`poslsh.distributed.comm_stats`: the halo's K|V in forward, the
gradients of the rows it served in backward). The ring baseline moves the K|V shards around
the same gloo ring, communication only: ``P - 1`` hops in forward, ``P - 1`` hops of K|V and
``P - 1`` of dK|dV in backward (a lower bound for ring attention: the dK|dV accumulators must
also get home).

Computed (no processes): the same bytes from the partitions alone (exact halos from
:func:`poslsh.distributed.key_ranges`) for ``P`` up to 1024 and ``n`` up to 16M, for a
larger model (32 query / 8 key-value heads, d = 128, bf16); the measured rows check the
model. The same for the ALiBi window (:class:`poslsh.AlibiWindow`, halo ``max_h w_h``). K/V rows held per rank: ``n / P + halo`` (halo scheme) vs ``2 n / P`` (ring: own
shard and one in flight).

Prints markdown tables, writes ``outputs/bench_context_parallel.json`` atomically (the committed
``results/bench_context_parallel.json`` is refreshed only with ``--out results/bench_context_parallel.json``).
Run: ``python benchmarks/bench_context_parallel.py [--quick] [--no-measure]``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import poslsh
from poslsh.window import make_window
from poslsh.distributed import (comm_stats, context_parallel_attention, gather_layout, halo_exchange, key_ranges,
                                shard_range)
from bench_common import machine, markdown_table, write_json

S = 10                                                      # samples per head
SMALL = dict(Hq=8, Hkv=2, d=64, dtype=torch.float32)        # measured on gloo (CPU)
LARGE = dict(Hq=32, Hkv=8, d=128, dtype=torch.bfloat16)     # cost model
WINDOWS = (1024, 8192)                                      # max_h w_h of the window cost model


def row_bytes(cfg) -> int:
    """Bytes of one token's K|V (all key/value heads)."""
    return cfg["Hkv"] * 2 * cfg["d"] * torch.empty((), dtype=cfg["dtype"]).element_size()


def partitions(cfg, seed=0):
    return poslsh.sample_partitions(poslsh.alibi_sigmas(cfg["Hq"]), S, seed=seed)


# --------------------------------------------------------------- cost model
def model_bytes(cfg, n: int, P: int, causal: bool = True, seed: int = 0, positional=None) -> dict:
    """Per rank and layer and step: bytes received by the halo scheme (mean and max over
    ranks), by ring attention (lower bound), and the K/V rows each holds. ``positional``:
    partitions or an ALiBi window (default: the partitions of ``seed``)."""
    shards = [shard_range(n, r, P) for r in range(P)]
    starts, lengths = [a for a, _ in shards], [b - a for a, b in shards]
    positional = partitions(cfg, seed) if positional is None else positional
    lo, hi = key_ranges(positional, n, starts, lengths, causal)
    halo = [(a - l) + (h - (a + m)) for a, m, l, h in zip(starts, lengths, lo, hi)]
    served = [sum(max(0, min(a + m, hi[j]) - max(a, lo[j])) for j in range(P) if j != r)
              for r, (a, m) in enumerate(zip(starts, lengths))]
    received = [(h + s) * row_bytes(cfg) for h, s in zip(halo, served)]   # forward halo + backward grads
    ring = 3 * (P - 1) * (n // P) * row_bytes(cfg)
    return dict(n=n, P=P, causal=causal, halo_mean=statistics.mean(halo), halo_max=max(halo),
                halo_bytes_mean=statistics.mean(received), halo_bytes_max=max(received), ring_bytes=ring,
                rows_held_halo=max(m + h for m, h in zip(lengths, halo)), rows_held_ring=2 * max(lengths))


# ------------------------------------------------------------------ measured
def _ring(kv: torch.Tensor, hops: int) -> int:
    """Rotate ``kv`` ``hops`` times around the ring; returns the bytes received."""
    rank, P = dist.get_rank(), dist.get_world_size()
    got = 0
    for _ in range(hops):
        nxt = torch.empty_like(kv)
        ops = [dist.P2POp(dist.isend, kv, (rank + 1) % P), dist.P2POp(dist.irecv, nxt, (rank - 1) % P)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        kv, got = nxt, got + nxt.numel() * nxt.element_size()
    return got


def _rank(rank, P, port, n, repeats, outdir):
    torch.set_num_threads(1)          # P ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P)
    cfg = SMALL
    a, b = shard_range(n, rank, P)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, cfg["Hq"], b - a, cfg["d"], generator=g, requires_grad=True)
    k, v = (torch.randn(1, cfg["Hkv"], b - a, cfg["d"], generator=g, requires_grad=True) for _ in range(2))
    parts = partitions(cfg)

    def step():
        context_parallel_attention(q, k, v, parts, causal=True, shard_start=a, backend="torch").sum().backward()

    step()                            # warm-up (first call loads torch's op machinery)
    rows = []
    for _ in range(repeats):
        comm_stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        total = time.perf_counter() - t0
        received, sent = comm_stats.received_bytes, comm_stats.sent_bytes
        # Communication alone, every rank starting together (inside a step a rank also waits
        # for its peers' compute): metadata all_gather + halo exchange + its backward.
        dist.barrier()
        t1 = time.perf_counter()
        layout = gather_layout(q, k, v, parts, causal=True, shard_start=a)
        k_loc, v_loc = halo_exchange(k, v, layout)
        torch.autograd.grad((k_loc.sum() + v_loc.sum()), (k, v))
        halo_s = time.perf_counter() - t1
        kv = torch.cat([k, v], -1).detach().contiguous()
        dist.barrier()
        t1 = time.perf_counter()
        ring = _ring(kv, P - 1) + _ring(kv, P - 1) + _ring(kv, P - 1)
        rows.append(dict(halo_bytes=received, halo_sent=sent, halo_comm_s=halo_s, step_s=total, ring_bytes=ring,
                         ring_comm_s=time.perf_counter() - t1))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:      # numbers only: JSON, no pickles
        json.dump(rows, f)
    dist.destroy_process_group()


def measure(n: int, P: int, repeats: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_rank, args=(P, port, n, repeats, outdir), nprocs=P, join=True)
        ranks = []
        for r in range(P):
            with open(os.path.join(outdir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    med = lambda key: statistics.median(max(r[i][key] for r in ranks) for i in range(repeats))  # noqa: E731
    byts = [r[0]["halo_bytes"] for r in ranks]
    return dict(n=n, P=P, halo_bytes_mean=statistics.mean(byts), halo_bytes_max=max(byts),
                ring_bytes=ranks[0][0]["ring_bytes"], halo_comm_s=med("halo_comm_s"), ring_comm_s=med("ring_comm_s"),
                step_s=med("step_s"))


# ---------------------------------------------------------------------- main
def mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="n = 16384 only, one repeat")
    ap.add_argument("--no-measure", action="store_true", help="cost model only (no processes)")
    ap.add_argument("--out", default="outputs/bench_context_parallel.json")
    args = ap.parse_args()
    out = {"machine": f"{machine()}, gloo",
           "small": {k: str(v) for k, v in SMALL.items()}, "large": {k: str(v) for k, v in LARGE.items()},
           "samples": S, "measured": [], "model": []}
    if not args.no_measure:
        rows = []
        for n in ((16384,) if args.quick else (16384, 65536)):
            for P in (2, 4):
                m = measure(n, P, 1 if args.quick else 3)
                c = model_bytes(SMALL, n, P)
                out["measured"].append({**m, "model_halo_bytes_mean": c["halo_bytes_mean"]})
                rows.append([f"{n:,}", P, mib(m["halo_bytes_mean"]), mib(c["halo_bytes_mean"]), mib(m["ring_bytes"]),
                             f"{m['ring_bytes'] / m['halo_bytes_mean']:.0f}x", f"{1e3 * m['halo_comm_s']:.1f}",
                             f"{1e3 * m['ring_comm_s']:.1f}", f"{1e3 * m['step_s']:.0f}"])
                print(f"measured n={n} P={P}: {rows[-1]}", flush=True)
        print("\nMeasured on gloo, per rank per layer per step (fwd + bwd), "
              f"Hq={SMALL['Hq']}, Hkv={SMALL['Hkv']}, d={SMALL['d']}, float32, s={S}, causal, B=1:\n")
        print(markdown_table(["n", "P", "halo MiB (measured)", "halo MiB (model)", "ring MiB (measured)",
                              "ring / halo", "halo comm ms", "ring comm ms", "poslsh step ms"], rows))
    rows = []
    for n in (1 << 16, 1 << 20, 1 << 24):
        for P in (2, 8, 64, 256, 1024):
            for causal in (True, False):
                c = model_bytes(LARGE, n, P, causal)
                out["model"].append(c)
                rows.append([f"{n:,}", P, "causal" if causal else "bidirectional", f"{c['halo_max']:,}",
                             mib(c["halo_bytes_max"]), mib(c["ring_bytes"]),
                             f"{c['ring_bytes'] / max(c['halo_bytes_max'], 1):,.0f}x",
                             f"{c['rows_held_halo']:,}", f"{c['rows_held_ring']:,}"])
    print(f"\nCost model, per rank per layer per step (fwd + bwd), Hq={LARGE['Hq']}, Hkv={LARGE['Hkv']}, "
          f"d={LARGE['d']}, bf16, s={S}, ALiBi sigmas up to {float(poslsh.alibi_sigmas(LARGE['Hq']).max()):.0f}, "
          "B=1 (worst rank):\n")
    print(markdown_table(["n", "P", "mask", "halo tokens", "halo MiB", "ring MiB", "ring / halo",
                          "K/V rows held (halo)", "K/V rows held (ring)"], rows))
    # The ALiBi window (exact ALiBi cut at per-head windows): a halo of W = max_h w_h on each side
    rows, out["window_model"] = [], []
    for W in WINDOWS:
        win = make_window(poslsh.alibi_slopes(LARGE["Hq"]), W)
        for n in (1 << 20, 1 << 24):
            for P in (8, 1024):
                c = dict(model_bytes(LARGE, n, P, True, positional=win), window=W)
                out["window_model"].append(c)
                rows.append([f"{W:,}", f"{n:,}", P, f"{c['halo_max']:,}", mib(c["halo_bytes_max"]),
                             mib(c["ring_bytes"]), f"{c['ring_bytes'] / max(c['halo_bytes_max'], 1):,.0f}x"])
    print("\nCost model of the ALiBi window (causal, the same model), per rank per layer per step, worst rank:\n")
    print(markdown_table(["window W", "n", "P", "halo tokens", "halo MiB", "ring MiB", "ring / halo"], rows))
    write_json(args.out, out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
