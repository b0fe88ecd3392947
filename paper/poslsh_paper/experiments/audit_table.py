"""The table of ``poslsh audit``: one row per check and subject, PASS / FAIL /
SKIPPED, and where its numbers come from (``source``: this run, or another run's
file, named, when they were not produced by this run), plus the summary line.

A check with no trials (never applicable to this subject) is SKIPPED, not PASS. On the
terminal the table is a report of one short block per row, at most 100 columns wide
(:func:`format_report`); ``audit.md`` / ``audit.csv`` keep every column."""
from __future__ import annotations

import csv
import textwrap
from pathlib import Path
from typing import List, Optional, Tuple

from poslsh_paper.io import markdown_table
from poslsh_paper.experiments.model_inputs import is_reference

__all__ = ["TABLE_FIELDS", "THIS_RUN", "table_row", "skipped_row", "reused_source", "read_convergence_rows",
           "format_table", "format_report", "summary_line", "WIDTH"]

TABLE_FIELDS = ["check", "subject", "statistic", "bound", "trials", "violations", "allowed", "result", "note",
                "source"]
THIS_RUN = "this run"
WIDTH = 100           # the printed report's width


def table_row(check, subject, statistic, bound, trials, violations, allowed, ok, note="", source=THIS_RUN):
    """One row; ``ok`` decides PASS / FAIL, except that a check with 0 trials is SKIPPED (it
    tested nothing)."""
    result = "SKIPPED" if trials == 0 else "PASS" if ok else "FAIL"
    return dict(check=check, subject=subject, statistic=statistic, bound=bound, trials=trials,
                violations=violations, allowed=allowed, result=result, note=note, source=source)


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


def _wrap(text: str, indent: str, first: str = "") -> list:
    return textwrap.wrap(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)


def format_report(table: List[dict]) -> str:
    """The check table for the terminal: per row a ``RESULT  check | subject`` line and its
    numbers (statistic, bound, trials and violations, note, source) wrapped below it."""
    lines = []
    for r in table:
        lines += _wrap(f"{r['check']} | {r['subject']}", " " * 9, f"{r['result']:<8} ")
        counts = ""
        if r.get("trials") not in ("", None):
            counts = f"{r['trials']} trials"
            if r.get("violations") not in ("", None):
                counts += f", {r['violations']} violations (allowed {r['allowed']})"
        source = r.get("source")
        facts = [r.get("statistic"), f"bound {r['bound']}" if r.get("bound") else "", counts, r.get("note"),
                 f"source: {source}" if source not in (THIS_RUN, "", None) else ""]
        text = "; ".join(str(x) for x in facts if x)
        if text:
            lines += _wrap(text, " " * 9)
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    """``all N checks passed`` only when nothing failed or was skipped; else the counts,
    what was skipped and why (rows of one check and reason together), and which rows were
    not produced by this run."""
    c, table = result["counts"], result["table"]
    if c["failed"] == 0 and c["skipped"] == 0:
        head = f"all {c['passed']} checks passed"
    else:
        head = f"{c['passed']} passed, {c['failed']} FAILED, {c['skipped']} SKIPPED"
    skipped = {}
    for r in table:
        if r["result"] == "SKIPPED":
            reason = r["note"].split(":")[0] if r["subject"] != "all heads" else r["note"]
            skipped.setdefault((r["check"], reason), []).append(r["subject"])
    parts = [head]
    for (check, reason), subjects in skipped.items():
        which = "" if subjects == ["all heads"] else f" ({', '.join(s.split(',')[0] for s in subjects)})"
        parts.append(f"SKIPPED {check}{which}: {reason}")
    reused = [r for r in table if r.get("source") not in (THIS_RUN, "")]
    if reused:
        parts.append(f"{len(reused)} rows computed {reused[0]['source']}")
    return "audit: " + "; ".join(parts)
