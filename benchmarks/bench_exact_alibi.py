"""Exact ALiBi under its obvious name: ``poslsh.alibi_attention`` (the window op with no cut) side by
side with the window op given a window that cuts nothing, the dense float64-safe oracle it was in 0.2
(``poslsh.reference.alibi_attention_reference``) and its strongest CPU peer, PyTorch's SDPA with a
materialised ALiBi mask (the mask built outside the timed region).

Configuration: float32, B = 1, causal, ``--heads`` ALiBi heads (16), d = 64, n = ``--n`` (2048).
Interleaved rounds, best of each (``bench_common.best_of_rounds``); the intra-op thread count is ours
(the op's busy-machine policy is off, so the machine's load does not pick it). Prints the times, the
ratio ``alibi_attention / window op`` and the largest differences: against the window op (float32,
the two must agree within 1e-5) and against the float64 oracle. Writes ``outputs/bench_exact_alibi.json``
(``--out results/bench_exact_alibi.json`` refreshes the committed one).
Run: ``python benchmarks/bench_exact_alibi.py [--n 2048] [--rounds 5]``.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import poslsh
from poslsh.ops.torch import ops as torch_ops
from bench_common import ROOT, best_of_rounds, machine, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="sequence length")
    ap.add_argument("--heads", type=int, default=16, help="ALiBi heads (query = key/value heads)")
    ap.add_argument("--dim", type=int, default=64, help="head dimension")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense oracle (O(n^2) memory)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_exact_alibi.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch_ops.SINGLE_THREAD_WHEN_BUSY = False          # the thread count is ours to set here
    n, H, d = args.n, args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, n, d, generator=g) for _ in range(3))
    slopes = poslsh.alibi_slopes(H)
    pos = torch.arange(n, dtype=torch.float32)
    mask = (-slopes.float()[:, None, None] * (pos[:, None] - pos[None, :]).abs()).masked_fill(
        pos[None, :] > pos[:, None], -math.inf)[None]                             # [1, H, n, n], untimed

    contenders = {
        "poslsh.alibi_attention": lambda: poslsh.alibi_attention(q, k, v, slopes, causal=True),
        "window op, window = n": lambda: poslsh.windowed_alibi_attention(q, k, v, slopes, window=n, causal=True),
        "SDPA + ALiBi mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    }
    if not args.no_dense:
        contenders["dense oracle (0.2's alibi_attention)"] = lambda: poslsh.reference.alibi_attention_reference(
            q, k, v, slopes, causal=True)
    times = best_of_rounds(contenders, rounds=args.rounds)

    fast, window = contenders["poslsh.alibi_attention"](), contenders["window op, window = n"]()
    oracle = poslsh.reference.alibi_attention_reference(q.double(), k.double(), v.double(), slopes, causal=True)
    sdpa = contenders["SDPA + ALiBi mask"]()
    result = {
        "machine": machine(), "threads": torch.get_num_threads(), "n": n, "heads": H, "head_dim": d,
        "dtype": "float32", "causal": True, "rounds": args.rounds, "seconds": times,
        "ratio_alibi_attention_to_window_op": times["poslsh.alibi_attention"]["best"]
        / times["window op, window = n"]["best"],
        "max_abs_diff_alibi_attention_vs_window_op": float((fast - window).abs().max()),
        "max_abs_error_alibi_attention_vs_float64_oracle": float((fast.double() - oracle).abs().max()),
        "max_abs_error_sdpa_vs_float64_oracle": float((sdpa.double() - oracle).abs().max()),
    }
    if not args.no_dense:
        result["ratio_dense_oracle_to_alibi_attention"] = (times["dense oracle (0.2's alibi_attention)"]["best"]
                                                           / times["poslsh.alibi_attention"]["best"])
    print(result["machine"], f"| {result['threads']} threads | n={n} H={H} d={d} float32 causal")
    for name, t in times.items():
        print(f"  {name:40s} best {t['best'] * 1e3:9.1f} ms  median {t['median'] * 1e3:9.1f} ms")
    print(f"  alibi_attention / window op: {result['ratio_alibi_attention_to_window_op']:.2f}x; max |diff| "
          f"{result['max_abs_diff_alibi_attention_vs_window_op']:.1e}; vs the float64 oracle "
          f"{result['max_abs_error_alibi_attention_vs_float64_oracle']:.1e} (SDPA "
          f"{result['max_abs_error_sdpa_vs_float64_oracle']:.1e})")
    print("wrote", write_json(args.out, result))


if __name__ == "__main__":
    main()
