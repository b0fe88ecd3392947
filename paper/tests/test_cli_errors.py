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
