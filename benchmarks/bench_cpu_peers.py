"""CPU benchmark: the window op (torch backend) against its peers, side by side in one process.

Exact ALiBi cut at per-head windows, float32, B = 1, d = 64, causal, two head sets:

* ``smollm2-9``: SmolLM2's 9 heads (slopes ``alibi_slopes(9)``) with the windows of positional
  LSH's cost at s = 10, ``[5, 11, 23, 46, 93, 187, 374, 749, 4]``;
* ``8sigma-16``: 16 heads, ``w_h = ceil(8 sigma_h)`` (12 ... 2048).

Peers: FlexAttention compiled (``torch.compile(flex_attention)``, ``score_mod = s - m_h |i - j|``,
``mask_mod = causal & |i - j| <= w_h``, ``create_block_mask(..., _compile=True)`` built once per
shape, outside the timing), dense SDPA with a materialised float ALiBi mask (n <= 8192; its
forward + backward at 16,384 is one head measured, times the heads: dense work is the same in every
head), the library's own ``backend="flex"`` and, for scale, positional LSH at s = 10 (torch backend,
the same sigmas). Forward at n = 4096, 16,384 and 65,536; forward + backward against SDPA.
Every contender of one size is timed in interleaved rounds, the best kept
(:func:`bench_common.best_of_rounds`); the machine's float32 matmul rate (``torch.mm`` of 2048 x 2048,
best of rounds) is measured in the same run, before and after, and each time is also given as the
fraction of that rate it reaches, counting ``4 d`` flops per score the windows need (``14 d`` forward +
backward: five matmuls against two).

Run: ``python benchmarks/bench_cpu_peers.py [--quick] [--out results/bench_cpu_peers.json]``
(default output ``outputs/bench_cpu_peers.json``).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, best_of_rounds, machine, markdown_table, write_json  # noqa: E402

import poslsh  # noqa: E402
from poslsh.ops.torch import ops as torch_ops  # noqa: E402

D = 64
HEAD_SETS = {
    "smollm2-9": (lambda: (poslsh.alibi_slopes(9), torch.tensor([5, 11, 23, 46, 93, 187, 374, 749, 4]))),
    "8sigma-16": (lambda: (poslsh.alibi_slopes(16), torch.ceil(8 * poslsh.alibi_sigmas(16)).long())),
}


def needed_scores(window: torch.Tensor, n: int) -> int:
    """Scores a causal window needs: ``sum_h sum_i (min(i, w_h) + 1)``."""
    w = window.clamp(max=n - 1).to(torch.float64)
    return int((n * (w + 1) - w * (w + 1) / 2).sum())


def matmul_rate(rounds: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    t = best_of_rounds({"mm": lambda: torch.mm(a, b)}, rounds=rounds)["mm"]["best"]
    return 2 * 2048 ** 3 / t


def inputs(H: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, D, generator=g) for _ in range(4)]      # q, k, v, dout


def flex_call(slopes, window, H, n):
    """The direct compiled FlexAttention call of these heads (its block mask built here, untimed)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Compiled for this shape alone (``dynamic=False``): a compile shared across shapes turns dynamic
    # after its first recompile, and its kernels are slower than a static one's.
    compiled = torch.compile(flex_attention, dynamic=False)
    m, w = slopes.to(torch.float32), window.clamp(max=n).to(torch.int64)

    def score_mod(s, b, h, i, j):
        return s - m[h] * (i - j).abs().to(s.dtype)

    def mask_mod(b, h, i, j):
        return (j <= i) & (i - j <= w[h])

    block_mask = create_block_mask(mask_mod, None, H, n, n, device="cpu", _compile=True)
    return lambda q, k, v: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def alibi_mask(slopes, window, n, heads=None):
    i = torch.arange(n)
    dist = (i[:, None] - i[None]).to(torch.float32)
    sel = slice(None) if heads is None else heads
    m, w = slopes.to(torch.float32)[sel], window[sel]
    keep = (dist >= 0) & (dist <= w[:, None, None])
    return torch.where(keep, -m[:, None, None] * dist, torch.tensor(float("-inf")))[None]


def forward_row(name, slopes, window, n, rounds, sdpa_max, poslsh_s, lib_flex):
    H = slopes.numel()
    q, k, v, _ = inputs(H, n)
    cont = {"poslsh window": lambda: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=True,
                                                                     backend="torch")}
    started = time.perf_counter()
    flex = flex_call(slopes, window, H, n)
    with torch.no_grad():
        ref = flex(q, k, v)
    compile_s = time.perf_counter() - started
    cont["flex compiled"] = lambda: flex(q, k, v)
    if lib_flex:
        cont["poslsh backend='flex'"] = lambda: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window,
                                                                                causal=True, backend="flex")
    if poslsh_s:
        parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), poslsh_s, seed=0)
        cont[f"positional LSH s={poslsh_s}"] = lambda: poslsh.poslsh_attention(q, k, v, parts, causal=True,
                                                                               backend="torch")
    if n <= sdpa_max:
        mask = alibi_mask(slopes, window, n)
        cont["SDPA + float mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with torch.no_grad():
        err = float((cont["poslsh window"]() - ref).abs().max())
        times = best_of_rounds(cont, rounds=rounds)
    return dict(heads=name, n=n, direction="forward", flex_compile_s=compile_s, max_abs_diff_to_flex=err,
                scores=needed_scores(window, n), times={c: t["best"] for c, t in times.items()})


def backward_row(name, slopes, window, n, rounds, sdpa_max):
    H = slopes.numel()
    q, k, v, do = inputs(H, n)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def ours():
        out = poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=True, backend="torch")
        torch.autograd.grad(out, (q, k, v), do)

    cont, per_head = {"poslsh window": ours}, None
    if n <= sdpa_max:
        mask = alibi_mask(slopes, window, n)

        def sdpa():
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), do)
        cont["SDPA + float mask"] = sdpa
    else:   # one head of dense ALiBi (its mask alone is n^2 floats), times the heads
        mask1 = alibi_mask(slopes, window, n, heads=slice(0, 1))
        q1, k1, v1 = (x[:, :1].detach().clone().requires_grad_() for x in (q, k, v))

        def sdpa_one_head():
            torch.autograd.grad(F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask1), (q1, k1, v1), do[:, :1])
        cont["SDPA + float mask (1 head)"], per_head = sdpa_one_head, H
    times = {c: t["best"] for c, t in best_of_rounds(cont, rounds=rounds).items()}
    if per_head:
        times["SDPA + float mask"] = times.pop("SDPA + float mask (1 head)") * per_head
    return dict(heads=name, n=n, direction="forward + backward", scores=needed_scores(window, n), times=times,
                sdpa_heads_measured=1 if per_head else H)


def table(rows, rate):
    out = []
    for r in rows:
        t = r["times"]
        ours = t["poslsh window"]
        flops = (4 if r["direction"] == "forward" else 14) * D * r["scores"]
        for c, s in t.items():
            vs_flex = f"{t['flex compiled'] / s:.2f}x" if "flex compiled" in t else "—"
            out.append([r["heads"], f"{r['n']:,}", r["direction"], c, f"{s * 1e3:,.1f}",
                        f"{s / ours:.2f}", vs_flex, f"{flops / s / rate:.0%}"])
    return markdown_table(["heads", "n", "direction", "method", "ms", "time / poslsh", "flex time / time",
                           "of matmul rate"], out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="n = 4096 only, 2 rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--backward-sizes", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--sdpa-max", type=int, default=8192, help="dense SDPA forward up to this n")
    p.add_argument("--poslsh-s", type=int, default=10, help="positional LSH's s (0: leave it out)")
    p.add_argument("--threads", type=int, default=0, help="torch threads for every contender (0: torch's default)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_cpu_peers.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.rounds, args.sizes, args.backward_sizes = 2, [4096], [4096]
    # Every contender gets torch's threads: the torch backend's single-thread policy under load
    # would otherwise run it on fewer threads than its peers.
    torch_ops.SINGLE_THREAD_WHEN_BUSY = False
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    warnings.filterwarnings("ignore", message="_compile flag on create_block_mask")
    before = machine()
    print(before, f"threads {torch.get_num_threads()}", flush=True)
    rate = matmul_rate(args.rounds)
    rows = []
    for name, make in HEAD_SETS.items():
        slopes, window = make()
        for n in args.sizes:
            rows.append(forward_row(name, slopes, window, n, args.rounds, args.sdpa_max, args.poslsh_s,
                                    lib_flex=n <= 16384))
            print(table(rows[-1:], rate), flush=True)
        for n in args.backward_sizes:
            rows.append(backward_row(name, slopes, window, n, max(2, args.rounds // 2), args.sdpa_max))
            print(table(rows[-1:], rate), flush=True)
    rate = max(rate, matmul_rate(args.rounds))
    after = machine()
    print(f"\nmatmul rate {rate / 1e9:.1f} GFLOP/s (torch.mm 2048^2, float32, best of the run)\n")
    print(table(rows, rate))
    path = write_json(args.out, dict(machine=before, machine_after=after, threads=torch.get_num_threads(),
                                     matmul_flops=rate, d=D, rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
