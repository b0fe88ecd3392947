"""``poslsh convergence``: the command runs end to end on a tiny random Llama (no
model package, no corpus needed), resumes from its checkpoints, and its draws are
independent per input. The numerical routes it uses are tested against the library
in ``tests/analysis/test_mask_counts.py``."""
import json

import pytest

from poslsh.analysis import default_heads
from poslsh.cli import main
from poslsh.experiments import convergence as conv
from poslsh.io import atomic_write_text
from poslsh.seeding import stable_seed


def test_draw_seeds_independent_and_reproducible():
    # the seeds convergence draws input i's partitions with
    assert stable_seed("partitions", 0, 1) == stable_seed("partitions", 0, 1)
    assert len({stable_seed("partitions", 0, i) for i in range(100)}) == 100
    assert stable_seed("partitions", 0, 1) != stable_seed("partitions", 1, 1)


def test_presets_and_fingerprint():
    quick, default = conv.PRESETS["quick"], conv.PRESETS["default"]
    assert (quick.n, quick.num_inputs, quick.out) == (1024, 4, "results/convergence/quick")
    assert (default.n, default.num_inputs, default.out) == (4096, 30, "results/convergence")
    # checkpoints depend on what is computed, not on where or how it is reported
    assert default.fingerprint() == conv.ConvergenceConfig(out="elsewhere", plot=False, num_inputs=3).fingerprint()
    assert default.fingerprint() != conv.ConvergenceConfig(samples=(1, 10)).fingerprint()


# ------------------------------------------------------------- end to end
def test_cli_end_to_end_and_resume(tmp_path, capsys, tiny_model_dir):
    pytest.importorskip("transformers")
    model = tiny_model_dir
    out = tmp_path / "out"
    argv = ["convergence", "--model", str(model), "--inputs-from", "random", "--n", "96", "--inputs", "2",
            "--samples", "1", "10", "100", "--layers", "0", "1", "--out", str(out)]
    assert main(argv) == 0
    for name in ("rows.csv", "summary.csv", "convergence.json", "convergence.png"):
        assert (out / name).is_file(), name
    res = json.loads((out / "convergence.json").read_text())
    heads = res["config"]["heads"]
    assert heads == default_heads(6)
    assert len((out / "rows.csv").read_text().strip().splitlines()) == 1 + 2 * 2 * 4 * 3
    ck = res["cross_check"]
    assert ck["exact_vs_alibi_attention"] < 1e-10 and ck["approx_vs_poslsh_attention_torch"] < 1e-10
    assert ck["max_norm_vs_theory"] < 1e-12 and ck["spectral_rel_vs_theory"] < 1e-4
    assert res["timing"]["computed_inputs"] == 2
    # mask norms are shared by the layers (same draw), output errors are not
    rows = res["summary"]
    for h in heads:
        a = [r for r in rows if r["head"] == h and r["layer"] == 0]
        b = [r for r in rows if r["head"] == h and r["layer"] == 1]
        assert [r["spectral_mean"] for r in a] == [r["spectral_mean"] for r in b]
        assert [r["t_err_mean"] for r in a] != [r["t_err_mean"] for r in b]
        assert all(r["inputs"] == 2 for r in a)
    assert "fitted log-log slopes" in capsys.readouterr().out
    # resume: nothing recomputed, same numbers
    argv += ["--no-plot"]
    assert main(argv) == 0
    res2 = json.loads((out / "convergence.json").read_text())
    assert res2["timing"]["resumed_inputs"] == 2 and res2["timing"]["computed_inputs"] == 0
    assert res2["summary"] == res["summary"]
    # a different configuration does not reuse the checkpoints
    assert main(argv + ["--samples", "1", "10", "--no-cross-check"]) == 0
    res3 = json.loads((out / "convergence.json").read_text())
    assert res3["timing"]["computed_inputs"] == 2


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["convergence", "--model", str(tmp_path / "none"), "--inputs-from", "random",
                 "--out", str(tmp_path / "o")]) == 2
    assert "not a local Hugging Face model directory" in capsys.readouterr().err


def test_bad_values_are_config_errors(tmp_path, capsys):
    assert main(["convergence", "--samples", "0", "10", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--samples" in err and len(err.strip().splitlines()) == 1


def test_checkpoint_writes_are_atomic(tmp_path):
    atomic_write_text(tmp_path / "a" / "x.txt", "hello")
    assert (tmp_path / "a" / "x.txt").read_text() == "hello"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.txt"]
