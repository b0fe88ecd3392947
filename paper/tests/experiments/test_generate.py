"""``poslsh generate``: from a training run and from a saved model directory, streamed, with
the bounded cache; greedy output equals generation without a cache."""
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from poslsh.decoding.certificate import CertificateWarning  # noqa: E402
from poslsh_paper.cli import main as poslsh_main  # noqa: E402
from poslsh_paper.experiments.generate import GenerateConfig, generate, load_for_generation  # noqa: E402
from poslsh_paper.experiments.lm.config import run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_train import tiny_cfg  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = tiny_cfg(tmp_path_factory.mktemp("gen"), method="poslsh-s3", steps=3)
    train(cfg, progress=False, evaluate=False)
    return run_dir(cfg)


def test_generate_from_a_run_streams_and_reports_the_cache(run, capsys):
    rc = poslsh_main(["generate", "--checkpoint", str(run), "--prompt", "The kernel driver module",
                      "--max-new-tokens", "12", "--ignore-eos", "--threads", "1"])
    out, err = capsys.readouterr()
    print(out, err)
    assert rc == 0 and out.strip()
    assert "12 new tokens at" in err and "tokens/s" in err and "bounded cache" in err and "bound" in err
    cfg = GenerateConfig(checkpoint=str(run), prompt="The kernel driver module", max_new_tokens=12, ignore_eos=True)
    model, tok, _ = load_for_generation(cfg)
    streamed = generate(cfg, model, tok)
    plain = generate(replace(cfg, cache="none"), model, tok)
    capsys.readouterr()
    assert torch.equal(streamed["sequences"], plain["sequences"])
    assert tok.decode(streamed["sequences"][0, streamed["prompt_tokens"]:]).strip() == out.strip()


def test_generate_from_a_saved_model_directory_with_sampling(run, tmp_path, capsys):
    cfg = GenerateConfig(checkpoint=str(run), prompt="x")
    model, tok, _ = load_for_generation(cfg)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "prompt.txt").write_text("The kernel")
    args = ["generate", "--model", str(tmp_path / "m"), "--prompt-file", str(tmp_path / "prompt.txt"),
            "--max-new-tokens", "6", "--sample", "--temperature", "0.7", "--top-k", "10", "--top-p", "0.9",
            "--ignore-eos", "--prefill-chunk", "2"]
    assert poslsh_main(args) == 0
    first = capsys.readouterr()
    assert poslsh_main(args) == 0
    assert capsys.readouterr().out == first.out         # seeded sampling
    assert "(poslsh)" in first.err and "bounded cache" in first.err


def test_generate_with_per_head_windows_and_a_certificate(tmp_path_factory, run, capsys):
    """An alibi-window run generates through the per-head window cache with a certificate (the summary says
    so); greedy output equals generation without a cache; --tol on a poslsh run is a one-line error."""
    cfg = tiny_cfg(tmp_path_factory.mktemp("genw"), method="alibi-w4", steps=3)
    train(cfg, progress=False, evaluate=False)
    args = ["generate", "--checkpoint", str(run_dir(cfg)), "--prompt", "The kernel driver module",
            "--max-new-tokens", "10", "--ignore-eos", "--tol", "0.5", "--policy", "warn", "--sinks", "1"]
    assert poslsh_main(args) == 0
    err = capsys.readouterr().err
    assert "per-head window cache" in err and "certificate (--tol 0.5, --policy warn): worst bound" in err
    # a tol the windows cannot keep: the text stays clean (no Python warning, no source path in it), the
    # certificate is one line on stderr in the command's words; --policy raise is a one-line error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert poslsh_main(args[:-6] + ["--tol", "1e-9"]) == 0
    out, err = capsys.readouterr()
    assert not [w for w in caught if issubclass(w.category, CertificateWarning)]
    assert ".py:" not in out + err and "Warning" not in out + err
    said = [line for line in err.splitlines() if line.startswith("certificate")]
    assert len(said) == 1 and "head-steps over tol" in said[0] and "not certified" in said[0], err
    assert poslsh_main(args[:-6] + ["--tol", "1e-9", "--policy", "raise"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--policy raise) stopped the generation" in err[0], err
    gcfg = GenerateConfig(checkpoint=str(run_dir(cfg)), prompt="The kernel driver module", max_new_tokens=10,
                          ignore_eos=True)
    model, tok, _ = load_for_generation(gcfg)
    cached, plain = generate(gcfg, model, tok), generate(replace(gcfg, cache="none"), model, tok)
    assert "per-head window cache" in cached["cache"]
    assert torch.equal(cached["sequences"], plain["sequences"])
    capsys.readouterr()
    assert poslsh_main(["generate", "--checkpoint", str(run), "--prompt", "a", "--tol", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "only alibi-window models" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,msg", [([], "exactly one of --checkpoint"),
                                      (["--model", "x", "--prompt", "a", "--tol", "2"], "--tol must be in"),
                                      (["--model", "x", "--prompt", "a", "--tol", "0.1", "--cache", "full"],
                                       "(--cache auto)"),
                                      (["--model", "x", "--prompt", "a", "--policy", "quiet"], "--policy"),
                                      (["--checkpoint", "x"], "exactly one of --prompt"),
                                      (["--model", "x", "--prompt-file", "/nonexistent"], "no such file"),
                                      (["--model", "x", "--prompt", "a", "--top-p", "0"], "top_p"),
                                      (["--model", "x", "--prompt", "a", "--cache", "big"], "--cache")])
def test_bad_flags_are_one_line_errors(args, msg, capsys):
    assert poslsh_main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
