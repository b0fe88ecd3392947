"""The tables and the figure of ``poslsh frontier``: per-head means over inputs and draws, their
means over heads, the equal-cost comparison, the hybrid head by head, the window bound against
the measured loss, and the log-log frontier (error vs keys per query, error vs CPU time)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

from poslsh_paper.io import atomic_savefig, csv_text, markdown_table

__all__ = ["head_summary", "summary", "comparison", "hybrid_heads", "bound_rows", "csv_of", "markdown", "plot",
           "figure", "comparison_text"]

METRICS = ("keys", "max", "mae", "relf", "dropped", "bound", "logit_range", "value_range", "exact_reach")
FAMILY_ORDER = {"exact": -1, "iid": 0, "grouped": 1, "window": 2, "window-c": 3, "hybrid": 4}
WIDE = 64.0      # the hybrid table shows heads with sigma >= WIDE
HYBRID_N = 4096  # ... at lengths n >= HYBRID_N (the widest heads saturate shorter sequences)


def _order(r: dict):
    return (r["n"], r["source"], FAMILY_ORDER.get(r["family"], 9), r["label"].split(" ")[0],
            float(r["label"].rsplit("=", 1)[-1]), r.get("sigma", 0.0))


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def head_summary(rows: List[dict]) -> List[dict]:
    """Mean over inputs and draws per (n, source, method, head)."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["n"], r["source"], r["label"], r["head"]), []).append(r)
    out = []
    for (n, source, label, head), rs in groups.items():
        rec = dict(n=n, source=source, label=label, family=rs[0]["family"], s=rs[0]["s"], head=head,
                   sigma=rs[0]["sigma"], inputs=len({r["input"] for r in rs}), draws=len({r["draw"] for r in rs}))
        for key in ("w", "w0", "hc"):
            if key in rs[0]:
                rec[key] = rs[0][key]
        for m in METRICS:
            if m in rs[0]:
                rec[m] = _mean([r[m] for r in rs])
        rel = [r["relf"] for r in rs]
        rec["relf_std"] = math.sqrt(_mean([(x - rec["relf"]) ** 2 for x in rel])) if len(rel) > 1 else 0.0
        out.append(rec)
    return sorted(out, key=_order)


def summary(heads: List[dict], timing: Optional[dict] = None) -> List[dict]:
    """Mean over heads per (n, source, method), with the method's CPU time (or why it is missing)."""
    times = {(t["n"], t["label"]): t for t in (timing or {}).get("rows", [])}
    groups: Dict[tuple, List[dict]] = {}
    for r in heads:
        groups.setdefault((r["n"], r["source"], r["label"]), []).append(r)
    out = []
    for (n, source, label), rs in groups.items():
        rec = dict(n=n, source=source, label=label, family=rs[0]["family"], s=rs[0]["s"], heads=len(rs))
        for m in ("keys", "max", "mae", "relf"):
            rec[m] = _mean([r[m] for r in rs])
        t = times.get((n, label), {})
        rec["seconds"] = t.get("seconds")
        rec["time_note"] = t.get("reason", "" if t else "not timed")
        out.append(rec)
    return sorted(out, key=_order)


def _index(rows: List[dict]) -> Dict[tuple, dict]:
    return {(r["n"], r["source"], r["label"]): r for r in rows}


def _ratio(a: Optional[dict], b: Optional[dict], m: str) -> Optional[float]:
    return a[m] / b[m] if a and b and b[m] > 0 else None


def comparison(report: dict, rows: List[dict]) -> List[dict]:
    """Equal cost, per (n, source, s): positional LSH against the window with the same keys per
    query (head by head), and the best hybrid at that cost; error ratios (> 1: the window wins)."""
    cfg = report["config"]
    base = cfg["samplers"][0]
    idx = _index(rows)
    out = []
    for n, source in sorted({(r["n"], r["source"]) for r in rows}):
        for s in cfg["samples"]:
            get = lambda label: idx.get((n, source, label))      # noqa: E731
            a, w = get(f"{base} s={s}"), get(f"window@{base} s={s}")
            if a is None or w is None:
                continue
            hyb = [h for h in (get(f"hybrid {x:g}@{base} s={s}") for x in cfg["hybrid_shares"]) if h]
            best = min(hyb, key=lambda h: h["mae"]) if hyb else None
            rec = dict(n=n, source=source, s=s, keys=a["keys"], window_keys=w["keys"])
            for m in ("mae", "relf", "max"):
                rec[f"{base}_{m}"], rec[f"window_{m}"] = a[m], w[m]
                rec[f"{base}_over_window_{m}"] = _ratio(a, w, m)
            for sampler in cfg["samplers"][1:]:      # each against the window of its own cost
                g, wg = get(f"{sampler} s={s}"), get(f"window@{sampler} s={s}")
                rec[f"{sampler}_keys"] = g["keys"] if g else None
                rec[f"{sampler}_mae"] = g["mae"] if g else None
                rec[f"window@{sampler}_mae"] = wg["mae"] if wg else None
                rec[f"{sampler}_over_window_mae"] = _ratio(g, wg, "mae")
            rec["hybrid"] = best["label"] if best else None
            rec["hybrid_mae"] = best["mae"] if best else None
            rec["hybrid_over_window_mae"] = _ratio(best, w, "mae")
            rec["hybrid_over_window_relf"] = _ratio(best, w, "relf")
            out.append(rec)
    return out


def hybrid_heads(report: dict, heads: List[dict]) -> List[dict]:
    """Per (n, source, head, s): every hybrid's relative Frobenius error over the cost-matched window's."""
    cfg = report["config"]
    base = cfg["samplers"][0]
    idx = {(r["n"], r["source"], r["label"], r["head"]): r for r in heads}
    out = []
    for (n, source, label, head), w in sorted(idx.items(), key=lambda kv: _order(kv[1])):
        if not label.startswith(f"window@{base} "):
            continue
        s = w["s"]
        rec = dict(n=n, source=source, head=head, sigma=w["sigma"], s=s, keys=w["keys"], window_relf=w["relf"])
        for x in cfg["hybrid_shares"]:
            h = idx.get((n, source, f"hybrid {x:g}@{base} s={s}", head))
            rec[f"hybrid_{x:g}_relf"] = h["relf"] if h else None
            rec[f"hybrid_{x:g}_over_window"] = h["relf"] / w["relf"] if h and w["relf"] > 0 else None
        out.append(rec)
    return out


def bound_rows(heads: List[dict]) -> List[dict]:
    """The window theorem against the measured loss, per (n, source, window c): the largest
    dropped mass over heads and the bound there; the geometric mean over heads of bound / measured
    (mass), and of the output bound ``bound * value range`` over the measured max error."""
    groups: Dict[tuple, List[dict]] = {}
    for r in heads:
        if r["family"] == "window-c":
            groups.setdefault((r["n"], r["source"], r["label"]), []).append(r)
    out = []
    for (n, source, label), rs in sorted(groups.items()):
        ok = [r for r in rs if r["dropped"] > 0 and r["max"] > 0]
        geo = lambda xs: math.exp(_mean([math.log(x) for x in xs])) if xs else None     # noqa: E731
        worst = max(rs, key=lambda r: r["dropped"])
        out.append(dict(n=n, source=source, label=label, dropped=worst["dropped"], bound=worst["bound"],
                        holds=all(r["bound"] >= r["dropped"] * (1 - 1e-9) for r in rs),
                        mass_looseness=geo([r["bound"] / r["dropped"] for r in ok]),
                        output_looseness=geo([r["bound"] * r["value_range"] / r["max"] for r in ok])))
    return out


def csv_of(rows: List[dict]) -> str:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    return csv_text(rows, fields, float_format=".6g")


def _f(x, spec=".3g") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _x(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def markdown(report: dict, rows: List[dict]) -> str:
    cfg, mach = report["config"], report["machine"]
    base, other = cfg["samplers"][0], cfg["samplers"][1:]
    samples = mach.get("load_samples") or []
    during = f", 1-min load at the end of each input {min(samples):.1f}-{max(samples):.1f}" if samples else ""
    lines = ["# Equal-cost frontier: positional LSH vs exact ALiBi cut at a per-head window", "",
             f"Heads {cfg['heads']} (sigma {[round(x, 2) for x in cfg['sigmas']]}), causal={cfg['causal']}, "
             f"s {cfg['samples']}, lengths {cfg['lengths']}, draws {cfg['draws']}, real inputs {cfg['real_inputs']} "
             f"x layers {cfg['layers']} (rope={cfg['rope']}), random logit std {cfg['random_logit_std']} x "
             f"{cfg['random_inputs']}. Errors in float64 against exact ALiBi; keys/query = mean over queries "
             f"of the keys with nonzero weight. Machine: {mach['cpus']} CPUs, {mach['threads']} torch thread(s), "
             f"load average {mach['load_start'][0]:.1f} -> {mach['load_end'][0]:.1f} "
             f"{during} ({mach['seconds'] / 60:.1f} min).", "",
             "## Equal cost (mean absolute error; ratios > 1: the window is more accurate)", "",
             f"`window` is the per-head window with {base}'s keys per query (`keys/query`) and `hybrid` an exact "
             f"band + sampled tail of the same keys; " + "".join(
                 f"`window@{x}` has {x}'s own keys per query (`keys {x}`), so `{x}/window@{x}` is `MAE {x}` / "
                 f"`MAE window@{x}`; " for x in other) + f"`relF` and `max` compare {base} and `window` by their relative "
                 "Frobenius and largest errors.", ""]
    comp = comparison(report, rows)
    head = ["source", "n", "s", "keys/query", f"MAE {base}", "MAE window", "MAE hybrid", f"{base}/window",
            f"relF {base}/window", f"max {base}/window", "hybrid/window"] + \
        [c for x in other for c in (f"keys {x}", f"MAE {x}", f"MAE window@{x}", f"{x}/window@{x}")]
    body = [[r["source"], r["n"], r["s"], _f(r["keys"], ".0f"), _f(r[f"{base}_mae"]), _f(r["window_mae"]),
             _f(r["hybrid_mae"]), _x(r[f"{base}_over_window_mae"]), _x(r[f"{base}_over_window_relf"]),
             _x(r[f"{base}_over_window_max"]), _x(r["hybrid_over_window_mae"])] +
            [c for x in other for c in (_f(r[f"{x}_keys"], ".0f"), _f(r[f"{x}_mae"]), _f(r[f"window@{x}_mae"]),
                                        _x(r[f"{x}_over_window_mae"]))]
            for r in comp]
    lines += [markdown_table(head, body), "", "## CPU time (torch backend, float32, all heads, seconds)", ""]
    timing = report.get("timing")
    if timing:
        t = {(r["n"], r["label"]): r for r in timing["rows"]}
        labels = [f"{sp} s={s}" for s in cfg["samples"] for sp in cfg["samplers"]]
        labels += [f"window@{base} s={s}" for s in cfg["samples"]] + ["exact"]
        lines.append(markdown_table(["n", "method", "seconds"], [
            [n, lab, _f(t[(n, lab)]["seconds"])] for n in cfg["lengths"] for lab in labels if (n, lab) in t]))
        notes = sorted({r["reason"] for r in timing["rows"] if r["seconds"] is None and r["reason"]})
        lines += [""] + [f"Missing: {x}." for x in notes] + [
            "", f"Timing load average {timing['machine']['load_start'][0]:.1f} -> "
            f"{timing['machine']['load_end'][0]:.1f}."]
    else:
        lines.append("Not timed (--no-timing).")
    lines += ["", f"## The hybrid head by head, n >= {HYBRID_N} (the best share's relative Frobenius error / the "
              f"cost-matched window's; < 1: the hybrid wins; sigma >= {WIDE:g})", ""]
    hh = [r for r in hybrid_heads(report, report["heads"]) if r["sigma"] >= WIDE and r["n"] >= HYBRID_N]
    shares = [f"{x:g}" for x in cfg["hybrid_shares"]]
    cells: Dict[tuple, Dict[int, str]] = {}
    for r in hh:
        ratios = [(r[f"hybrid_{x}_over_window"], x) for x in shares if r[f"hybrid_{x}_over_window"] is not None]
        best = min(ratios) if ratios else None
        cells.setdefault((r["source"], r["n"], r["sigma"]), {})[r["s"]] = \
            "exact" if r["window_relf"] == 0 else (f"{best[0]:.2f}x ({best[1]})" if best else "n/a")
    lines.append(markdown_table(["source", "n", "sigma"] + [f"s={s} cost" for s in cfg["samples"]],
                                [[src, n, _f(sig, ".0f")] + [c.get(s, "") for s in cfg["samples"]]
                                 for (src, n, sig), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0],
                                                                                               kv[0][2]))]))
    lines += ["", "## The window bound (poslsh.theory.window_error_bound, R = the head's measured logit range)", "",
              markdown_table(["source", "n", "window", "largest dropped mass", "its bound", "holds",
                              "bound/measured (mass)", "bound/measured (output)"],
                             [[r["source"], r["n"], r["label"], _f(r["dropped"]), _f(r["bound"]),
                               "yes" if r["holds"] else "NO", _x(r["mass_looseness"]), _x(r["output_looseness"])]
                              for r in bound_rows(report["heads"])]), ""]
    return "\n".join(lines)


def comparison_text(report: dict) -> str:
    rows = summary(report["heads"], report.get("timing"))
    return markdown(report, rows).split("## CPU time")[0]


TITLE = "Positional LSH vs exact ALiBi cut at a window (means over heads, inputs, draws)"


def _label_log_axis(axis) -> None:
    """Numbers on a log axis whatever its span: matplotlib labels only powers of ten, so an axis
    inside one decade (a quick run's keys or seconds) had none. Ticks at the first of 1 x 10^k,
    (1, 2, 5), (1, 2, 3, 5), every multiple x 10^k that gives three inside the axis (else a few
    linear steps), as plain numbers (``"20"``, ``"0.05"``)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    ticks: List[float] = []
    for subs in ((1,), (1, 2, 5), (1, 2, 3, 5), range(1, 10)):
        ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in subs if lo <= m * 10.0 ** k <= hi]
        if len(ticks) >= 3:
            break
    if len(ticks) < 2:
        ticks = [t for t in MaxNLocator(nbins=3).tick_values(lo, hi) if lo <= t <= hi]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def plot(report: dict, rows: List[dict], path) -> Path:
    """Write :func:`figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(report, rows)
    atomic_savefig(fig, Path(path), dpi=120)
    plt.close(fig)
    return Path(path)


def figure(report: dict, rows: List[dict]):
    """Log-log relative Frobenius error vs keys per query (top) and vs CPU time (bottom), one column
    per length; real sources (solid: the first layer, dashed: the next) or else the random ones.
    The title is wrapped to the figure's width (one column is narrower than the title)."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    cfg = report["config"]
    lengths = cfg["lengths"]
    sources = sorted({r["source"] for r in rows if r["source"].startswith("layer")}) or \
        sorted({r["source"] for r in rows})
    families = [("iid", "C0", "o"), ("grouped", "C1", "s"), ("window", "C2", "v"), ("window-c", "C2", "^"),
                ("hybrid", "C3", "d")]
    # one cost-matched window and one hybrid keep the figure readable (the tables have them all)
    base = cfg["samplers"][0]
    hidden = {f"window@{x}" for x in cfg["samplers"][1:]} | \
        {f"hybrid {x:g}@{base}" for x in cfg["hybrid_shares"][:-1]}
    width = 4.6 * len(lengths)
    fig, axes = plt.subplots(2, len(lengths), figsize=(width, 7.6), squeeze=False)
    for col, n in enumerate(lengths):
        for si, source in enumerate(sources[:2]):
            style = "-" if si == 0 else "--"
            for fam, color, marker in families:
                groups: Dict[str, List[dict]] = {}
                for r in rows:
                    if r["n"] == n and r["source"] == source and r["family"] == fam:
                        name = "window c-grid" if fam == "window-c" else r["label"].split(" s=")[0]
                        groups.setdefault(name, []).append(r)
                for gi, (name, rs) in enumerate(sorted(groups.items())):
                    if name in hidden:
                        continue
                    rs = sorted(rs, key=lambda r: r["keys"])
                    lab = f"{name} ({source})" if col == 0 else None
                    fill = "none" if gi else color
                    axes[0][col].plot([r["keys"] for r in rs], [r["relf"] for r in rs], style, marker=marker,
                                      color=color, mfc=fill, ms=4, lw=1, label=lab)
                    timed = [r for r in rs if r.get("seconds")]
                    if timed:
                        axes[1][col].plot([r["seconds"] for r in timed], [r["relf"] for r in timed], style,
                                          marker=marker, color=color, mfc=fill, ms=4, lw=1)
        axes[0][col].set_title(f"n = {n}")
        axes[0][col].set_xlabel("keys per query")
        axes[1][col].set_xlabel("CPU seconds (torch backend, all heads)")
        missing = sorted({r["time_note"] for r in rows if r["n"] == n and r["seconds"] is None and r["time_note"]})
        if any("window" in m for m in missing):
            axes[1][col].text(0.02, 0.02, "window: no torch time in this build", transform=axes[1][col].transAxes,
                              fontsize=7)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.2)
            if ax.has_data():
                _label_log_axis(ax.xaxis)
                _label_log_axis(ax.yaxis)
    for ax in axes[:, 0]:
        ax.set_ylabel("relative Frobenius error vs exact ALiBi")
    axes[0][0].legend(fontsize=6, loc="lower left")
    fig.suptitle(textwrap.fill(TITLE, width=max(30, int(8.5 * width))))    # ~8.5 characters per inch at 12 pt
    fig.tight_layout()
    return fig
