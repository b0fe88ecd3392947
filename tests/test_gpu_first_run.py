"""The first GPU run's script (benchmarks/gpu_first_run.sh), without a GPU: its dry run goes
through every stage's code on the CPU, its budget check refuses limits over 330 s, and a stage
that fails or runs out of time makes the script fail while the rows measured before stay."""
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/gpu_first_run.sh"
STAGES = ["warm", "check", "t128k", "t32k", "tests"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash script")


def _run(*args, env=None, timeout=900):
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full.pop("OUT", None)
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _rows(out: Path):
    md = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")][1:]
    with open(out / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(md) == len(table), "results.md and results.csv disagree"
    return table


def test_dry_run_goes_through_every_stage(tmp_path):
    """Every stage runs on the CPU and says ok; the checks pass against the float64 oracle; every
    timed method has a row per mode (ok, or the reason it cannot run); every GPU test a row."""
    pytest.importorskip("triton")
    r = _run("--dry-run", "--out", str(tmp_path))
    print(r.stdout[-3000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = _rows(tmp_path)
    verdict = {x["stage"]: x["result"] for x in rows if x["item"] == f"stage {x['stage']}"}
    assert verdict == {s: "ok" for s in STAGES}
    checks = {x["item"]: x["result"] for x in rows if x["stage"] == "check"}
    for item in ("poslsh-triton out", "poslsh-triton dq", "poslsh-triton dk", "poslsh-triton dv",
                 "poslsh-flex out", "poslsh-flex lse", "window-flex out",
                 "poslsh-triton deterministic (two runs bitwise equal)"):
        assert checks.get(item) == "PASS", (item, checks.get(item))
    for stage in ("t128k", "t32k"):
        timed = {(x["item"], x["mode"]): x["result"] for x in rows if x["stage"] == stage}
        assert timed[("poslsh-triton last 64 rows vs float64", "fwd")] == "PASS"
        for method in ("poslsh-triton", "window-flex", "exact-flex", "window-triton", "sdpa-flash"):
            for mode in ("fwd", "fwd+bwd"):
                assert timed[(method, mode)] in ("ok", "skipped", "unavailable"), (stage, method, mode)
        assert timed[("poslsh-triton", "fwd+bwd")] == "ok" and timed[("sdpa-flash", "fwd+bwd")] == "ok"
        assert any(item.startswith("target: exact ALiBi (flex) / poslsh-triton") for item, _ in timed)
    tests = [x for x in rows if x["stage"] == "tests" and x["item"].startswith("tests/")]
    assert tests and all(x["result"] == "skipped" for x in tests)          # no CUDA here
    assert any("test_triton.py::test_gpu_long_sequence_runs" in x["item"] for x in tests)
    assert "DRY RUN" in (tmp_path / "results.md").read_text().splitlines()[0]


def test_budget_is_checked_before_anything_runs(tmp_path):
    r = _run("--check-budget")
    assert r.returncode == 0, r.stderr
    total = int(re.search(r"= (\d+) s of at most 330 s", r.stdout).group(1))
    limits = [int(x) for x in re.findall(r"(\d+)\+2 \(", r.stdout)]
    print(r.stdout)
    assert total <= 330 and total == sum(limits) + 2 * len(limits) and len(limits) == len(STAGES)
    r = _run("--dry-run", "--out", str(tmp_path), "--limits", "warm=100")
    assert r.returncode == 2 and "refusing to start" in r.stderr and "355 s > 330 s" in r.stderr
    assert not (tmp_path / "results.md").exists()
    assert _run("--limits", "nosuchstage=3").returncode == 2
    more = subprocess.run(["bash", "benchmarks/gpu_more.sh", "--check-budget"], cwd=REPO, capture_output=True,
                          text=True)
    assert more.returncode == 0 and "of at most 330 s" in more.stdout


def test_a_failing_stage_fails_the_script(tmp_path):
    """A stage whose program fails (here: the interpreter is `false`) is reported as failed, the
    next stage still runs, and the script's exit status is 1."""
    r = _run("--dry-run", "--out", str(tmp_path), "--stages", "check,t32k", env={"PYTHON": "false"})
    assert r.returncode == 1, r.stdout
    assert "FAILED stages: check t32k" in r.stdout


def test_a_stage_past_its_limit_keeps_what_it_measured(tmp_path):
    """The stage runner: a command that writes a row and then runs past its limit is stopped,
    recorded as timed out, and its row is still in both files."""
    cmd = f"""
      source benchmarks/gpu_stages.sh
      DEST={tmp_path}; PYTHON={sys.executable}
      {sys.executable} benchmarks/gpu_rows.py header "$DEST" title
      stage slow 1 bash -c '{sys.executable} benchmarks/gpu_rows.py row "$0" slow measured ok 1.5 ms; sleep 30' "$DEST"
      echo "failed:$FAILED"
    """
    r = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=60)
    print(r.stdout, r.stderr)
    assert "failed: slow" in r.stdout
    rows = _rows(tmp_path)
    assert [(x["item"], x["result"]) for x in rows] == [("measured", "ok"), ("stage slow", "timed out")]
    assert rows[0]["value"] == "1.5"
