"""A record never describes a run that did not happen: ``--resume`` continues the recorded
configuration (or refuses a flag that differs from it), and ``poslsh eval`` loads a
checkpoint strictly (or refuses, naming the recorded and the requested configuration)."""
import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from poslsh_paper.cli import main  # noqa: E402
from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.lm.config import run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh_paper.experiments.serialize import config_to_dict  # noqa: E402

from test_train import tiny_cfg  # noqa: E402


def _request(cfg, path):
    path.write_text(json.dumps(config_to_dict(cfg)))
    return str(path)


def _error_line(capsys, command="eval"):
    err = capsys.readouterr().err
    print(err)
    lines = [ln for ln in err.splitlines() if ln.startswith(f"poslsh {command}: error:")]
    assert "Traceback" not in err and len(lines) == 1
    return lines[0]


def _record(cfg):
    d = run_dir(cfg)
    return json.loads((d / "config.json").read_text()), json.loads((d / "result.json").read_text())


def test_resume_continues_the_recorded_configuration(tmp_path, capsys):
    """A 12-step run resumed from a config that says 4 steps (a preset default the user did not
    type) continues the 12-step run and says so; the record keeps saying 12."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=12, ckpt_interval=4)
    assert main(["train", "--config-json", _request(cfg, tmp_path / "a.json"), "--no-progress"]) == 0
    before, result = _record(cfg)
    capsys.readouterr()
    short = replace(cfg, steps=4, lr=cfg.lr * 10)
    assert main(["train", "--config-json", _request(short, tmp_path / "b.json"), "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    print(err)
    said = [line for line in err.splitlines() if "recorded configuration" in line]
    assert len(said) == 1 and "steps 12" in said[0]
    after, again = _record(cfg)
    assert after == before and again["steps"] == 12 and again["config"]["steps"] == 12
    assert again["config"]["lr"] == cfg.lr and again["final_train_loss"] == result["final_train_loss"]


@pytest.mark.parametrize("flags,names", [(["--steps", "4"], ["steps 4", "12"]),
                                         (["--lr", "0.5"], ["lr 0.5", "0.003"]),
                                         (["--set", "model.hidden_size=48"], ["model.hidden_size 48", "32"])])
def test_resume_refuses_a_flag_that_differs_from_the_record(tmp_path, capsys, flags, names):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=12, ckpt_interval=4)
    request = _request(cfg, tmp_path / "a.json")
    assert main(["train", "--config-json", request, "--no-progress"]) == 0
    before = _record(cfg)
    capsys.readouterr()
    assert main(["train", "--config-json", request, "--resume", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and all(n in err[0] for n in names) and "--overwrite" in err[0]
    assert _record(cfg) == before


def test_resume_api_refuses_another_configuration(tmp_path):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=6, ckpt_interval=3)
    train(cfg, progress=False, evaluate=False)
    with pytest.raises(ConfigError, match="steps 3 .*recorded 6"):
        train(replace(cfg, steps=3), resume=True, progress=False, evaluate=False)
    # what does not change results (threads, where checkpoints go) may differ on resume
    train(replace(cfg, threads=2, keep_checkpoints=3), resume=True, progress=False, evaluate=False)


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, method="alibi", steps=2)
    assert main(["train", "--config-json", _request(cfg, tmp_path / "a.json"), "--resume", "--overwrite"]) == 2
    assert "--resume" in capsys.readouterr().err


def test_eval_of_a_checkpoint_under_another_configuration_is_refused(tmp_path, capsys):
    """Other shapes, or no parameter name in common (a from-scratch checkpoint evaluated as a
    LoRA model): one line naming both configurations, nothing filed, exit 2."""
    import torch
    import transformers
    cfg = tiny_cfg(tmp_path, method="alibi", steps=2, ckpt_interval=2)
    train(cfg, progress=False, evaluate=False)
    ckpt = str(run_dir(cfg))
    wider = replace(cfg, model=replace(cfg.model, hidden_size=48))
    assert main(["eval", "--config-json", _request(wider, tmp_path / "w.json"), "--checkpoint", ckpt,
                 "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "hidden_size" in line and "32" in line and "48" in line
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256)).save_pretrained(tmp_path / "base")
    lora = replace(cfg, preset="smoke-lora", model=replace(cfg.model, kind="lora", base=str(tmp_path / "base")))
    assert main(["eval", "--config-json", _request(lora, tmp_path / "l.json"), "--checkpoint", ckpt,
                 "--no-progress"]) == 2
    line = _error_line(capsys)
    assert "smoke-lora" in line and "lora" in line and "scratch" in line
    assert not list(run_dir(cfg).glob("eval-*.json"))
