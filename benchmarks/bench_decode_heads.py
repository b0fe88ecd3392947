"""Per-head window cache vs one shared window vs a full cache: bytes held and per-token time, side by side.

Attention shapes of BLOOM-560m (16 heads x 64) and MPT-7B (32 heads x 128), standard ALiBi slopes, 2 layers,
batch 1, float32. The windows are the library's bound at ``--tol`` for an assumed ``--logit-range``
(``poslsh.theory.smallest_window``; ~38 sigma_h at the defaults). Three caches of the same stream:

* ``per-head``: ``KVWindow`` storing each KV head's own window (``poslsh.decoding.HeadWindows``: rings of
  ``w_h + 1`` rows, steps attended in place by head buckets);
* ``shared``: ``KVWindow(per_head=False)``, one ``[B, H, max_h w_h, d]`` tensor for every head (the cache
  before per-head storage: each step appends with ``torch.cat`` and calls the window op);
* ``full``: every key (exact ALiBi, ``NO_WINDOW``), shared storage.

Each cache is filled with random keys (a step costs the same whatever the values) at each context, then
timed over decoding steps (one token, both layers) in interleaved rounds (``bench_common.best_of_rounds``;
the best round per cache). A full cache above ``--full-max-gib`` is skipped and its size stated. Writes
``results/bench_decode_heads.json`` (``--out``). Run: ``python benchmarks/bench_decode_heads.py [--quick]``.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from bench_common import ROOT, best_of_rounds, machine, markdown_table, write_json

SHAPES = {"bloom-560m": (16, 64), "mpt-7b": (32, 128)}
LAYERS = 2


def windows(H: int, tol: float, R: float):
    import poslsh
    from poslsh.theory import smallest_window
    from poslsh.window import make_window

    slopes = poslsh.alibi_slopes(H)
    return make_window(slopes, smallest_window(tol, 1 / slopes, R))


def build(kind: str, win, ctx: int, d: int, g: torch.Generator):
    """Two layers' caches holding ``ctx`` tokens (random keys)."""
    from poslsh.decoding import KVWindow
    from poslsh.window import make_window
    from poslsh.window.kind import NO_WINDOW

    H = win.num_heads
    positional = make_window(win.slopes, NO_WINDOW) if kind == "full" else win
    keep = ctx if kind == "full" else min(ctx, int(win.window.max()) + 1)
    caches = []
    for _ in range(LAYERS):
        k = torch.randn(1, H, keep, d, generator=g)
        v = torch.randn(1, H, keep, d, generator=g)
        caches.append(KVWindow.from_prefill(positional, k, v, start=ctx - keep, per_head=kind == "per-head"))
        del k, v
    return caches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tol", type=float, default=1e-3, help="tolerance of the windows' bound")
    ap.add_argument("--logit-range", type=float, default=31.0, help="assumed logit range R of the bound")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best is kept)")
    ap.add_argument("--steps", type=int, default=6, help="decoding steps per timed call (per-head; others 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--full-max-gib", type=float, default=2.5, help="skip full caches larger than this")
    ap.add_argument("--quick", action="store_true", help="contexts 1k and 8k, 2 rounds")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_decode_heads.json"))
    a = ap.parse_args()
    contexts, rounds = ([1024, 8192], 2) if a.quick else (a.contexts, a.rounds)
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    print(f"machine: {machine()}; {a.threads} thread(s), {LAYERS} layers, float32, batch 1", flush=True)
    rows = []
    for shape in a.shapes:
        H, d = SHAPES[shape]
        win = windows(H, a.tol, a.logit_range)
        w = win.window.tolist()
        print(f"{shape}: {H} heads x {d}, windows {w[0]} .. {w[-1]} (sum of w_h + 1: {sum(x + 1 for x in w)}, "
              f"shared {H * max(w)})", flush=True)
        for ctx in contexts:
            g = torch.Generator().manual_seed(ctx)
            full_gib = LAYERS * 2 * H * ctx * d * 4 / 2**30
            kinds = ["per-head", "shared"] + (["full"] if full_gib <= a.full_max_gib else [])
            caches = {kind: build(kind, win, ctx, d, g) for kind in kinds}
            steps = {kind: a.steps if kind == "per-head" else 2 for kind in kinds}
            qkv = [[torch.randn(1, H, 1, d, generator=g) for _ in range(3)] for _ in range(LAYERS)]

            def run(kind):
                def go():
                    with torch.no_grad():
                        for _ in range(steps[kind]):
                            for cache, (q, k, v) in zip(caches[kind], qkv):
                                cache.step(q, k, v)
                return go
            times = best_of_rounds({kind: run(kind) for kind in kinds}, rounds=rounds, warmup=1)
            row = {"shape": shape, "heads": H, "head_dim": d, "context": ctx, "load": machine().split("load ")[1]
                   .split(",")[0]}
            for kind in kinds:
                cs = caches[kind]
                row[kind] = {"ms_per_token": 1e3 * times[kind]["best"] / steps[kind],
                             "ms_median": 1e3 * times[kind]["median"] / steps[kind],
                             "bytes": sum(c.nbytes() for c in cs),
                             "kept_rows": [int(x) for x in cs[0].kept_keys().tolist()][:1] + [int(cs[0].kept_keys().sum())]}
            if "full" not in kinds:
                row["full"] = {"skipped_gib": full_gib}
            rows.append(row)
            ph, sh = row["per-head"], row["shared"]
            print(f"  {ctx:>6}: per-head {ph['ms_per_token']:.2f} ms/token, {ph['bytes'] / 2**20:.1f} MiB | shared "
                  f"{sh['ms_per_token']:.2f} ms, {sh['bytes'] / 2**20:.1f} MiB | full "
                  + (f"{row['full']['ms_per_token']:.2f} ms, {row['full']['bytes'] / 2**20:.0f} MiB" if "bytes" in
                     row["full"] else f"skipped ({full_gib:.1f} GiB)")
                  + f" | bytes shared / per-head {sh['bytes'] / ph['bytes']:.2f}x, time per-head / shared "
                  f"{ph['ms_per_token'] / sh['ms_per_token']:.2f}", flush=True)
            del caches
            gc.collect()
    header = ["shape", "context", "per-head MiB", "shared MiB", "full MiB", "shared / per-head bytes",
              "per-head ms/token", "shared ms/token", "full ms/token", "per-head / shared time"]
    table = []
    for r in rows:
        f = r["full"]
        table.append([r["shape"], f"{r['context'] // 1024}k", f"{r['per-head']['bytes'] / 2**20:.1f}",
                      f"{r['shared']['bytes'] / 2**20:.1f}",
                      f"{f['bytes'] / 2**20:.0f}" if "bytes" in f else f"({f['skipped_gib']:.1f} GiB, not run)",
                      f"{r['shared']['bytes'] / r['per-head']['bytes']:.2f}x", f"{r['per-head']['ms_per_token']:.2f}",
                      f"{r['shared']['ms_per_token']:.2f}", f"{f['ms_per_token']:.2f}" if "ms_per_token" in f else "-",
                      f"{r['per-head']['ms_per_token'] / r['shared']['ms_per_token']:.2f}"])
    md = markdown_table(header, table)
    print("\n" + md)
    out = write_json(Path(a.out), {"machine": machine(), "threads": a.threads, "layers": LAYERS, "dtype": "float32",
                                   "tol": a.tol, "logit_range": a.logit_range, "rounds": rounds,
                                   "seconds": time.perf_counter() - t_start, "rows": rows, "table": md})
    print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
