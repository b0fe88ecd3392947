"""Names that become paths are checked once, at the boundary, by one rule; paths stay inside
their root; nothing outside a run directory is ever removed.

A preset, method or split name arrives from a flag, ``--set``, a ``--config-json`` file or a
recorded config; each becomes a path component (``<runs_dir>/<preset>/<method>/seed<k>``,
``<out>/<preset>/table.md``), so each must be a plain name."""
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from poslsh_paper.cli import main  # noqa: E402
from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.lm.config import run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh_paper.experiments.serialize import config_to_dict  # noqa: E402

from test_train import tiny_cfg  # noqa: E402


def _one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def _victim(root: Path) -> Path:
    """A directory that looks like a run, outside any runs directory: must survive."""
    victim = root / "victim" / "alibi" / "seed0"
    victim.mkdir(parents=True)
    (victim / "config.json").write_text("{}")
    (victim / "precious.txt").write_text("keep me")
    return victim


def test_name_rule():
    from poslsh_paper.experiments.paths import check_name
    for good in ("smoke", "cpu-lora", "poslsh-s10", "fixed_blocks", "v1.2", "A0"):
        assert check_name("preset", good) == good
    for bad in ("", ".", "..", "../victim", "a/b", "a\\b", ".hidden", "-x", "a..b", "x\n", "a b", "é", None, 3):
        with pytest.raises(ConfigError, match="preset"):
            check_name("preset", bad)


def test_config_json_preset_cannot_escape_and_overwrite_deletes_nothing_outside(tmp_path, capsys):
    victim = _victim(tmp_path)
    cfg = replace(tiny_cfg(tmp_path, method="alibi", steps=2), preset="../victim")
    request = tmp_path / "cfg.json"
    request.write_text(json.dumps(config_to_dict(cfg)))
    assert main(["train", "--config-json", str(request), "--overwrite", "--no-progress"]) == 2
    line = _one_line(capsys)
    assert "preset" in line and "../victim" in line
    assert (victim / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "victim" / "alibi" / "seed0.lock").exists()


@pytest.mark.parametrize("flag", [["--set", "preset=../escaped"], ["--preset", "../escaped"],
                                  ["--set", "method=../../escaped"], ["--set", "eval_split=../x"]])
def test_set_and_flags_cannot_escape(tmp_path, capsys, flag):
    runs = tmp_path / "runs"
    assert main(["train", "--runs-dir", str(runs), "--data.corpora", "synthetic", "--no-progress", *flag]) == 2
    _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []          # nothing written anywhere


def test_table_and_eval_refuse_a_recorded_name_that_escapes(tmp_path, capsys):
    cfg = replace(tiny_cfg(tmp_path, method="alibi", steps=2), preset="../../elsewhere")
    request = tmp_path / "cfg.json"
    request.write_text(json.dumps(config_to_dict(cfg)))
    out = tmp_path / "out"
    assert main(["table", "--config-json", str(request), "--aggregate-only", "--out", str(out)]) == 2
    assert "preset" in _one_line(capsys)
    assert main(["eval", "--config-json", str(request), "--checkpoint", "init", "--no-progress"]) == 2
    assert "preset" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.json"]


def test_vision_preset_cannot_escape(tmp_path, capsys):
    assert main(["vision", "--set", "preset=../v", "--runs-dir", str(tmp_path / "runs"),
                 "--out", str(tmp_path / "out")]) == 2
    assert "preset" in _one_line(capsys)
    assert not list(tmp_path.iterdir())


def test_overwrite_removes_only_a_run_directory(tmp_path, capsys):
    """--overwrite deletes a run directory; a directory at that path that is not a run (no
    config.json, result.json or checkpoints/) is refused, and so is one reached through a link
    out of --runs-dir."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=2, ckpt_interval=2)
    d = run_dir(cfg)
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a run directory"):
        train(cfg, overwrite=True, progress=False, evaluate=False)
    assert (d / "notes.txt").read_text() == "mine"
    # runs/<preset> is a link to a directory outside runs_dir holding a run: not followed
    link = Path(cfg.runs_dir) / cfg.preset
    shutil.rmtree(link)
    victim = _victim(tmp_path)
    os.symlink(tmp_path / "victim", link)
    with pytest.raises(ConfigError, match="outside"):
        train(cfg, overwrite=True, progress=False, evaluate=False)
    assert (victim / "precious.txt").read_text() == "keep me"
