"""The 2-D analogue of the paper's Figure 2: norm convergence on a trained ViT's patch Q/K/V.

For the trained model ``figure_method`` (seed 0) and its attention layer ``figure_layer``, Q/K/V of
``figure_images`` test images at ``figure_scale`` x 28 px are recorded. For every ``s`` of
``figure_samples`` and every image, fresh boxes are drawn and three errors measured per head:
``||L** - M~||`` (spectral), ``||L** - M~||_max`` (against the eq. (3) bound at ``delta``, which
holds for any positional LSH) and ``||T** - T~||_max`` (exact 2-D ALiBi attention against
:func:`poslsh.poslsh_attention_nd`, float64). Mean +- std over images, log-log.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from poslsh import theory
from poslsh.attention import poslsh_attention_nd
from poslsh_paper.data.images import to_float, upsample
from poslsh_paper.io import atomic_savefig, atomic_write_json
from poslsh.partitions_nd import grid_coords, sample_partitions_nd
from poslsh.reference import alibi_attention_reference_nd, alibi_matrix_nd
from poslsh.seeding import stable_seed
from poslsh_paper.experiments.checkpoints import latest_checkpoint, load_checkpoint_params
from poslsh_paper.experiments.vision.config import VisionConfig, head_sigmas, run_dir
from poslsh_paper.experiments.vision.train import build_model, load_splits

__all__ = ["record_qkv", "convergence", "plot_convergence", "write_figure"]


@torch.no_grad()
def record_qkv(cfg: VisionConfig):
    """``(q, k, v, grid, source)``: float64 ``[N, H, n, hd]`` of the trained figure model's layer."""
    path = latest_checkpoint(run_dir(cfg, cfg.figure_method, 0))
    if path is None:
        raise FileNotFoundError(f"no trained {cfg.figure_method} seed 0 run under {run_dir(cfg, cfg.figure_method, 0)}")
    model = build_model(cfg, cfg.figure_method, 0)
    model.load_state_dict(load_checkpoint_params(path), strict=False)
    model.eval()
    attn = model.blocks[cfg.figure_layer].attn
    attn.record = True
    test = load_splits(cfg)["test"]
    x = upsample(to_float(test.images[:cfg.figure_images]), cfg.figure_scale)
    model(x)
    q, k, v = (t.to(torch.float64) for t in attn.recorded)
    g = 28 * cfg.figure_scale // cfg.model.patch_size
    return q, k, v, (g, g), f"{cfg.figure_method} seed 0, layer {cfg.figure_layer}, {path.name}"


def convergence(cfg: VisionConfig) -> dict:
    """Errors per (s, head) over the figure's images: ``summary[metric][s] = (mean [H], std [H])``."""
    q, k, v, grid, source = record_qkv(cfg)
    N, H, n, _ = q.shape
    sigma = head_sigmas(cfg.model)
    coords = grid_coords(*grid)
    L = alibi_matrix_nd(coords, sigma)
    exact = alibi_attention_reference_nd(q, k, v, 1.0 / sigma, grid=grid)
    raw: Dict[str, List[List[List[float]]]] = {"spectral": [], "max": [], "output": []}
    for s in cfg.figure_samples:
        per = {key: [] for key in raw}
        for i in range(N):
            parts = sample_partitions_nd(sigma, s, seed=stable_seed("vision-figure", i, s))
            errs = theory.dense_mask_errors(L, parts.dense_mean(coords))
            approx = poslsh_attention_nd(q[i:i + 1], k[i:i + 1], v[i:i + 1], parts, grid=grid)
            per["spectral"].append(errs.spectral.tolist())
            per["max"].append(errs.max.tolist())
            per["output"].append((approx - exact[i:i + 1]).abs().amax((0, 2, 3)).tolist())
        for key in raw:
            raw[key].append(per[key])
    summary = {key: {str(s): [np.mean(raw[key][j], 0).tolist(), np.std(raw[key][j], 0).tolist()]
                     for j, s in enumerate(cfg.figure_samples)} for key in raw}
    bound = {str(s): theory.max_norm_deviation_bound(n, s, cfg.delta) for s in cfg.figure_samples}
    return {"source": source, "grid": list(grid), "tokens": n, "sigma": sigma.tolist(), "samples": list(cfg.figure_samples),
            "delta": cfg.delta, "images": N, "summary": summary, "eq3_bound": bound, "raw": raw}


def plot_convergence(result: dict, path) -> Path:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    s = np.array(result["samples"], dtype=float)
    titles = {"spectral": r"$\|L^{**}-\tilde M\|$", "max": r"$\|L^{**}-\tilde M\|_{\max}$",
              "output": r"$\|T^{**}-\tilde T^{**}\|_{\max}$"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, title) in zip(axes, titles.items()):
        summ = result["summary"][key]
        mean = np.array([summ[str(int(x))][0] for x in s])
        std = np.array([summ[str(int(x))][1] for x in s])
        for h, sg in enumerate(result["sigma"]):
            line, = ax.plot(s, mean[:, h], marker="o", ms=3, label=f"head {h}, $\\sigma$={sg:g}")
            # on log axes mean - std can reach 0: the band stops a decade below the mean
            ax.fill_between(s, np.maximum(mean[:, h] - std[:, h], mean[:, h] / 10), mean[:, h] + std[:, h],
                            color=line.get_color(), alpha=0.2)
        if key == "max":
            ax.plot(s, [result["eq3_bound"][str(int(x))] for x in s], "k--",
                    label=f"eq. (3), $\\delta$={result['delta']:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("samples s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    g = result["grid"]
    fig.suptitle(f"2-D positional LSH: convergence on a trained ViT's patch Q/K/V ({g[0]}x{g[1]} = {result['tokens']} "
                 f"tokens; {result['source']}; mean ± std over {result['images']} test images)", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, Path(path), dpi=120)
    plt.close(fig)
    return Path(path)


def slopes(result: dict, lo: int = 10) -> Dict[str, List[float]]:
    """Fitted log-log slope of each mean error vs s over ``s >= lo``, per head."""
    s = np.array([x for x in result["samples"] if x >= lo], dtype=float)
    out = {}
    for key, summ in result["summary"].items():
        mean = np.array([summ[str(int(x))][0] for x in s])
        out[key] = [float(np.polyfit(np.log(s), np.log(np.maximum(mean[:, h], 1e-300)), 1)[0])
                    for h in range(mean.shape[1])] if len(s) > 1 else []
    return out


def write_figure(cfg: VisionConfig, out: Path) -> Path:
    """Compute the figure's data and write ``convergence.png`` and ``convergence.json`` under ``out``."""
    result = convergence(cfg)
    result["slopes_s_ge_10"] = slopes(result)
    atomic_write_json(Path(out) / "convergence.json", {k: v for k, v in result.items() if k != "raw"})
    return plot_convergence(result, Path(out) / "convergence.png")
