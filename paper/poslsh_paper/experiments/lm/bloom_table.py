"""``poslsh table --preset cpu-bloom``: train transformers' BLOOM short, evaluate it long, every way.

A BLOOM table trains one model per seed (``--method original``: transformers' eager attention, BLOOM's own
ALiBi) and evaluates those same weights as each of its other methods (:mod:`.bloom`: exact ALiBi, the
certified window, the cost-matched window, positional LSH, all through ``patch_alibi``): one
``eval-<split>-as-<method>.json`` next to each seed's run. The table (``table.md/csv/json``), one JSON per
run and evaluation, and the plot of perplexity against context go to ``<out>/<preset>/``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from poslsh_paper.io import atomic_write_text, markdown_table
from poslsh_paper.experiments.sweep import mean_std, read_json, write_table_files
from poslsh_paper.experiments.lm.config import TrainConfig, check, method_label, run_dir
from poslsh_paper.experiments.lm.include import describe
from poslsh_paper.experiments.lm.table import table_dir

__all__ = ["LABELS", "eval_path", "evaluate_as", "collect", "aggregate", "bloom_findings", "render_markdown",
           "run_bloom_table", "machine"]

LABELS = {"original": "transformers eager (unpatched)", "alibi": "patch_alibi exact"}
CSV_FIELDS = ["method", "label", "length", "context", "seeds", "ppl_mean", "ppl_std", "acc_mean", "skipped"]
# A window "leaves the PPL as exact ALiBi's" when every seed moves by at most this much (%).
SAME = 0.1


def label(method: str) -> str:
    return LABELS.get(method) or method_label(method) + " (patch_alibi)"


def machine() -> str:
    """CPU model, cores and the 1-minute load (what the evaluation shared the machine with)."""
    cpu = "unknown CPU"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def trained_run(cfg: TrainConfig, seed: int) -> Path:
    """The run directory of the seed's trained BLOOM (method original)."""
    return run_dir(replace(cfg, method="original", seed=seed))


def eval_path(cfg: TrainConfig, method: str, seed: int) -> Path:
    """Where the trained BLOOM of ``seed`` evaluated as ``method`` is filed (as ``poslsh eval`` files it)."""
    return trained_run(cfg, seed) / f"eval-{cfg.eval_split}-as-{method}.json"


def patched_stats(model) -> Optional[list]:
    """What ``patch_alibi`` reports per layer (:func:`poslsh.integrations.hf.alibi_stats`: the windows of
    the last call, certified windows with their logit range); None for the unpatched model."""
    from poslsh.integrations import hf

    try:
        return json.loads(json.dumps(hf.alibi_stats(model)))
    except ValueError:      # not patched
        return None


def library_version() -> dict:
    """Which ``poslsh`` evaluated: its directory and that checkout's git commit (None outside git)."""
    import subprocess

    import poslsh
    where = Path(poslsh.__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        head = None
    return {"path": str(where), "commit": head}


def evaluate_as(cfg: TrainConfig, method: str, seed: int, progress: bool = False) -> dict:
    """Evaluate the trained BLOOM of ``seed`` as ``method``; the result is written to :func:`eval_path`."""
    from poslsh_paper.experiments.checkpoints import latest_checkpoint
    from poslsh_paper.experiments.lm.checkpoint import load_strict
    from poslsh_paper.experiments.lm.evaluation import evaluate
    from poslsh_paper.experiments.lm.model import Dist, build_model, load_data, trainable_parameters

    from poslsh.threads import intra_op_threads

    run = replace(cfg, method=method, seed=seed)
    check(run)
    ckpt = latest_checkpoint(trained_run(cfg, seed))
    dist = Dist(cfg.device)
    with intra_op_threads(cfg.threads):
        data = load_data(run, dist)
        model = build_model(run, data.vocab_size, data.tokenizer.separator_id).to(dist.device)
        load_strict(ckpt, trainable_parameters(model), run)
        load, t0 = os.getloadavg()[0], time.perf_counter()
        res = {"method": method, "seed": seed, "pack": False, "documents": False, "checkpoint": str(ckpt),
               "split": cfg.eval_split, "eval_settings": eval_settings(cfg),
               "eval": evaluate(model, data.splits[cfg.eval_split], run, dist, progress=progress)}
    res.update(seconds=round(time.perf_counter() - t0, 1), machine=machine(), load_start=round(load, 2),
               load_end=round(os.getloadavg()[0], 2), threads=cfg.threads, library=library_version(),
               attention=patched_stats(model))
    atomic_write_text(eval_path(cfg, method, seed), json.dumps(res, indent=1))
    return res


EVAL_FIELDS = ("eval_split", "eval_tokens", "eval_multipliers", "eval_full_context")


def eval_settings(cfg) -> dict:
    """What decides an evaluation's numbers besides the weights and the method (a record of other settings
    is not this table's: it is evaluated again)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(cfg, k)) for k in EVAL_FIELDS)}


def _record(cfg: TrainConfig, method: str, seed: int) -> Optional[tuple]:
    """``(path, record)`` of ``method`` x ``seed`` evaluated with this table's settings, or None. The trained
    run's own ``result.json`` stands for ``original`` when its recorded evaluation settings are the table's."""
    r = read_json(eval_path(cfg, method, seed))
    if r and r.get("eval") and r.get("eval_settings") == eval_settings(cfg):
        return eval_path(cfg, method, seed), r
    if method == "original":
        path = trained_run(cfg, seed) / "result.json"
        r = read_json(path)
        if r and r.get("eval") and {k: (r.get("config") or {}).get(k) for k in EVAL_FIELDS} == eval_settings(cfg):
            return path, r
    return None


def collect(cfg: TrainConfig, methods: Sequence[str], seeds: Sequence[int]) -> List[dict]:
    """``[{"method", "seed", "eval", ...}]`` of the finished runs and evaluations of this table's settings."""
    out = []
    for seed in seeds:
        for m in methods:
            found = _record(cfg, m, seed)
            path, r = found if found else (None, None)
            if r and r.get("eval"):
                out.append({**{k: v for k, v in r.items() if k != "config"}, "method": m, "seed": seed,
                            "file": str(path)})
    return out


def aggregate(records: List[dict], methods: Sequence[str]) -> List[dict]:
    """One row per (method, length): PPL mean and sample std over the seeds, each seed's PPL; lengths a
    mode did not run carry the reason (``skipped``)."""
    rows = []
    for m in methods:
        runs = [r for r in records if r["method"] == m]
        if not runs:
            continue
        for k, first in runs[0]["eval"].items():
            done = [r for r in runs if "ppl" in r["eval"].get(k, {})]
            row = {"method": m, "label": label(m), "length": k, "context": first["context"], "seeds": len(done),
                   "skipped": first.get("skipped", "")}
            if done:
                ppl, sd = mean_std([r["eval"][k]["ppl"] for r in done])
                row.update(ppl_mean=ppl, ppl_std=sd, acc_mean=mean_std([r["eval"][k]["acc"] for r in done])[0],
                           tokens=done[0]["eval"][k]["tokens"], ppl_by_seed={r["seed"]: r["eval"][k]["ppl"] for r in done},
                           seconds_by_seed={r["seed"]: r["eval"][k]["seconds"] for r in done})
            rows.append(row)
    return rows


def _get(rows, method, length):
    return next((r for r in rows if r["method"] == method and r["length"] == length and "ppl_by_seed" in r), None)


def _gaps(a: dict, b: dict) -> List[float]:
    """``a``'s PPL over ``b``'s (%), seed by seed."""
    return [100.0 * (a["ppl_by_seed"][s] / b["ppl_by_seed"][s] - 1.0) for s in sorted(a["ppl_by_seed"])
            if s in b["ppl_by_seed"]]


def _pct(gaps: List[float]) -> str:
    return ", ".join(f"{g:+.4f}%" for g in gaps)


def bloom_findings(rows: List[dict]) -> List[str]:
    """The measured answers: does exact ALiBi extrapolate (PPL at each length against the training
    length, seed by seed), does each window or positional LSH change it, does the patch reproduce eager."""
    out = []
    lengths = sorted({r["length"] for r in rows}, key=lambda s: int(s[:-1]))
    base = _get(rows, "alibi", lengths[0]) if lengths else None
    if base:
        for k in lengths[1:]:
            r = _get(rows, "alibi", k)
            if r:
                g = _gaps(r, base)
                verdict = "below" if max(g) < 0 else "above" if min(g) > 0 else "on both sides of"
                out.append(f"Extrapolation, exact ALiBi at context {r['context']}: PPL {r['ppl_mean']:.3f} against "
                           f"{base['ppl_mean']:.3f} at the training length {base['context']}, {verdict} it in every "
                           f"seed ({_pct(g)}).")
    for m in [m for m in dict.fromkeys(r["method"] for r in rows) if m not in ("alibi", "original")]:
        parts, worst = [], 0.0
        for k in lengths:
            a, b = _get(rows, m, k), _get(rows, "alibi", k)
            if a and b:
                g = _gaps(a, b)
                worst = max([worst] + [abs(x) for x in g])
                parts.append(f"{a['context']}: {_pct(g)}")
        if parts:
            same = "within" if worst <= SAME else "NOT within"
            out.append(f"{label(m)} against exact ALiBi, PPL change per seed by context ({'; '.join(parts)}): "
                       f"{same} {SAME}% at every length (largest {worst:.3f}%).")
    eager = [(_get(rows, "original", k), _get(rows, "alibi", k)) for k in lengths]
    g = [abs(x) for a, b in eager if a and b for x in _gaps(b, a)]
    if g:
        out.append(f"patch_alibi exact against transformers' eager BLOOM at every context eager ran: largest PPL "
                   f"difference {max(g):.1e}%.")
    return out


def render_markdown(rows: List[dict], meta: dict) -> str:
    lengths = sorted({r["length"] for r in rows}, key=lambda s: int(s[:-1]))
    ctx = {r["length"]: r["context"] for r in rows}
    seeds = sorted({s for r in rows for s in r.get("ppl_by_seed", {})}, key=int)
    head = ["Attention", "Seeds"] + [f"PPL @{ctx[k]}" + (" (training)" if i == 0 else "") for i, k in enumerate(lengths)]
    body = []
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = [label(m), str(max(r["seeds"] for r in rows if r["method"] == m))]
        for k in lengths:
            r = next((r for r in rows if r["method"] == m and r["length"] == k), None)
            if r is None:
                cells.append("")
            elif "ppl_by_seed" not in r:
                cells.append("not run (n x n scores over the memory limit)" if r["skipped"] else "")
            else:
                per = " / ".join(f"{r['ppl_by_seed'][s]:.3f}" for s in seeds if s in r["ppl_by_seed"])
                cells.append(f"{r['ppl_mean']:.3f} ({per})")
        body.append(cells)
    lines = [f"# {meta['title']}", ""]
    for key in ("command", "setup", "evaluation", "machine"):
        if meta.get(key):
            lines += [f"{key.capitalize()}: {meta[key]}", ""]
    lines += [markdown_table(head, body), "",
              f"Mean over seeds, then each seed's PPL (seeds {' / '.join(map(str, seeds))}).", ""]
    skipped = {r["skipped"] for r in rows if r.get("skipped")}
    lines += [f"- {s}" for s in sorted(skipped)] + ([""] if skipped else [])
    lines += _windows_and_seconds(rows, meta.get("windows") or {})
    if meta.get("findings"):
        lines += ["## Findings, as measured", ""] + [f"- {f}" for f in meta["findings"]] + [""]
    return "\n".join(lines)


def windows_of(records: List[dict]) -> Dict[str, list]:
    """``{method: [[window per head] per layer]}`` of the first seed's patched runs that used windows
    (certified: those of the last, longest call)."""
    out = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        st = r.get("attention") or []
        if r["method"] not in out and st and st[0].get("window") is not None:
            out[r["method"]] = [x["window"] for x in st]
    return out


def _windows_and_seconds(rows: List[dict], windows: Dict[str, list]) -> List[str]:
    lines = []
    for m, w in windows.items():
        same = all(x == w[0] for x in w)
        lines.append(f"- {label(m)}: windows per head " + (f"{w[0]} in every layer" if same else
                     "; ".join(f"layer {i}: {x}" for i, x in enumerate(w))) + ".")
    lengths = sorted({r["length"] for r in rows}, key=lambda s: int(s[:-1]))
    ctx = {r["length"]: r["context"] for r in rows}
    body = []
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = [label(m)]
        for k in lengths:
            r = next((r for r in rows if r["method"] == m and r["length"] == k and "seconds_by_seed" in r), None)
            cells.append(" / ".join(f"{v:.0f}" for v in r["seconds_by_seed"].values()) if r else "")
        body.append(cells)
    if lines:
        lines.append("")
    return lines + ["Evaluation wall seconds per context (each seed; one thread per run, on the shared machine named "
                    "above: indicative only):", "", markdown_table(["Attention"] + [f"@{ctx[k]}" for k in lengths],
                                                                    body), ""]


def run_bloom_table(cfg: TrainConfig, methods: Sequence[str], seeds: Sequence[int], results_dir: Path, *,
                    progress: bool = True, command: str = "", train_missing: bool = True) -> List[dict]:
    """Train each seed's BLOOM (resuming), evaluate it as every other method (missing evaluations only),
    write the table, the per-run JSON and the plot. Returns the collected records."""
    from poslsh_paper.experiments.lm.loop import train
    from poslsh_paper.experiments.plots import plot_ppl_vs_context

    if train_missing:
        for seed in seeds:
            if read_json(trained_run(cfg, seed) / "result.json") is None:
                train(replace(cfg, method="original", seed=seed), resume=True, progress=progress)
            for m in methods:
                if _record(cfg, m, seed) is None:
                    if progress:
                        print(f"evaluating seed {seed} as {m}", file=sys.stderr)
                    evaluate_as(cfg, m, seed, progress=progress)
    records = collect(cfg, methods, seeds)
    if not records:
        return records
    rows = aggregate(records, methods)
    out = table_dir(Path(results_dir), cfg)
    found = bloom_findings(rows)
    machines = sorted({r["machine"] for r in records if r.get("machine")})
    meta = {"title": f"Train short, test long on transformers' BLOOM: preset `{cfg.preset}`",
            "command": f"`{command}`" if command else "", **describe(cfg, records), "findings": found,
            "machine": "; ".join(machines), "windows": windows_of(records)}
    meta["evaluation"] = (f"{cfg.eval_split} split; at every context the same {rows[0].get('tokens', 0):,} target "
                          f"tokens, each scored as one of the last {cfg.seq_len} of a window of that context (so "
                          f"each has at least context - {cfg.seq_len} tokens before it); positional LSH with fixed "
                          "partitions seeded by the run's seed.")
    for r in records:
        atomic_write_text(out / "runs" / f"seed{r['seed']}" / f"{r['method']}.json", json.dumps(r, indent=1))
    write_table_files(out, render_markdown(rows, meta), rows, CSV_FIELDS, {"meta": meta, "rows": rows, "runs": records})
    plot_ppl_vs_context(rows, out / "ppl_vs_context.png", title=meta["title"])
    return records
