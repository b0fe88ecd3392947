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
            detail: str = "", fatal: bool = True) -> None:
        """One result. ``result``: ``ok``/``PASS``/``FAIL``/``error``/``oom``/``skipped``/``unavailable``/
        ``info``/``passed``/``failed``; with ``fatal``, FAIL, error, oom and failed count as failures
        of the stage."""
        shown = "" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        fields = [self.stage, item, n, mode, result, shown, unit, detail]
        self._append("results.md", "| " + " | ".join(_md(f) for f in fields) + " |\n")
        buf = io.StringIO()
        csv.writer(buf).writerow([_cell(f) for f in fields])
        self._append("results.csv", buf.getvalue())
        if fatal and result in ("FAIL", "error", "oom", "failed"):
            self.failures += 1
        print(f"[{self.stage}] {item} {n} {mode}: {result} {shown} {unit} {detail}".rstrip(), flush=True)


def header(out: str, title: str, lines) -> None:
    """Start (or truncate) the two result files with a title, free lines and the table heads."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# {title}\n\n" + "".join(f"{line}\n" for line in lines) + "\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
    with open(os.path.join(out, "results.csv"), "w", newline="") as f:
        csv.writer(f).writerow(COLUMNS)


def main(argv) -> int:
    """``header OUT TITLE [LINE...]`` or ``row OUT STAGE ITEM RESULT [VALUE [UNIT [DETAIL]]]`` (from the shell)."""
    if argv[:1] == ["header"] and len(argv) >= 3:
        header(argv[1], argv[2], argv[3:])
        return 0
    if argv[:1] == ["row"] and len(argv) >= 5:
        out, stage, item, result, *rest = argv[1:]
        value, unit, detail = (rest + ["", "", ""])[:3]
        Recorder(out, stage).row(item, result, float(value) if value else None, unit, detail=detail)
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
