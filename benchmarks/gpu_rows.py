"""Result rows of the GPU scripts, written the moment they are measured.

Every row goes to ``results.md`` (a Markdown table) and ``results.csv`` in the output folder,
each as one ``write`` on a file opened for appending, so parallel processes (the test shards)
never interleave inside a row and a stage killed by its time limit loses nothing it measured.
The headers are written once by the shell script that starts the stages (``gpu_stages.sh``).
No torch import here: the pytest plugin and the shell-side tools use it too.
"""
from __future__ import annotations

import csv
import io
import os
import sys
from typing import Optional

COLUMNS = ["stage", "item", "n", "mode", "result", "value", "unit", "detail"]


def _cell(x) -> str:
    return str(x).replace("\n", " ").strip()


def _md(x) -> str:
    return _cell(x).replace("|", "\\|")


class Recorder:
    """Appends rows to ``<out>/results.md`` and ``<out>/results.csv`` and echoes them."""

    def __init__(self, out: str, stage: str):
        self.out, self.stage = out, stage
        os.makedirs(out, exist_ok=True)
        self.failures = 0

    def _append(self, name: str, text: str) -> None:
        fd = os.open(os.path.join(self.out, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def row(self, item: str, result: str, value: Optional[float] = None, unit: str = "", *, n="", mode="",
            detail: str = "", fatal: bool = True, quiet: bool = False) -> None:
        """One result. ``result``: ``ok``/``PASS``/``FAIL``/``error``/``oom``/``skipped``/``unavailable``/
        ``info``/``passed``/``failed``; with ``fatal``, FAIL, error, oom and failed count as failures
        of the stage. ``quiet``: not echoed (the caller printed it)."""
        shown = "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        fields = [self.stage, item, n, mode, result, shown, unit, detail]
        self._append("results.md", "| " + " | ".join(_md(f) for f in fields) + " |\n")
        buf = io.StringIO()
        csv.writer(buf).writerow([_cell(f) for f in fields])
        self._append("results.csv", buf.getvalue())
        if fatal and result in ("FAIL", "error", "oom", "failed"):
            self.failures += 1
        if not quiet:
            print(f"[{self.stage}] {item} {n} {mode}: {result} {shown} {unit} {detail}".rstrip(), flush=True)


def header(out: str, title: str, lines) -> None:
    """Start (or truncate) the two result files with a title, free lines and the table heads."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# {title}\n\n" + "".join(f"{line}\n" for line in lines) + "\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        csv.writer(f).writerow(COLUMNS)


# the order a stage's counts are said in: what went wrong first
ORDER = ("FAIL", "error", "oom", "failed", "timed out", "PASS", "ok", "passed", "unavailable", "skipped", "info")


def _last_error(log: str) -> str:
    """The line of a stage's log that says why it stopped: the last one naming an error, else the last."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip() and not line.startswith("[")]
    except OSError:
        return ""
    named = [line for line in lines if "Error" in line or "error:" in line or "No module named" in line]
    return (named or lines or [""])[-1][:300]


def summary(out: str, stage: str, log: str = "", rc: int = 0) -> str:
    """One line on a stage: its rows counted by result, the first thing that went wrong (or, with no
    failing row and a non-zero exit status, the log's last error line), and why rows were unavailable."""
    try:
        with open(os.path.join(out, "results.csv"), newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["stage"] == stage and r["item"] != f"stage {stage}"]
    except OSError:
        rows = []
    counts = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    said = ", ".join(f"{counts[k]} {k}" for k in sorted(counts, key=lambda k: (ORDER + (k,)).index(k)))
    parts = [said or "no rows"]
    bad = [r for r in rows if r["result"] in ("FAIL", "error", "oom", "failed")]
    if bad:
        parts.append(f"first: {bad[0]['item']} {bad[0]['n']} {bad[0]['mode']}".rstrip() + f": {bad[0]['detail']}"[:300])
    elif rc not in (0, 124, 137) and log:
        parts.append(f"why: {_last_error(log)}")
    # each reason up to its first parenthesis (the row in results.md has it whole)
    why = list(dict.fromkeys(r["detail"].split(" (")[0] if len(r["detail"].split(" (")[0]) >= 20 else r["detail"]
                             for r in rows if r["result"] == "unavailable" and r["detail"]))
    if why:
        parts.append(f"unavailable: {why[0]}" + (f" (and {len(why) - 1} other reasons)" if len(why) > 1 else ""))
    return "; ".join(parts)


def main(argv) -> int:
    """``header OUT TITLE [LINE...]``, ``row OUT STAGE ITEM RESULT [VALUE [UNIT [DETAIL]]]`` or
    ``summary OUT STAGE [LOG [EXIT_STATUS]]`` (from the shell)."""
    if argv[:1] == ["header"] and len(argv) >= 3:
        header(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["summary"] and len(argv) >= 3:
        print(summary(argv[1], argv[2], *(argv[3:4]), *(int(x) for x in argv[4:5])))
        return 0
    if argv[:1] == ["row"] and len(argv) >= 5:
        out, stage, item, result, *rest = argv[1:]
        value, unit, detail = (rest + ["", "", ""])[:3]
        Recorder(out, stage).row(item, result, float(value) if value else None, unit, detail=detail, quiet=True)
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
