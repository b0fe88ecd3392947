"""Runs are never lost or mixed: complete-only checkpoints (manifest written last),
resume from the newest complete one, a lock per run directory, tables of one config only,
Ctrl-C (and SIGTERM, even where SIGINT is ignored) ends with the checkpoint message and exit code
130 (143)."""
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments import sweep  # noqa: E402
from poslsh_paper.experiments.lm import table  # noqa: E402
from poslsh_paper.experiments.checkpoints import checkpoint_problem, latest_checkpoint, run_lock  # noqa: E402
from poslsh_paper.experiments.lm.config import run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402

from test_train import REPO, tiny_cfg  # noqa: E402


def _steps(run):
    return sorted(p.name for p in (run / "checkpoints").glob("step-*"))


def test_damaged_checkpoints_are_skipped_reported_and_kept(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=9, ckpt_interval=3, keep_checkpoints=2)
    train(cfg, progress=False, evaluate=False)
    run = run_dir(cfg)
    assert _steps(run) == ["step-00000006", "step-00000009"]          # keep_checkpoints=2 keeps two
    newest = run / "checkpoints" / "step-00000009"
    with open(newest / "model.safetensors", "r+b") as f:               # truncate the newest
        f.truncate(100)
    assert "bytes" in checkpoint_problem(newest)
    (run / "checkpoints" / "latest").write_text("")                   # an empty pointer changes nothing
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000006"
    err = capsys.readouterr().err
    print(err)
    assert f"skipping damaged checkpoint {newest}" in err
    # resume takes the newest complete checkpoint, says which, and reaches the same end
    done = train(cfg, resume=True, progress=False, evaluate=False)
    err = capsys.readouterr().err
    assert "from step 6" in err and "step-00000006" in err
    assert done["steps"] == 9 and (run / "checkpoints" / "step-00000009" / "manifest.json").exists()


def test_checkpoint_without_manifest_is_incomplete(tmp_path):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3, ckpt_interval=3)
    train(cfg, progress=False, evaluate=False)
    ck = run_dir(cfg) / "checkpoints" / "step-00000003"
    (ck / "manifest.json").unlink()
    assert "no manifest.json" in checkpoint_problem(ck)
    from poslsh_paper.experiments.checkpoints import load_checkpoint_params
    with pytest.raises(ConfigError, match="older layout.*--resume"):       # the files are there: adoptable
        load_checkpoint_params(ck)
    (ck / "optimizer.safetensors").unlink()
    with pytest.raises(ConfigError, match="is damaged"):
        load_checkpoint_params(ck)


def test_second_process_on_a_run_is_refused(tmp_path):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3)
    with run_lock(run_dir(cfg)):
        with pytest.raises(ConfigError, match=f"in use by process {os.getpid()}"):
            train(cfg, progress=False, evaluate=False)
        with pytest.raises(ConfigError, match="in use"):                 # --overwrite too
            train(cfg, overwrite=True, progress=False, evaluate=False)
    train(cfg, progress=False, evaluate=False)                          # free again


def test_table_uses_only_runs_of_its_config(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3, methods=("alibi",), seeds=(0, 1))
    train(replace(cfg, seed=0), progress=False, evaluate=True)
    train(replace(cfg, seed=1, steps=4), progress=False, evaluate=True)   # another config
    results = table.run_table(cfg, ["alibi"], [0, 1], tmp_path / "results", progress=False, train_missing=False)
    err = capsys.readouterr().err
    print(err)
    assert [r["seed"] for r in results] == [0]
    assert "left out of the table: 1 run" in err and "steps 4 (table: 3)" in err and "--overwrite" in err
    md = (tmp_path / "results" / cfg.preset / "table.md").read_text()
    assert "| ALiBi | 1 |" in md
    # the table says so itself, one line per run (the stderr lines scroll away under training output)
    left = [line for line in md.splitlines() if line.startswith("- ") and "result.json" in line]
    assert "**Left out:** 1 run(s)" in md and "--overwrite" in md
    assert left == [f"- {run_dir(replace(cfg, seed=1)) / 'result.json'}: trained with steps 4 (table: 3)"]
    table_json = json.loads((tmp_path / "results" / cfg.preset / "table.json").read_text())
    assert table_json["meta"]["left_out"] == [left[0][2:]]


def test_table_of_only_other_config_runs_says_so_and_never_prints_an_older_table(tmp_path, capsys):
    """An earlier 10-step table, then the table of the preset's steps over the same runs: every
    run is left out; the earlier table.md must not be printed as this table's."""
    from poslsh_paper.cli import main
    from poslsh_paper.experiments.serialize import config_to_dict
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3, methods=("alibi",), seeds=(0,))
    train(replace(cfg, steps=4), progress=False, evaluate=True)
    out = tmp_path / "results"
    table.run_table(replace(cfg, steps=4), ["alibi"], [0], out, progress=False, train_missing=False,
                    command="the earlier table")
    assert "the earlier table" in (out / cfg.preset / "table.md").read_text()
    capsys.readouterr()
    request = tmp_path / "table.json"
    request.write_text(json.dumps(config_to_dict(cfg)))
    assert main(["table", "--config-json", str(request), "--out", str(out), "--no-progress"]) == 2
    got = capsys.readouterr()
    print(got.err)
    assert "the earlier table" not in got.out and "Length extrapolation" not in got.out
    last = got.err.strip().splitlines()[-1]
    assert "no table was written" in last and "--overwrite" in last
    assert "steps 4 (table: 3)" in got.err                              # which run, and why


def test_table_includes_earlier_runs_only_of_the_same_setup(tmp_path, capsys):
    """An earlier table.json fills in the method x seed runs that have no run directory (and
    nothing is retrained for them); the table says which; another setup is refused."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=3, methods=("alibi", "poslsh-s2"), seeds=(0,))
    train(replace(cfg, method="alibi"), progress=False, evaluate=True)
    earlier = tmp_path / "earlier"
    table.run_table(cfg, ["alibi"], [0], earlier, progress=False, train_missing=False, command="first")
    old = earlier / cfg.preset / "table.json"
    moved = replace(cfg, runs_dir=str(tmp_path / "other-runs"))            # alibi has no run directory here
    train(replace(moved, method="poslsh-s2"), progress=False, evaluate=True)
    results = table.run_table(moved, ["alibi", "poslsh-s2"], [0], tmp_path / "results", progress=False,
                              train_missing=True, include=old)
    assert sorted(r["method"] for r in results) == ["alibi", "poslsh-s2"]
    assert not (tmp_path / "other-runs" / cfg.preset / "alibi").exists()  # not retrained
    md = (tmp_path / "results" / cfg.preset / "table.md").read_text()
    print(md)
    assert "**Included:** 1 run(s) taken from" in md and "alibi (1)" in md and "| ALiBi | 1 |" in md
    with pytest.raises(ConfigError, match="another setup"):
        table.run_table(replace(moved, lr=moved.lr * 2), ["alibi", "poslsh-s2"], [0], tmp_path / "r2",
                        progress=False, train_missing=False, include=old)


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # what `cmd &` in a script gives a background job


@pytest.mark.parametrize("sig,code,ignore_sigint", [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, False),
                                                    (signal.SIGTERM, 143, True)],
                         ids=["ctrl-c", "sigterm", "sigterm-background"])
def test_interrupt_saves_and_exits_without_traceback(tmp_path, sig, code, ignore_sigint):
    # a checkpoint after every step: the first one says training has begun (no clock, no sleep);
    # the run is far too long to finish before the signal
    cfg = tiny_cfg(tmp_path, method="alibi", steps=100_000, ckpt_interval=1, keep_checkpoints=1)
    request = tmp_path / "request.json"
    from poslsh_paper.experiments.serialize import config_to_dict
    request.write_text(json.dumps(config_to_dict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(REPO / "paper"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "poslsh_paper", "train", "--config-json", str(request), "--no-progress"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if ignore_sigint else None)
    latest = run_dir(cfg) / "checkpoints" / "latest"
    deadline = time.monotonic() + 1800    # a generous bound for a loaded machine, not a measurement
    while time.monotonic() < deadline and not latest.exists() and proc.poll() is None:
        time.sleep(0.2)                   # polling for a file, not waiting for time to pass
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=1800)
    print(err[-2000:])
    assert proc.returncode == code
    assert "checkpoint at step" in err and "rerun with --resume" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert latest_checkpoint(run_dir(cfg)) is not None


def test_table_interrupt_stops_children_that_ignore_sigint(tmp_path):
    """A table's Ctrl-C/SIGTERM must reach every child, even those started by a table that a
    script put in the background (they inherit SIGINT ignored): the children get SIGTERM."""
    import threading
    children, codes = sweep.Children(), []
    child = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
             "print('ready', flush=True); time.sleep(120)"]
    log = tmp_path / "child.log"
    worker = threading.Thread(target=lambda: codes.append(children.run(child, log, dict(os.environ))))
    worker.start()
    deadline = time.monotonic() + 1800    # generous: python starting on a loaded machine
    while time.monotonic() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)                  # polling for the child's line, not waiting for time to pass
    children.interrupt()
    worker.join(timeout=1800)
    print("child exit", codes)
    assert codes == [-signal.SIGTERM]
    assert children.run(child, log, dict(os.environ)) is None       # nothing starts after an interrupt


def test_table_with_jobs_trains_each_run_in_a_worker(tmp_path, monkeypatch):
    """``poslsh table --jobs 2``: every missing run in a ``poslsh train --resume`` subprocess (the
    sweep runner's), its requested config and log in its run directory, then the table."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), str(REPO / "paper"),
                                                                 os.environ.get("PYTHONPATH", "")) if p))
    cfg = tiny_cfg(tmp_path, method="alibi", steps=2, methods=("alibi", "poslsh-s2"), seeds=(0,))
    results = table.run_table(cfg, ["alibi", "poslsh-s2"], [0], tmp_path / "results", progress=False, jobs=2)
    assert sorted(r["method"] for r in results) == ["alibi", "poslsh-s2"]
    for m in ("alibi", "poslsh-s2"):
        d = run_dir(replace(cfg, method=m, seed=0))
        assert (d / "requested-config.json").is_file() and (d / "train.log").is_file()
    assert (tmp_path / "results" / cfg.preset / "table.md").is_file()
