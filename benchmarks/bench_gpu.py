"""GPU benchmark: the fused Triton kernel of poslsh vs exact and windowed ALiBi.

Configuration (issue 3, defaults): bf16, B=1, H=16 heads with ALiBi slopes,
d=128, s=10 samples, causal; n from 4096 to 1,048,576. Side by side, forward
and forward+backward, in one run:

* ``poslsh-triton``   the fused kernel (``backend="triton"``);
* ``poslsh-torch``    the portable torch backend;
* ``alibi-flex``      exact ALiBi, FlexAttention with an ALiBi ``score_mod`` (causal block mask);
* ``alibi-window``    ALiBi restricted to ``10 sigma_h`` per head, FlexAttention
                      (block mask per head + the ALiBi ``score_mod``): exact in practice;
* ``sdpa-dense``      dense causal flash attention without bias (``F.scaled_dot_product_attention``),
                      the dense floor;
* ``fixed-blocks``    the paper's fixed-blocks baseline (one partition into blocks of
                      ``--fixed-block`` positions) through the same Triton kernel.

Reports the median time (``triton.testing.do_bench``), the TFLOP/s on the tiles
each method actually visits (FlashAttention accounting: ``4 * d`` FLOPs per score
element forward, 3.5x that for forward+backward), and ratios; writes
``results/bench_gpu.csv`` and a log-log plot ``results/bench_gpu.png`` (both
atomically). Competitors that run out of memory are recorded as ``oom``; the
O(n^2) ones are skipped above ``--dense-max-n`` (they would take minutes per
call), and said so.

Run: ``python benchmarks/bench_gpu.py [--quick]``. Without a CUDA GPU it parses
its arguments, says that nothing can be measured, and exits with status 0.

Two more modes serve the first GPU run (``benchmarks/gpu_first_run.sh``):

* ``--warm``: compiles the kernel variants that the GPU tests, ``--check`` and the
  timings use, in parallel processes (one per variant), so later stages hit
  Triton's cache instead of compiling one kernel after another;
* ``--check``: bf16, n = 4096, 16 ALiBi heads, d = 128, s = 10, causal: forward +
  backward against the float64 oracle (errors printed), TMA vs pointer loads,
  two launches vs one per kernel, and bitwise determinism of two runs.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import poslsh  # noqa: E402
from poslsh_paper.io import atomic_savefig, atomic_write  # noqa: E402

METHODS = ["poslsh-triton", "poslsh-torch", "alibi-flex", "alibi-window", "sdpa-dense", "fixed-blocks"]
DEFAULT_NS = [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
QUICK_NS = [4096, 32768, 131072]
BWD_FACTOR = 3.5          # FlashAttention convention: backward = 2.5x forward FLOPs


def _partitions(sigmas, args) -> "poslsh.Partitions":
    """The benchmark's partitions: ``args.samples`` per head from ``args.sampler``."""
    from poslsh.sampling import parse_sampler
    method, group_size = parse_sampler(args.sampler)
    return poslsh.sample_partitions(sigmas, args.samples, seed=args.seed, method=method, group_size=group_size)


def _sampler_arg(spec: str) -> str:
    from poslsh.sampling import parse_sampler
    try:
        parse_sampler(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"n in {QUICK_NS}, fewer repetitions")
    p.add_argument("--n", type=int, nargs="+", default=None, help="sequence lengths (default 4k..1M)")
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--sampler", default="iid", type=_sampler_arg, help="iid, stratified, grouped, grouped-k<size> or grouped-sqrt "
                   "(grouped: the label-compare path counts a group of shifted grids at a time)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-causal", action="store_true", help="non-causal attention (default causal)")
    p.add_argument("--window-sigmas", type=float, default=10.0, help="window of alibi-window, in sigma_h")
    p.add_argument("--fixed-block", type=int, default=512, help="block size of fixed-blocks")
    p.add_argument("--dense-max-n", type=int, default=262144,
                   help="largest n for the O(n^2) methods (alibi-flex, sdpa-dense)")
    p.add_argument("--torch-max-n", type=int, default=262144, help="largest n for poslsh-torch")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench rep (ms); default 100, quick 40")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default=os.path.join(ROOT, "results", "bench_gpu.csv"))
    p.add_argument("--png", default=os.path.join(ROOT, "results", "bench_gpu.png"))
    p.add_argument("--md", default=os.path.join(ROOT, "results", "bench_gpu.md"), help="markdown table")
    p.add_argument("--warm", action="store_true", help="compile the first-run kernel variants in parallel, exit")
    p.add_argument("--check", action="store_true", help="bf16 n=4096 correctness/determinism checks, exit")
    args = p.parse_args(argv)
    if args.n is None:
        args.n = QUICK_NS if args.quick else DEFAULT_NS
    if args.rep_ms is None:
        args.rep_ms = 40.0 if args.quick else 100.0
    return args


# --------------------------------------------------------------------------- results
@dataclass
class Row:
    method: str
    n: int
    mode: str
    status: str                     # ok | oom | skipped | error
    ms: float = float("nan")
    flops: float = float("nan")     # FLOPs on the visited tiles (FA accounting)
    note: str = ""

    @property
    def tflops(self) -> float:
        return self.flops / (self.ms * 1e-3) / 1e12 if self.status == "ok" else float("nan")


@dataclass
class Results:
    rows: List[Row] = field(default_factory=list)

    def get(self, method, n, mode) -> Optional[Row]:
        for r in self.rows:
            if (r.method, r.n, r.mode) == (method, n, mode):
                return r
        return None


def write_csv(res: Results, path: str, args) -> None:
    def w(tmp):
        with open(tmp, "w", newline="") as f:
            cw = csv.writer(f)
            cw.writerow(["method", "n", "mode", "status", "ms", "tflops_visited", "gflop_visited", "batch", "heads",
                         "head_dim", "samples", "dtype", "causal", "note"])
            for r in res.rows:
                cw.writerow([r.method, r.n, r.mode, r.status, f"{r.ms:.4f}", f"{r.tflops:.2f}", f"{r.flops / 1e9:.3f}",
                             args.batch, args.heads, args.head_dim, args.samples, args.dtype, not args.no_causal, r.note])
    atomic_write(path, w)


def write_png(res: Results, path: str, args) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, len(args.modes), figsize=(6.5 * len(args.modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], args.modes):
        for method in args.methods:
            pts = [(r.n, r.ms) for r in res.rows if r.method == method and r.mode == mode and r.status == "ok"]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{mode}: {args.dtype}, B={args.batch}, H={args.heads}, d={args.head_dim}, s={args.samples} {args.sampler}"
                     f"{', causal' if not args.no_causal else ''}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- methods
class Bench:
    def __init__(self, args):
        import triton.testing  # noqa: F401

        self.args = args
        self.dev = torch.device("cuda")
        self.dtype = getattr(torch, args.dtype)
        self.causal = not args.no_causal
        self.H, self.d = args.heads, args.head_dim
        self.slopes = poslsh.alibi_slopes(self.H, dtype=torch.float32, device=self.dev)
        self.sigmas = poslsh.alibi_sigmas(self.H)
        self.parts = _partitions(self.sigmas, args).to(self.dev)
        self.fixed = poslsh.Partitions.fixed_blocks(self.H, args.fixed_block, device=self.dev)
        self._flex = None

    # inputs -----------------------------------------------------------------
    def inputs(self, n: int, grad: bool):
        g = torch.Generator(device=self.dev).manual_seed(self.args.seed)
        shape = (self.args.batch, self.H, n, self.d)
        q, k, v = (torch.randn(shape, generator=g, device=self.dev, dtype=self.dtype) for _ in range(3))
        dout = torch.randn(shape, generator=g, device=self.dev, dtype=self.dtype)
        if grad:
            for t in (q, k, v):
                t.requires_grad_(True)
        return q, k, v, dout

    def time(self, fn: Callable, grad_to_none) -> float:
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=max(10.0, self.args.rep_ms / 4), rep=self.args.rep_ms,
                              grad_to_none=grad_to_none, return_mode="median"))

    # FLOPs on visited tiles -------------------------------------------------
    def _elements_triton(self, parts, n) -> float:
        from poslsh.ops.triton import _launch, _plan
        tuned = _launch._tuned.get("fwd")
        cfg = getattr(tuned, "best_config", None)
        bm, bn = (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]) if cfg is not None else (128, 64)
        total, _ = _plan.visited_tiles(parts.widths, parts.offsets, n, bm, bn, self.causal)
        return float(total.sum()) * bm * bn * self.args.batch

    def _elements_dense(self, n) -> float:
        return self.args.batch * self.H * (n * (n + 1) / 2 if self.causal else float(n) * n)

    def _elements_torch(self, n) -> float:
        """Score elements the torch backend computes: tiles x rows x padded key-range width."""
        from poslsh.ops import torch_impl
        bounds = torch_impl.row_bounds(self.parts, n, self.causal, self.dev)
        groups = torch_impl.plan_tiles(bounds, n, torch_impl.choose_tiles(self.parts.widths, n).to(self.dev))
        return float(sum(g.head.numel() * g.tile * g.width for g in groups)) * self.args.batch

    # flex -------------------------------------------------------------------
    def flex(self):
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention
            self._flex = torch.compile(flex_attention, dynamic=False)
        return self._flex

    def _alibi_mod(self):
        slopes = self.slopes

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs().to(torch.float32)
        return score_mod

    def _block_mask(self, n: int, window: Optional[torch.Tensor]):
        from torch.nn.attention.flex_attention import create_block_mask
        causal = self.causal
        if window is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
            return create_block_mask(mask_mod, None, None, n, n, device=self.dev, _compile=True)

        def wmask(b, h, q_idx, kv_idx):
            near = (q_idx - kv_idx).abs() <= window[h]
            return (near & (q_idx >= kv_idx)) if causal else near
        return create_block_mask(wmask, None, self.H, n, n, device=self.dev, _compile=True)

    @staticmethod
    def _mask_elements(bm) -> float:
        blocks = bm.kv_num_blocks.sum().item()
        if bm.full_kv_num_blocks is not None:
            blocks += bm.full_kv_num_blocks.sum().item()
        return float(blocks) * bm.BLOCK_SIZE[0] * bm.BLOCK_SIZE[1]

    # one method at one n ------------------------------------------------------
    def build(self, method: str, n: int):
        """``(forward(q, k, v) -> out, score elements visited)``."""
        if method in ("poslsh-triton", "fixed-blocks"):
            parts = self.parts if method == "poslsh-triton" else self.fixed
            fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=self.causal,  # noqa: E731
                                                         backend="triton")
            return fn, (lambda: self._elements_triton(parts, n))
        if method == "poslsh-torch":
            fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, self.parts, causal=self.causal,  # noqa: E731
                                                         backend="torch")
            return fn, (lambda: self._elements_torch(n))
        if method == "sdpa-dense":
            import torch.nn.functional as F
            fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # noqa: E731
            return fn, (lambda: self._elements_dense(n))
        flex, score_mod = self.flex(), self._alibi_mod()
        if method == "alibi-flex":
            bm = self._block_mask(n, None) if self.causal else None
            fn = lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa: E731
            return fn, (lambda: self._mask_elements(bm) if bm is not None else self._elements_dense(n))
        if method == "alibi-window":
            window = torch.ceil(self.args.window_sigmas * self.sigmas).to(torch.int32).to(self.dev)
            bm = self._block_mask(n, window)
            fn = lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa: E731
            return fn, (lambda: self._mask_elements(bm))
        raise ValueError(method)

    def _time_mode(self, method: str, n: int, mode: str, fn, elements) -> Row:
        """One timed row; its inputs are freed on return, before the next mode allocates."""
        grad = mode == "fwd+bwd"
        q, k, v, dout = self.inputs(n, grad)
        if grad:
            ms = self.time(lambda: fn(q, k, v).backward(dout), [q, k, v])
        else:
            with torch.no_grad():
                ms = self.time(lambda: fn(q, k, v), None)
        flops = elements() * 4 * self.d * (BWD_FACTOR if grad else 1.0)
        return Row(method, n, mode, "ok", ms, flops)

    def run(self, method: str, n: int, modes: List[str]) -> List[Row]:
        a = self.args
        if method in ("alibi-flex", "sdpa-dense") and n > a.dense_max_n:
            return [Row(method, n, m, "skipped", note=f"O(n^2): n > --dense-max-n={a.dense_max_n}") for m in modes]
        if method == "poslsh-torch" and n > a.torch_max_n:
            return [Row(method, n, m, "skipped", note=f"n > --torch-max-n={a.torch_max_n}") for m in modes]
        rows = []
        try:
            fn, elements = self.build(method, n)
            for mode in modes:
                rows.append(self._time_mode(method, n, mode, fn, elements))
        except torch.cuda.OutOfMemoryError as e:
            done = {r.mode for r in rows}
            rows += [Row(method, n, m, "oom", note=str(e).splitlines()[0][:120]) for m in modes if m not in done]
        except Exception as e:  # a competitor failing must not stop the run, but it must be seen
            import traceback
            print(f"\n[error] {method} at n={n}:", file=sys.stderr)
            traceback.print_exc()
            done = {r.mode for r in rows}
            rows += [Row(method, n, m, "error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
                     for m in modes if m not in done]
        finally:
            torch.cuda.empty_cache()
        return rows


# --------------------------------------------------------------------------- report
def print_table(res: Results, args) -> None:
    for mode in args.modes:
        print(f"\n== {mode} (ms | TFLOP/s on visited tiles) ==")
        header = f"{'n':>9} " + " ".join(f"{m:>22}" for m in args.methods)
        print(header)
        for n in args.n:
            cells = []
            for m in args.methods:
                r = res.get(m, n, mode)
                if r is None:
                    cells.append(f"{'-':>22}")
                elif r.status == "ok":
                    cells.append(f"{r.ms:>11.3f} | {r.tflops:>7.1f}")
                else:
                    cells.append(f"{r.status:>22}")
            print(f"{n:>9} " + " ".join(cells))
        print(f"\n   ratios for {mode}: time(other) / time(poslsh-triton), "
              f"and triton TFLOP/s / sdpa-dense TFLOP/s")
        for n in args.n:
            t = res.get("poslsh-triton", n, mode)
            if t is None or t.status != "ok":
                continue
            parts = []
            for m in args.methods:
                r = res.get(m, n, mode)
                if m != "poslsh-triton" and r is not None and r.status == "ok":
                    parts.append(f"{m} {r.ms / t.ms:.2f}x")
            dense = res.get("sdpa-dense", n, mode)
            if dense is not None and dense.status == "ok":
                parts.append(f"throughput {t.tflops / dense.tflops:.0%} of dense")
            print(f"   n={n:>8}: " + ", ".join(parts))
    problems = [r for r in res.rows if r.status in ("error", "oom")]
    if problems:
        print("\n== errors (full tracebacks were printed on stderr) ==")
        for r in problems:
            print(f"   {r.method} n={r.n} {r.mode}: {r.status}: {r.note}")


def check_targets(res: Results, args) -> None:
    """The issue's targets (n = 131072 and 1M, fwd+bwd), when measured."""
    mode, n0, n1 = "fwd+bwd", 131072, 1048576
    t = res.get("poslsh-triton", n0, mode)
    if t is None or t.status != "ok":
        print("\ntargets: poslsh-triton at n=131072 fwd+bwd not measured")
        return
    print("\n== targets (issue 3) ==")

    def line(name, ok, value):
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: {value}")
    ex, win, dense = (res.get(m, n0, mode) for m in ("alibi-flex", "alibi-window", "sdpa-dense"))
    if ex is not None and ex.status == "ok":
        line(">= 60x faster than exact ALiBi (Flex) at 128k", ex.ms / t.ms >= 60, f"{ex.ms / t.ms:.1f}x")
    if win is not None and win.status == "ok":
        line("<= 0.8x the 10-sigma window time at 128k", t.ms / win.ms <= 0.8, f"{t.ms / win.ms:.2f}x")
    if dense is not None and dense.status == "ok":
        line("throughput on visited tiles >= 50% of dense flash", t.tflops >= 0.5 * dense.tflops,
             f"{t.tflops:.0f} vs {dense.tflops:.0f} TFLOP/s ({t.tflops / dense.tflops:.0%})")
    big = res.get("poslsh-triton", n1, mode)
    if big is not None:
        line("n = 1M fwd+bwd runs without OOM", big.status == "ok", big.status)
        if big.status == "ok":
            line("time(1M) / time(128k) <= 9", big.ms / t.ms <= 9, f"{big.ms / t.ms:.2f}")


def write_md(res: Results, path: str, args) -> None:
    """One markdown table: ms per method, fwd and fwd+bwd, and triton's speed-up."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [f"{name}; {args.dtype}, B={args.batch}, H={args.heads}, d={args.head_dim}, s={args.samples} {args.sampler}, "
             f"{'causal' if not args.no_causal else 'non-causal'}; median ms (triton.testing.do_bench)", "",
             "| n | mode | " + " | ".join(args.methods) + " | exact / triton | triton / window |",
             "|---|---|" + "---|" * (len(args.methods) + 2)]
    for n in args.n:
        for mode in args.modes:
            cells = []
            for m in args.methods:
                r = res.get(m, n, mode)
                cells.append("-" if r is None else (f"{r.ms:.3f}" if r.status == "ok" else r.status))
            t, ex, win = (res.get(m, n, mode) for m in ("poslsh-triton", "alibi-flex", "alibi-window"))
            ok = lambda r: r is not None and r.status == "ok"  # noqa: E731
            sp = f"{ex.ms / t.ms:.1f}x" if ok(t) and ok(ex) else "-"
            wr = f"{t.ms / win.ms:.2f}x" if ok(t) and ok(win) else "-"
            lines.append(f"| {n} | {mode} | " + " | ".join(cells) + f" | {sp} | {wr} |")
    atomic_write(path, lambda tmp: open(tmp, "w").write("\n".join(lines) + "\n"))
    print("\n" + "\n".join(lines))


# --------------------------------------------------------------------------- first GPU run
# (dtype, d, dv, causal, n, environment): the compiled variants the GPU tests, --check and
# the timings launch (n only matters through n % 16, which triton specialises on).
WARM_VARIANTS = [
    ("bfloat16", 128, 128, True, 256, {}), ("bfloat16", 64, 64, False, 256, {}),
    ("float16", 64, 64, True, 256, {}), ("float32", 64, 64, True, 256, {}),
    ("bfloat16", 80, 96, True, 777, {}), ("bfloat16", 128, 128, True, 256, {"POSLSH_TRITON_TMA": "0"}),
    ("bfloat16", 128, 128, True, 256, {"POSLSH_TRITON_SPLIT": "0"}),
    # grouped partitions (lattice counts): the timings at s = 20 and test_gpu_grouped_partitions
    ("bfloat16", 128, 128, True, 256, {"sampler": "grouped"}), ("float32", 64, 64, True, 1025, {"sampler": "grouped"}),
    ("bfloat16", 64, 64, True, 1025, {"sampler": "grouped"}),
]


def _warm_one(spec) -> str:
    dtype, d, dv, causal, n, env = spec
    env = dict(env)
    sampler = env.pop("sampler", "iid")
    os.environ.update(env)
    os.environ.setdefault("POSLSH_TRITON_AUTOTUNE", "0")
    t0 = time.time()
    import poslsh as P
    parts = P.sample_partitions(P.alibi_sigmas(4), 10, seed=0, method=sampler).to("cuda")
    dt = getattr(torch, dtype)
    q = torch.randn(1, 4, n, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(1, 2, n, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(1, 2, n, dv, device="cuda", dtype=dt, requires_grad=True)
    P.poslsh_attention(q, k, v, parts, causal=causal, backend="triton").float().sum().backward()
    torch.cuda.synchronize()
    return f"{dtype} d={d} dv={dv} causal={causal} n%16={n % 16} {sampler} {env or ''}: {time.time() - t0:.0f} s"


def warm(args) -> int:
    import multiprocessing as mp
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(len(WARM_VARIANTS), os.cpu_count() or 1)) as pool:
        for line in pool.imap_unordered(_warm_one, WARM_VARIANTS):
            print(f"  compiled {line}", flush=True)
    print(f"warm-up: {len(WARM_VARIANTS)} variants in {time.time() - t0:.0f} s (Triton's cache: "
          f"{os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')})")
    return 0


def _rel(a, b) -> float:
    b = b.double()
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(args) -> int:
    """bf16 n=4096 forward + backward vs the float64 oracle; TMA vs pointers; split vs one
    launch; bitwise determinism. Exit status 1 if any check fails."""
    from poslsh.ops.triton import _launch
    n, H, d = 4096, args.heads, args.head_dim
    causal = not args.no_causal
    dev = torch.device("cuda")
    parts = _partitions(poslsh.alibi_sigmas(H), args).to(dev)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    q, k, v, dout = (torch.randn(1, H, n, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4))

    def run(**flags):
        old = (_launch.FORCE_TMA, _launch.SPLIT)
        _launch.FORCE_TMA, _launch.SPLIT = flags.get("tma"), flags.get("split")
        try:
            x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = poslsh.poslsh_attention(*x, parts, causal=causal, backend="triton")
            out.backward(dout)
            torch.cuda.synchronize()
            return [out.detach()] + [t.grad for t in x]
        finally:
            _launch.FORCE_TMA, _launch.SPLIT = old

    t0 = time.time()
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = poslsh.poslsh_attention_reference(*x, parts, causal=causal)
    ref.backward(dout.double())
    ref = [ref.detach()] + [t.grad for t in x]
    names = ["out", "dq", "dk", "dv"]
    ok = True
    print(f"check: bf16, n={n}, H={H}, d={d}, s={args.samples}, causal={causal} "
          f"(errors: max |x - ref| / max |ref|, bound 1e-2)  [oracle {time.time() - t0:.0f} s]")
    results = {}
    for label, flags in [("TMA, 2 launches", dict(tma=True, split=True)),
                         ("pointers, 2 launches", dict(tma=False, split=True)),
                         ("TMA, 1 launch", dict(tma=True, split=False))]:
        got = run(**flags)
        results[label] = got
        errs = [_rel(a, b) for a, b in zip(got, ref)]
        ok = ok and all(e < 1e-2 for e in errs)
        print(f"  {label:>22}: " + "  ".join(f"{m} {e:.2e}" for m, e in zip(names, errs)))
    base = results["TMA, 2 launches"]
    for label in ("pointers, 2 launches", "TMA, 1 launch"):
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(results[label], base))
        same = all(torch.equal(a, b) for a, b in zip(results[label], base))
        print(f"  {label} vs TMA, 2 launches: max |diff| {diff:.2e} ({'bitwise equal' if same else 'differs'})")
    again = run(tma=True, split=True)
    det = all(torch.equal(a, b) for a, b in zip(again, base))
    ok = ok and det
    print(f"  deterministic (two runs bitwise equal): {det}")
    print(f"check: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU is available on this machine, so nothing can be measured. "
              "Run this script on a GPU (e.g. `python benchmarks/bench_gpu.py --quick`).")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_gpu: triton is not installed; the poslsh-triton backend needs it.")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.warm:
        return warm(args)
    if args.check:
        return check(args)
    bench = Bench(args)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"config: {args.dtype}, B={args.batch}, H={args.heads}, d={args.head_dim}, s={args.samples} {args.sampler}, "
          f"causal={not args.no_causal}, n={args.n}")
    res = Results()
    for n in args.n:
        for method in args.methods:
            t0 = time.time()
            rows = bench.run(method, n, args.modes)
            res.rows += rows
            desc = ", ".join(f"{r.mode} {r.ms:.3f} ms" if r.status == "ok" else f"{r.mode} {r.status} {r.note}"
                             for r in rows)
            print(f"n={n:>8} {method:>14}: {desc}  [{time.time() - t0:.0f}s]", flush=True)
        write_csv(res, args.csv, args)        # after every n: a partial run still leaves results
    write_png(res, args.png, args)
    print_table(res, args)
    write_md(res, args.md, args)
    check_targets(res, args)
    print(f"\nwrote {args.csv} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
