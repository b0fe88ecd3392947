"""GPU benchmark: positional LSH (the fused Triton kernel, FlexAttention, the torch backend)
against exact and windowed ALiBi and dense flash attention, side by side in one run.

Configuration (defaults): bf16, B = 1, H = 16 ALiBi heads, d = 128, s = 10 samples, causal;
n from 4096 to 1,048,576; forward (of a training step) and forward + backward. The methods
are those of :mod:`gpu_common` (``poslsh-triton``, ``poslsh-flex``, ``poslsh-torch``,
``window-flex``, ``window-triton``, ``exact-flex``, ``sdpa-flash``, ``fixed-blocks``); the O(n^2)
ones (``exact-flex``, ``sdpa-flash``) are skipped above ``--dense-max-n`` (said so in a row).

Every measurement is a row of ``<out>/results.md`` and ``results.csv`` the moment it is taken
(:mod:`gpu_rows`); at the end a table of ms per method and the ratios to ``poslsh-triton``,
and with ``--png`` a log-log plot. ``benchmarks/gpu_more.sh`` runs the sweeps that do not fit
the first GPU run (``gpu_first_run.sh``) through this script.

Run: ``python benchmarks/bench_gpu.py [--quick]``. Without a CUDA GPU it says so and exits 0;
``--dry-run`` runs the code path on the CPU (Triton interpreter, float32, tiny sizes).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

from gpu_common import METHODS, ROOT, Case, dry_case, time_method
from gpu_rows import Recorder, header

DEFAULT_NS = [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
QUICK_NS = [4096, 32768, 131072]
DENSE = ("exact-flex", "sdpa-flash")


def _sampler_arg(spec: str) -> str:
    from poslsh.sampling import parse_sampler
    try:
        parse_sampler(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"n in {QUICK_NS}")
    p.add_argument("--n", type=int, nargs="+", default=None, help="sequence lengths (default 4k..1M)")
    p.add_argument("--methods", nargs="+", default=["poslsh-triton", "window-flex", "exact-flex", "sdpa-flash"],
                   choices=METHODS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default = heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--sampler", default="iid", type=_sampler_arg,
                   help="iid, stratified, grouped, grouped-k<size> or grouped-sqrt")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-causal", action="store_true", help="non-causal attention (default causal)")
    p.add_argument("--fixed-block", type=int, default=512, help="block size of fixed-blocks")
    p.add_argument("--dense-max-n", type=int, default=262144, help="largest n for the O(n^2) methods")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--budget-ms", type=float, default=400.0, help="time spent repeating each measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_gpu"), help="folder of results.md / .csv")
    p.add_argument("--stage", default="bench", help="the stage name in the rows")
    p.add_argument("--append", action="store_true", help="append to existing result files (no new headers)")
    p.add_argument("--png", default=None, help="also a log-log plot of ms against n")
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, float32, tiny sizes")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = QUICK_NS if args.quick else DEFAULT_NS
    return args


def case_of(args) -> Case:
    case = Case(B=args.batch, H=args.heads, Hkv=args.kv_heads or args.heads, d=args.head_dim, s=args.samples,
                dtype=args.dtype, causal=not args.no_causal, sampler=args.sampler, seed=args.seed,
                fixed_block=args.fixed_block)
    if args.dry_run:
        case = replace(dry_case(case), sampler=args.sampler, s=min(args.samples, 4), fixed_block=16)
    return case


def summary(measured, args, case) -> str:
    """A Markdown table of ms per method and n, and each method's time over poslsh-triton's."""
    lines = [f"{case.describe()}: median ms (ratio to poslsh-triton)", "",
             "| n | mode | " + " | ".join(args.methods) + " |", "|---|---|" + "---|" * len(args.methods)]
    for n in args.n:
        for mode in args.modes:
            base = measured.get(("poslsh-triton", n), {}).get(mode)
            cells = []
            for m in args.methods:
                ms = measured.get((m, n), {}).get(mode)
                cells.append("-" if ms is None else f"{ms:.3f}" + (f" ({ms / base:.2f}x)" if base and m != "poslsh-triton"
                                                                    else ""))
            lines.append(f"| {n} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(measured, args, case, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, len(args.modes), figsize=(6.5 * len(args.modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], args.modes):
        for m in args.methods:
            pts = sorted((n, measured[(m, n)][mode]) for n in args.n if mode in measured.get((m, n), {}))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="time (ms)", title=f"{mode}: "
               f"{case.describe()}")
        ax.title.set_fontsize(8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        args.n = [48 + 16 * i for i in range(min(2, len(args.n)))]
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU is available on this machine, so nothing can be measured. Run it on a GPU "
              "(e.g. `python benchmarks/bench_gpu.py --quick`), or pass --dry-run for the CPU code path.")
        return 0
    case = case_of(args)
    if not args.append:
        header(args.out, "poslsh GPU benchmark", [f"Configuration: {case.describe()}; methods {args.methods}", ""])
    rec = Recorder(args.out, args.stage)
    rec.row("config", "info", detail=f"{case.describe()}; torch {torch.__version__}; "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
            f"POSLSH_TRITON_TMA={os.environ.get('POSLSH_TRITON_TMA', '-')}, "
            f"POSLSH_TRITON_SPLIT={os.environ.get('POSLSH_TRITON_SPLIT', '-')}")
    measured = {}
    for n in args.n:
        for m in args.methods:
            if m in DENSE and n > args.dense_max_n:
                for mode in args.modes:
                    rec.row(m, "skipped", n=n, mode=mode, detail=f"O(n^2): n > --dense-max-n={args.dense_max_n}")
                continue
            measured[(m, n)] = time_method(rec, m, case, n, args.modes, args.budget_ms)
    table = summary(measured, args, case)
    print("\n" + table)
    with open(os.path.join(args.out, f"{args.stage}-summary.md"), "w") as f:
        f.write(table + "\n")
    if args.png:
        plot(measured, args, case, args.png)
    return 1 if rec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
