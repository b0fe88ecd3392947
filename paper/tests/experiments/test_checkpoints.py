"""Checkpoints are never lost: damaged or foreign ones are moved aside (and said so), never
deleted; retention never deletes the newest valid one; a run of the older layout (no manifest)
is resumed, not restarted; a full disk is one line, with the temp directory removed and the
previous checkpoint intact."""
import json
import shutil

import pytest

pytest.importorskip("transformers")

from poslsh_paper.cli import main  # noqa: E402
from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments import checkpoints as ckmod  # noqa: E402
from poslsh_paper.experiments.checkpoints import checkpoint_problem, latest_checkpoint  # noqa: E402
from poslsh_paper.experiments.lm.config import run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh_paper.experiments.serialize import config_to_dict  # noqa: E402

from test_train import tiny_cfg  # noqa: E402


def _steps(run):
    return sorted(p.name for p in (run / "checkpoints").glob("step-*"))


def _damage(ckpt):
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(100)


def test_a_damaged_checkpoint_is_moved_aside_not_deleted(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=9, ckpt_interval=3, keep_checkpoints=2)
    train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    (run / "result.json").unlink()
    _damage(run / "checkpoints" / "step-00000009")
    capsys.readouterr()
    train(cfg, resume=True, progress=False, evaluate=False)         # from step 6; saves step 9 again
    err = capsys.readouterr().err
    print(err)
    kept = run / "checkpoints" / "damaged" / "step-00000009"
    assert (kept / "model.safetensors").stat().st_size == 100          # the damaged files, as they were
    assert f"moved damaged checkpoint {run / 'checkpoints' / 'step-00000009'}" in err and str(kept) in err
    assert _steps(run) == ["step-00000006", "step-00000009"]
    assert checkpoint_problem(run / "checkpoints" / "step-00000009") is None


def test_retention_never_deletes_the_newest_valid_checkpoint(tmp_path, monkeypatch):
    """keep_checkpoints=1: the older checkpoint goes only once the new one is verified complete."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=6, ckpt_interval=3, keep_checkpoints=1)
    real = ckmod._write_manifest

    def bad_manifest_at_step_6(directory):
        real(directory)
        if json.loads((directory / "state.json").read_text())["step"] == 6:
            _damage(directory)                                      # torn after its manifest was written
    monkeypatch.setattr(ckmod, "_write_manifest", bad_manifest_at_step_6)
    with pytest.raises(ConfigError, match="step-00000003"):
        train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    assert checkpoint_problem(run / "checkpoints" / "step-00000003") is None
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000003"


def test_an_older_layout_run_is_resumed_not_restarted(tmp_path, capsys):
    """Checkpoints of an older version have no manifest.json: --resume verifies that their files
    load, adopts them and continues from the newest (never from step 0)."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=9, ckpt_interval=3, keep_checkpoints=3)
    train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    final = ckmod.load_checkpoint_params(run / "checkpoints" / "step-00000009")
    shutil.rmtree(run / "checkpoints" / "step-00000009")             # interrupted after step 6
    (run / "result.json").unlink()
    for manifest in (run / "checkpoints").glob("step-*/manifest.json"):
        manifest.unlink()
    capsys.readouterr()
    train(cfg, resume=True, progress=False, evaluate=False)
    err = capsys.readouterr().err
    print(err)
    assert "from step 6" in err and "older layout" in err and "step 0" not in err
    assert _steps(run) == ["step-00000003", "step-00000006", "step-00000009"]
    assert all(checkpoint_problem(p) is None for p in (run / "checkpoints").glob("step-*"))
    again = ckmod.load_checkpoint_params(run / "checkpoints" / "step-00000009")
    assert all((again[k] == final[k]).all() for k in final)


def test_checkpoints_without_resume_are_never_silently_restarted(tmp_path):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3, ckpt_interval=3)
    train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    (run / "result.json").unlink()
    _damage(run / "checkpoints" / "step-00000003")
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, progress=False, evaluate=False)
    assert (run / "checkpoints" / "step-00000003" / "model.safetensors").stat().st_size == 100


def test_a_full_disk_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError
    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, path, *a, **k):           # the second checkpoint hits a full disk
        calls.append(path)
        if len(calls) > 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    cfg = tiny_cfg(tmp_path, method="alibi", steps=6, ckpt_interval=3)
    request = tmp_path / "cfg.json"
    request.write_text(json.dumps(config_to_dict(cfg)))
    assert main(["train", "--config-json", str(request), "--no-progress"]) == 2
    err = capsys.readouterr().err
    print(err)
    run = run_dir(cfg)
    line = [ln for ln in err.splitlines() if ln.startswith("poslsh train: error:")]
    assert "Traceback" not in err and len(line) == 1
    assert "no space left on device" in line[0].lower() and str(run / "checkpoints") in line[0]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000003"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert not (run / "result.json").exists()


def test_a_foreign_checkpoint_is_moved_aside_on_resume(tmp_path, capsys):
    """A complete checkpoint whose state.json records another configuration than the run's (copied
    in from elsewhere) is neither resumed nor deleted."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=6, ckpt_interval=3, keep_checkpoints=2)
    train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    (run / "result.json").unlink()
    newest = run / "checkpoints" / "step-00000006"
    state = json.loads((newest / "state.json").read_text())
    state["config"]["lr"] = 0.5
    (newest / "state.json").write_text(json.dumps(state))
    ckmod._write_manifest(newest)                                     # complete, but foreign
    capsys.readouterr()
    train(cfg, resume=True, progress=False, evaluate=False)
    err = capsys.readouterr().err
    print(err)
    kept = run / "checkpoints" / "foreign" / "step-00000006"
    assert f"moved foreign checkpoint {newest}" in err and "lr 0.5" in err and "from step 3" in err
    assert json.loads((kept / "state.json").read_text())["config"]["lr"] == 0.5
    assert checkpoint_problem(newest) is None                          # written again by this run
