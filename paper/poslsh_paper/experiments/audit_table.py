"""The table of ``poslsh audit``: one row per check and subject, PASS / FAIL /
SKIPPED, and where its numbers come from (``source``: this run, or another run's
file, named, when they were not produced by this run), plus the summary line."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import List, Optional, Tuple

from poslsh_paper.io import markdown_table
from poslsh_paper.experiments.model_inputs import is_reference

__all__ = ["TABLE_FIELDS", "THIS_RUN", "AUTO_ROWS", "table_row", "skipped_row", "reused_source",
           "read_convergence_rows", "format_table", "summary_line"]

TABLE_FIELDS = ["check", "subject", "statistic", "bound", "trials", "violations", "allowed", "result", "note",
                "source"]
THIS_RUN = "this run"
# --convergence-rows auto: the user's own `poslsh convergence` run first, else the committed reference
AUTO_ROWS = ("outputs/convergence/rows.csv", "results/convergence/rows.csv")


def table_row(check, subject, statistic, bound, trials, violations, allowed, ok, note="", source=THIS_RUN):
    return dict(check=check, subject=subject, statistic=statistic, bound=bound, trials=trials,
                violations=violations, allowed=allowed, result="PASS" if ok else "FAIL", note=note, source=source)


def skipped_row(check: str, why: str) -> dict:
    return dict(check=check, subject="all heads", statistic="", bound="", trials=0, violations="", allowed="",
                result="SKIPPED", note=why, source="")


def reused_source(path) -> str:
    """The ``source`` of rows computed from another run's file: which file, and that it
    was not produced by this run."""
    whose = "committed" if is_reference(path) else "an earlier run"
    return f"from {path} ({whose}, not produced by this run)"


def read_convergence_rows(path: Path) -> Optional[Tuple[List[dict], int]]:
    """The records of a convergence run's ``rows.csv`` (typed), and its ``n``."""
    if not path.is_file():
        return None
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    out = []
    for r in rows:
        rec = dict(r)
        for k in ("input", "layer", "head", "kv_head", "s", "n", "b_max"):
            rec[k] = int(rec[k])
        for k in ("sigma", "spectral", "max", "t_err", "beta_star", "p_2inf", "v_max"):
            rec[k] = float(rec[k])
        rec["sampler"] = rec.get("sampler") or "iid"       # runs before samplers were measured: i.i.d.
        rec["groups"] = float(rec["groups"]) if rec.get("groups") else float(rec["s"])
        rec["draw"] = rec["input"]          # independent draws per input there
        out.append(rec)
    return out, out[0]["n"]


def format_table(table: List[dict], *, markdown: bool = False) -> str:
    """The check table as aligned plain text, or as a Markdown table."""
    cells = [[str(r.get(c, "")) for c in TABLE_FIELDS] for r in table]
    if markdown:
        return markdown_table(TABLE_FIELDS, [[c.replace("|", "\\|") for c in row] for row in cells])
    width = [max([len(c)] + [len(row[j]) for row in cells]) for j, c in enumerate(TABLE_FIELDS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(TABLE_FIELDS, width)), "  ".join("-" * w for w in width)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in cells]
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    """``all N checks passed`` only when nothing failed or was skipped; else the counts,
    what was skipped and why, and which rows were not produced by this run."""
    c, table = result["counts"], result["table"]
    if c["failed"] == 0 and c["skipped"] == 0:
        head = f"all {c['passed']} checks passed"
    else:
        head = f"{c['passed']} passed, {c['failed']} FAILED, {c['skipped']} SKIPPED"
    parts = [head] + [f"SKIPPED {r['check']}: {r['note']}" for r in table if r["result"] == "SKIPPED"]
    reused = [r for r in table if r.get("source") not in (THIS_RUN, "")]
    if reused:
        parts.append(f"{len(reused)} rows computed {reused[0]['source']}")
    return "audit: " + "; ".join(parts)
