"""Figures of the experiments (matplotlib, Agg backend: no display needed),
each saved atomically: Figure 1 (``poslsh demo``) and the Figure-2 analog
(``poslsh convergence``)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from poslsh.alibi import alibi_matrix
from poslsh_paper.io import atomic_savefig
from poslsh.partitions import sample_partitions

__all__ = ["plot_figure1", "plot_convergence", "plot_ppl_vs_context"]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    atomic_savefig(fig, path, dpi=130)


def plot_figure1(sigma: float, seed: int, window: int, path) -> Path:
    """The paper's Figure 1 for one head of bandwidth ``sigma``: ``L*``, one sampled
    mask, and ``M~`` for s = 5 and 100, on the first ``window`` positions."""
    plt = _pyplot()
    sig = torch.tensor([float(sigma)], dtype=torch.float64)
    panels = [("ALiBi $L^*$ ($\\sigma$=%g)" % float(sigma), alibi_matrix(window, sig)[0])]
    panels.append(("one sampled mask $M_1$", sample_partitions(sig, 1, seed=seed).dense_mean(window)[0]))
    for s in (5, 100):
        panels.append((f"$\\tilde M$, s = {s}", sample_partitions(sig, s, seed=seed + s).dense_mean(window)[0]))
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    for ax, (title, mat) in zip(axes, panels):
        im = ax.imshow(mat.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(f"Positional LSH approximation of ALiBi (first {window} positions)")
    atomic_savefig(fig, Path(path), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def plot_convergence(result: dict, path) -> Path:
    """The Figure-2 analog: log-log error vs ``s``, one panel per norm (the output
    error once per layer), one line per head and sampler (i.i.d. solid and shaded mean
    +- std over inputs; other samplers dotted / dash-dotted, same colour), and
    Theorem 2.1's bounds as dashed lines (eq. (1) with the constant ``C`` of the
    run, per head; eq. (3) at confidence ``1 - delta``, per sampler)."""
    plt = _pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter
    summary = result["summary"]
    cfg = result["config"]
    heads = list(cfg["heads"])
    sigmas = dict(zip(heads, cfg["sigmas"]))
    layers = sorted({r["layer"] for r in summary})
    bounds = result["bounds"]
    C, delta = bounds["C"], bounds["delta"]
    order = sorted(heads, key=lambda h: sigmas[h])
    samplers = list(cfg.get("samplers") or ["iid"])
    styles = dict(zip(samplers, ["o-", "s:", "^-.", "v--"]))
    of = lambda r: r.get("sampler", "iid")       # noqa: E731
    colors = {h: plt.get_cmap("plasma")(x) for h, x in zip(order, np.linspace(0.0, 0.8, len(order)))}

    panels = [("spectral", None, r"$\|L^\star-\widetilde{M}\|$"),
              ("max", None, r"$\|L^\star-\widetilde{M}\|_{\max}$")]
    panels += [("t_err", layer, r"$\|T^\star-\widetilde{T}^\star\|_{\max}$" + f"  (layer {layer}, causal)")
               for layer in layers]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.9), squeeze=False)
    axes = axes[0]
    first_layer = layers[0]
    for ax, (metric, layer, title) in zip(axes, panels):
        lay = first_layer if layer is None else layer      # mask norms do not depend on the layer
        lows = []
        for h, sampler in ((h, sp) for sp in samplers for h in order):
            rs = sorted((r for r in summary if r["head"] == h and r["layer"] == lay and of(r) == sampler),
                        key=lambda r: r["s"])
            if not rs:
                continue
            s = np.array([r["s"] for r in rs], dtype=float)
            m = np.array([r[f"{metric}_mean"] for r in rs])
            sd = np.array([r[f"{metric}_std"] for r in rs])
            lo = np.clip(m - sd, m * 1e-2, None)
            lows.append(m.min())
            first = sampler == samplers[0]
            ax.plot(s, m, styles[sampler], color=colors[h], lw=1.6 if first else 1.2, ms=3.5 if first else 2.5,
                    label=fr"head {h}, $\sigma$={sigmas[h]:.3g}" if first else None)
            if first:
                ax.fill_between(s, lo, m + sd, color=colors[h], alpha=0.22, lw=0)
            if metric == "spectral" and first:
                b = [x for x in bounds["rows"] if abs(x["sigma"] - sigmas[h]) < 1e-9 and of(x) == sampler]
                b.sort(key=lambda x: x["s"])
                ax.plot([x["s"] for x in b], [x["spectral_eq1"] for x in b], "--", color=colors[h], lw=1.1)
        if metric == "max":
            for sampler, grey in zip(samplers, ("black", "dimgray", "gray", "darkgray")):
                b = sorted({(x["s"], x["max_eq3"]) for x in bounds["rows"] if x.get("sampler", "iid") == sampler})
                ax.plot([x[0] for x in b], [x[1] for x in b], "--", color=grey, lw=1.1,
                        label=fr"eq. (3), $\delta$={delta:g}" + (f" ({sampler})" if len(samplers) > 1 else ""))
        if metric == "spectral":
            ax.plot([], [], "--", color="gray", lw=1.1, label=f"eq. (1), C={C:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):      # decade labels only: mathtext minor labels are slow and cluttered
            axis.set_major_locator(LogLocator(base=10, numticks=8))
            axis.set_minor_formatter(NullFormatter())
        if lows:
            ax.set_ylim(bottom=min(lows) / 4)
        ax.set_xlabel("sample size s")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("error (mean ± std over inputs)")
    for sampler in samplers[1:] if len(samplers) > 1 else []:
        axes[0].plot([], [], styles[sampler], color="gray", lw=1.2, ms=2.5, label=f"{sampler} (same colours)")
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].legend(handles=[ln for ln in axes[1].get_lines() if ln.get_label().startswith("eq.")], fontsize=7,
                   loc="lower left")
    model = result.get("model", {}).get("name", "")
    fig.suptitle(f"{model}: {len(result.get('inputs', []))} inputs of n={cfg['n']} tokens, "
                 f"{cfg['rope']}-RoPE Q/K/V; shaded: mean ± std over inputs; dashed: Theorem 2.1", fontsize=10)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.14, top=0.84, wspace=0.22)
    _save(fig, Path(path))
    plt.close(fig)
    return Path(path)


def plot_ppl_vs_context(rows, path, title: str = "") -> Path:
    """Perplexity against evaluation context (log2 axis), one line per way of running the attention
    (the mean over seeds; each seed's value as a small marker); lengths a mode did not run are absent."""
    plt = _pyplot()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    styles = ["o-", "s--", "^-.", "v:", "D-", "x--"]
    colors = {m: plt.get_cmap("viridis")(x) for m, x in zip(methods, np.linspace(0.0, 0.85, len(methods)))}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, m in enumerate(methods):
        done = sorted((r for r in rows if r["method"] == m and "ppl_by_seed" in r), key=lambda r: r["context"])
        if not done:
            continue
        x = [r["context"] for r in done]
        ax.plot(x, [r["ppl_mean"] for r in done], styles[i % len(styles)], color=colors[m], lw=1.5, ms=4,
                label=done[0]["label"])
        for r in done:
            vals = list(r["ppl_by_seed"].values())
            ax.plot([r["context"]] * len(vals), vals, ".", color=colors[m], ms=3, alpha=0.6)
    contexts = sorted({r["context"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts)
    ax.set_xticklabels([f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("evaluation context (tokens; trained at the first)")
    ax.set_ylabel("perplexity (mean over seeds; dots: each seed)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _save(fig, Path(path))
    plt.close(fig)
    return Path(path)
