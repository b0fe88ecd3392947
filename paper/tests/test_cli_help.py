"""One vocabulary for every command: ``--help`` lists the flags that act there (and no others),
the presets by name in ``--preset``'s help, ``--quick`` works everywhere it has a preset; old
spellings stay accepted; help costs no torch import."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poslsh_paper.cli import commands, main, parse

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "paper"), os.environ.get("PYTHONPATH", "")])}


def _help(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _flags(text):
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*", text))


@pytest.mark.parametrize("name", sorted(commands()))
def test_help_names_the_presets_and_the_common_flags(name, capsys):
    text = _help(capsys, name)
    cmd = commands()[name]
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("--preset"))
    assert all(p in line for p in cmd.presets), line
    for flag in ("--config-json", "--set", "--debug"):
        assert flag in text
    assert ("--quick" in text) == (cmd.quick is not None)


def test_overview_lists_presets_and_common_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "smoke" in out and "quick" in out and "--config-json" in out and "--quick" in out
    assert max(map(len, out.splitlines())) <= 100


@pytest.mark.parametrize("name,absent,present", [
    ("train", {"--methods", "--seeds", "--results-dir", "--checkpoint"}, {"--method", "--seed", "--steps", "--resume"}),
    ("eval", {"--steps", "--lr", "--ckpt-interval", "--methods", "--resume", "--batch-size"},
     {"--method", "--checkpoint", "--eval-multipliers", "--streaming"}),
    ("table", {"--method", "--seed", "--checkpoint", "--resume"}, {"--methods", "--seeds", "--jobs", "--out"}),
])
def test_lm_help_lists_only_the_flags_that_act(name, absent, present, capsys):
    flags = _flags(_help(capsys, name))
    assert not absent & flags, absent & flags
    assert present <= flags


def test_a_flag_of_a_sibling_command_is_one_line(capsys):
    assert main(["train", "--methods", "alibi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "poslsh table" in err[0] and "--methods" in err[0]
    assert main(["eval", "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "poslsh train" in err[0]


def test_quick_is_every_commands_small_preset():
    cmds = commands()
    assert parse(cmds["train"], ["--quick"]).preset == "smoke"
    assert parse(cmds["table"], ["--quick"]).preset == "smoke"
    assert parse(cmds["vision"], ["--quick"]).preset == "smoke"
    assert parse(cmds["demo"], ["--quick"]).n == 1024
    # a quick demo does not overwrite the `make demo` output
    assert parse(cmds["demo"], ["--quick"]).out == "outputs/demo/quick"
    assert parse(cmds["demo"], []).out == "outputs/demo"


def test_quick_without_a_quick_preset_is_one_line(capsys):
    assert main(["theory", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quick" in err[0]
    assert main(["train", "--quick", "--preset", "cpu"]) == 2          # not one silently winning
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--quick" in err[0] and "cpu" in err[0]


@pytest.mark.parametrize("name,old,new,field,value", [
    ("demo", ["--out-dir", "x"], ["--out", "x"], "out", "x"),
    ("theory", ["--s", "1", "7"], ["--samples", "1", "7"], "samples", (1, 7)),
    ("theory", ["--C", "2"], ["--bound-c", "2"], "bound_c", 2.0),
    ("theory", ["--heads", "3"], ["--num-heads", "3"], "num_heads", 3),
    ("demo", ["--C", "2"], ["--bound-c", "2"], "bound_c", 2.0),
    ("convergence", ["--bound-C", "2"], ["--bound-c", "2"], "bound_c", 2.0),
    ("convergence", ["--inputs", "3"], ["--num-inputs", "3"], "num_inputs", 3),
    ("audit", ["--inputs", "3"], ["--num-inputs", "3"], "num_inputs", 3),
    ("table", ["--results-dir", "r"], ["--out", "r"], "out", "r"),
    ("vision", ["--ckpt-every", "7"], ["--ckpt-interval", "7"], "ckpt_interval", 7),
])
def test_one_vocabulary_with_the_old_spellings_accepted(name, old, new, field, value):
    cmd = commands()[name]
    assert getattr(parse(cmd, new), field) == value
    assert getattr(parse(cmd, old), field) == value
    key, _, rest = old[0][2:].partition("=")
    assert getattr(parse(cmd, ["--set", f"{key}={','.join(old[1:])}"]), field) == value


def _imported(argv):
    code = ("import sys, io, contextlib\nfrom poslsh_paper.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n        main(%r)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'matplotlib', 'peft') if m in sys.modules))") % argv
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"'))


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["demo", "--help"], ["audit", "--help"],
                                  ["convergence", "--help"], ["generate", "--help"], ["vision", "--help"],
                                  ["theory", "--help"], ["eval", "--help"], ["table", "--help"]])
def test_help_imports_no_torch(argv):
    assert _imported(argv) == []


def test_make_demo_says_how_to_reach_the_command():
    text = (REPO / "Makefile").read_text()
    demo = text.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    print(demo)
    assert "source $(VENV)/bin/activate" in demo and "$(VENV)/bin/poslsh" in demo
