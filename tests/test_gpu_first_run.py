"""The first GPU run's script (benchmarks/gpu_first_run.sh), without a GPU: its dry run goes through every
stage's code on the CPU, one line per stage; its stage list (a stage reserved for code not yet in the
tree) fits the budget, which refuses more; a stage that fails or runs out of time is said in one line while
the next runs and the rows measured before stay; it finds the project's interpreter itself (.venv after
`make demo`, else python3) and puts the carried wheels (.gpu/, `make gpu-bundle`) first on the path."""
import csv
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "benchmarks/gpu_first_run.sh"
STAGES = ["warm", "check", "t128k", "t32k", "models", "cache", "encoders", "decode", "tests"]
RESERVED = []
BUDGET = 540

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="bash script")


def _run(*args, env=None, timeout=900, script=SCRIPT, cwd=REPO):
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    full.pop("OUT", None)
    return subprocess.run(["bash", script, *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout)


def _rows(out: Path):
    md = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| ")][1:]
    with open(out / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(md) == len(table), "results.md and results.csv disagree"
    return table


def _interpreter_problem():
    """What the dry run says of Triton's interpreter here (the tests' own skip reason), or None."""
    pytest.importorskip("triton")
    from poslsh.ops.triton import _config
    return _config.interpreter_problem()


def _transformers_ok() -> bool:
    try:
        from poslsh.integrations import require_transformers
        require_transformers()
    except ImportError:
        return False
    return True


def test_dry_run_goes_through_every_stage(tmp_path):
    """Every stage runs on the CPU, says ok (the reserved ones: skipped) in one line; the checks pass
    against the float64 oracle (or, where Triton's interpreter cannot run, say why once and mark the
    Triton rows unavailable); every timed method has a row per mode; the patched BLOOM and the per-head
    cache pass against float64; every GPU test has a row."""
    problem = _interpreter_problem()
    r = _run("--dry-run", "--out", str(tmp_path))
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    for s in STAGES:                                       # one line per stage, in the stage list's order
        assert sum(line.startswith(f"stage {s}: ") for line in lines) == 1, s
    said = [line.split(":")[0] for line in lines if line.startswith("stage ")]
    assert said == [f"stage {s}" for s in STAGES]
    rows = _rows(tmp_path)
    verdict = {x["stage"]: x["result"] for x in rows if x["item"] == f"stage {x['stage']}"}
    assert verdict == {s: "skipped" if s in RESERVED else "ok" for s in STAGES}
    env = {x["item"]: x for x in rows if x["stage"] == "env"}
    assert "torch" in env["versions"]["detail"] and "transformers" in env["versions"]["detail"]
    checks = {x["item"]: x for x in rows if x["stage"] == "check"}
    triton_items = ("poslsh-triton out", "poslsh-triton dq", "poslsh-triton dk", "poslsh-triton dv",
                    "poslsh-triton deterministic (two runs bitwise equal)")
    for item in ("poslsh-flex out", "poslsh-flex lse", "window-flex out") + (() if problem else triton_items):
        assert checks.get(item, {}).get("result") == "PASS", (item, checks.get(item))
    if problem:                       # said once, in the tests' words; the Triton rows say it too
        assert sum("triton-lang/triton#9171" in line for line in lines if line.startswith("dry run:")) == 1
        assert checks["poslsh-triton"]["result"] == "unavailable" and "#9171" in checks["poslsh-triton"]["detail"]
    for stage in ("t128k", "t32k"):
        timed = {(x["item"], x["mode"]): x["result"] for x in rows if x["stage"] == stage}
        for method in ("poslsh-triton", "window-flex", "exact-flex", "window-triton", "sdpa-flash"):
            for mode in ("fwd", "fwd+bwd"):
                assert timed[(method, mode)] in ("ok", "skipped", "unavailable"), (stage, method, mode)
        assert timed[("sdpa-flash", "fwd+bwd")] == "ok"
        if not problem:
            assert timed[("poslsh-triton last 64 rows vs float64", "fwd")] == "PASS"
            assert timed[("poslsh-triton", "fwd+bwd")] == "ok"
            assert any(item.startswith("target: exact ALiBi (flex) / poslsh-triton") for item, _ in timed)
    models = {x["item"]: x["result"] for x in rows if x["stage"] in ("models", "cache", "encoders", "decode")}
    if _transformers_ok():
        for item in ("patch_alibi exact", "patch_alibi certified (tol 0.001)", "per-head cache decoding vs float64",
                     "rows kept per KV head = window + 1", "generate() on the per-head cache",
                     "exact decoding (AppendCache) vs float64", "generate() decodes exact ALiBi on an AppendCache",
                     "certified decoding (tol 0.001) vs float64 at its windows",
                     "rows kept per KV head = min(tokens, window + 1)",
                     *(f"{m} vs float64 exact, {what}" for m in ("exact", "certified")
                       for what in ("4 padded rows", "one row"))):
            assert models.get(item) == "PASS", (item, models)
        timed = [(x["item"], x["n"]) for x in rows if x["stage"] == "decode" and x["result"] == "ok"
                 and x["item"] != "stage decode"]
        assert {item for item, _ in timed} == {f"{m} decoding time" for m in ("eager", "exact", "certified")}
    else:
        assert set(models.values()) == {"unavailable"}
    tests = [x for x in rows if x["stage"] == "tests" and x["item"].startswith("tests/")]
    assert tests and all(x["result"] == "skipped" for x in tests)          # no CUDA here
    assert any("test_triton.py::test_gpu_long_sequence_runs" in x["item"] for x in tests)
    assert "DRY RUN" in (tmp_path / "results.md").read_text().splitlines()[0]
    with __import__("tarfile").open(tmp_path / "logs.tar.gz") as tar:      # every stage's log, packed
        assert {f"logs/{s}.log" for s in STAGES if s not in RESERVED} <= set(tar.getnames())


def test_stage_list_budget_and_reserved_places():
    """The stage list in running order, each with a case in run_stage and a line in the script's header;
    the limits fit 540 s (a 9-minute device command), and the reserved stage keeps its place."""
    text = (REPO / SCRIPT).read_text()
    listed = re.search(r"^STAGES=\((.*)\)$", text, re.M).group(1).split()
    assert [s.split(":")[0] for s in listed] == STAGES
    cases = re.search(r"run_stage\(\) \{(.*?)\n\}", text, re.S).group(1)
    header = text.split("\ncd ")[0]
    for s in STAGES:
        assert re.search(rf"^\s+{s}\)\s", cases, re.M), f"no case for stage {s} in run_stage"
        assert re.search(rf"^#\s+{s}\s+\d+\s", header, re.M), f"stage {s} is not described in the header"
    for s in RESERVED:
        assert re.search(rf"^\s+{s}\)\s+reserved ", cases, re.M), s
    docs = (REPO / "docs" / "gpu.md").read_text()
    for s in STAGES:
        assert f"| `{s}` |" in docs, f"docs/gpu.md does not describe stage {s}"


def test_budget_is_checked_before_anything_runs(tmp_path):
    r = _run("--check-budget")
    assert r.returncode == 0, r.stderr
    total = int(re.search(rf"= (\d+) s of at most {BUDGET} s", r.stdout).group(1))
    limits = [int(x) for x in re.findall(r"(\d+)\+2 \(", r.stdout)]
    print(r.stdout)
    assert total <= BUDGET and total == sum(limits) + 2 * len(limits) and len(limits) == len(STAGES)
    r = _run("--dry-run", "--out", str(tmp_path), "--limits", "warm=100")
    assert r.returncode == 2 and "refusing to start" in r.stderr and f"{total + 25} s > {BUDGET} s" in r.stderr
    assert not (tmp_path / "results.md").exists()
    assert _run("--limits", "nosuchstage=3").returncode == 2
    more = subprocess.run(["bash", "benchmarks/gpu_more.sh", "--check-budget"], cwd=REPO, capture_output=True,
                          text=True)
    assert more.returncode == 0 and f"of at most {BUDGET} s" in more.stdout


def _failing_python(tmp_path) -> Path:
    """An interpreter that runs the scripts' own tools (versions, rows) and fails every stage's program."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
case "$1" in
  benchmarks/gpu_env.py|benchmarks/gpu_rows.py|-m) exec {sys.executable} "$@" ;;
  *) echo "RuntimeError: this stage broke on purpose" >&2; exit 3 ;;
esac
""")
    fake.chmod(0o755)
    return fake


def test_a_failing_stage_says_why_in_one_line_and_the_next_runs(tmp_path):
    """A stage whose program fails is reported as failed with the reason from its log in one line, the next
    stage still runs, and the script's exit status is 1."""
    r = _run("--dry-run", "--out", str(tmp_path / "o"), "--stages", "check,t32k",
             env={"PYTHON": str(_failing_python(tmp_path))})
    print(r.stdout, r.stderr)
    assert r.returncode == 1, r.stdout
    assert "FAILED stages: check t32k" in r.stdout
    for s in ("check", "t32k"):
        line = [x for x in r.stdout.splitlines() if x.startswith(f"stage {s}: ")]
        assert len(line) == 1 and "failed" in line[0] and "this stage broke on purpose" in line[0], line


def test_an_interpreter_without_torch_stops_in_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/usr/bin/env bash\nexec {sys.executable} -S \"$@\"\n")      # no site-packages: no torch
    fake.chmod(0o755)
    r = _run("--dry-run", "--out", str(tmp_path / "o"), env={"PYTHON": str(fake), "PYTHONPATH": ""})
    print(r.stdout, r.stderr)
    assert r.returncode == 2 and "has no torch" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not [line for line in r.stdout.splitlines() if line.startswith("stage ")]


def test_a_stage_past_its_limit_keeps_what_it_measured(tmp_path):
    """The stage runner: a command that writes a row and then runs past its limit is stopped,
    recorded as timed out, and its row is still in both files."""
    cmd = f"""
      source benchmarks/gpu_stages.sh
      DEST={tmp_path}; PY={sys.executable}
      mkdir -p "$DEST/logs"
      {sys.executable} benchmarks/gpu_rows.py header "$DEST" title
      stage slow 1 bash -c '{sys.executable} benchmarks/gpu_rows.py row "$0" slow measured ok 1.5 ms; sleep 30' "$DEST"
      echo "failed:$FAILED"
    """
    r = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=60)
    print(r.stdout, r.stderr)
    assert "failed: slow" in r.stdout and "stage slow: timed out" in r.stdout
    rows = _rows(tmp_path)
    assert [(x["item"], x["result"]) for x in rows] == [("measured", "ok"), ("stage slow", "timed out")]
    assert rows[0]["value"] == "1.5"


def _scripts_in(tmp_path) -> Path:
    """A copy of the scripts in a tree of its own (what `make demo` leaves: maybe a .venv, maybe .gpu)."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    for name in ("gpu_first_run.sh", "gpu_stages.sh", "gpu_env.py", "gpu_rows.py", "gpu_common.py"):
        shutil.copy(REPO / "benchmarks" / name, root / "benchmarks" / name)
    return root


def test_the_script_finds_the_project_environment(tmp_path):
    """Without PYTHON: .venv/bin/python when it exists (after `make demo`, not activated), else python3."""
    pytest.importorskip("torch")
    root = _scripts_in(tmp_path)
    env = {"PYTHONPATH": str(REPO)}
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").write_text(f"#!/usr/bin/env bash\nexec {sys.executable} \"$@\"\n")
    (root / ".venv" / "bin" / "python").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OUT")}
    r = subprocess.run(["bash", "benchmarks/gpu_first_run.sh", "--check-env"], cwd=root, env={**full, **env},
                       capture_output=True, text=True, timeout=300)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and f"interpreter: {root}/.venv/bin/python" in r.stdout and "torch " in r.stdout
    shutil.rmtree(root / ".venv")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text("#!/usr/bin/env bash\necho \"python3 was used\"\n")
    (fake_bin / "python3").chmod(0o755)
    r = subprocess.run(["bash", "benchmarks/gpu_first_run.sh", "--check-env"], cwd=root,
                       env={**full, **env, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}"},
                       capture_output=True, text=True, timeout=300)
    assert "interpreter: python3" in r.stdout and "python3 was used" in r.stdout, r.stdout + r.stderr


def test_carried_wheels_go_first_on_the_path(tmp_path):
    """A wheel in .gpu/ is unpacked and imported before anything installed (the GPU machine's transformers
    5.17 under the carried 5.25): here a one-module wheel."""
    root = _scripts_in(tmp_path)
    (root / ".gpu").mkdir()
    with zipfile.ZipFile(root / ".gpu" / "gpu_probe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("gpu_probe.py", "WHERE = 'carried'\n")
    cmd = f"""
      source benchmarks/gpu_stages.sh
      PY={sys.executable}; PYTHONPATH=; TMPDIR={tmp_path}
      use_bundle
      $PY -c 'import gpu_probe, os; print(gpu_probe.WHERE, gpu_probe.__file__.startswith(os.environ["POSLSH_GPU_BUNDLE"]))'
    """
    r = subprocess.run(["bash", "-c", cmd], cwd=root, capture_output=True, text=True, timeout=60)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "carried True" in r.stdout and "gpu_probe-1.0-py3-none-any.whl" in r.stdout


def test_the_bundle_pins_transformers_in_the_integrations_range():
    from poslsh.integrations import MIN_TRANSFORMERS
    text = (REPO / "benchmarks" / "gpu_bundle.sh").read_text()
    pinned = re.search(r"^\s+transformers==([\d.]+)", text, re.M).group(1)
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))           # noqa: E731
    assert as_tuple(pinned) >= as_tuple(MIN_TRANSFORMERS)
    assert "gpu-bundle:" in (REPO / "Makefile").read_text() and "/.gpu/" in (REPO / ".gitignore").read_text()
