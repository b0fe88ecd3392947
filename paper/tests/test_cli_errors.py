"""User errors end in one line on stderr and exit code 2, before any work (no traceback);
``--debug`` shows the traceback."""
import pytest

from poslsh_paper.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["train", "--preset", "smok"], "unknown preset 'smok'"),
    (["train", "--method", "poslsh"], "unknown method 'poslsh'"),
    (["train", "--set", "stepz=5"], "Unrecognized options: --stepz"),
    (["train", "--set", "steps=abc"], "Error parsing --steps"),
    (["train", "--steps", "-2"], "steps must be at least 1"),
    (["train", "--method", "alibi-w100000000000000000000"], "is exact ALiBi in this run"),
    (["train", "--method", "alibi-w1024", "--seq-len", "256"], "use --method alibi"),
    (["train", "--runs-dir", "README.md/runs"], "is a file, not a directory"),
    (["table", "--jobs", "0"], "jobs"),
    (["nope"], "unknown command 'nope'"),
])
def test_user_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_cuda_without_cuda_is_one_line(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["train", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_debug_shows_the_traceback():
    from poslsh_paper.experiments.command import ConfigError
    with pytest.raises(ConfigError):
        main(["train", "--method", "poslsh", "--debug"])


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "theory", "convergence", "audit", "train", "eval", "table"):
        assert f"  {cmd} " in out


# ------------------------------------------------ missing data, unreadable files: one line, exit 2
def _error(capsys, command):
    err = capsys.readouterr().err
    print(err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"poslsh {command}: error:")
    return lines[0]


def test_missing_python_doc_names_the_package_and_the_offline_way(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSLSH_PYTHON_DOC_ROOT", str(tmp_path / "empty"))
    assert main(["train", "--data.corpora", "python-doc", "--runs-dir", str(tmp_path / "runs"),
                 "--cache-dir", str(tmp_path / "c")]) == 2
    line = _error(capsys, "train")
    assert "python3.11-doc" in line and "apt-get install python3.11-doc" in line
    assert "--data.corpora synthetic" in line
    assert not (tmp_path / "runs").exists()


def test_missing_linux_doc_for_eval(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POSLSH_LINUX_DOC_ROOT", str(tmp_path / "empty"))
    assert main(["eval", "--preset", "cpu", "--runs-dir", str(tmp_path / "runs"), "--checkpoint", "init"]) == 2
    line = _error(capsys, "eval")
    assert "linux-doc-6.1" in line and "apt-get install linux-doc-6.1" in line and "--data.corpora synthetic" in line


def test_unknown_corpus_is_one_line(tmp_path, capsys):
    assert main(["train", "--data.corpora", "nope", "--runs-dir", str(tmp_path / "runs")]) == 2
    line = _error(capsys, "train")
    assert "'nope'" in line and "python-doc" in line and "synthetic" in line


@pytest.mark.parametrize("content", [b"steps: 3\n", b"\xff\xfe\x00", b'{"steps": "abc"}', b"[1, 2]"],
                         ids=["yaml", "binary", "wrong-type", "list"])
def test_config_json_that_is_not_a_config_is_one_line(tmp_path, capsys, content):
    bad = tmp_path / "cfg.json"
    bad.write_bytes(content)
    assert main(["train", "--config-json", str(bad), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert str(bad) in _error(capsys, "train")


def test_prompt_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"caf\xe9 \xff")
    assert main(["generate", "--model", str(tmp_path), "--prompt-file", str(bad)]) == 2
    line = _error(capsys, "generate")
    assert str(bad) in line and "UTF-8" in line


def test_model_without_a_tokenizer_is_a_whole_line(tiny_model_dir, capsys):
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "w1 w2", "--max-new-tokens", "2"]) == 2
    line = _error(capsys, "generate")
    assert str(tiny_model_dir) in line and "no tokenizer" in line and "save_pretrained" in line
    assert line.endswith("with --checkpoint RUN_DIR")        # the whole message, not its first line
