"""``poslsh vision`` end to end on the tiny synthetic image set (seconds): table, figure, exact
resume, the learned-position resize, every method at 2x resolution, the Fashion-MNIST install
hint, and one-line configuration errors."""
import json
from dataclasses import replace

import pytest
import torch

from poslsh_paper import cli
from poslsh_paper.data import images
from poslsh_paper.experiments.vision import config as vcfg
from poslsh_paper.experiments.vision import train as vtrain
from poslsh_paper.experiments.vision.model import ViT


def tiny(tmp_path, **kw):
    base = replace(vcfg.PRESETS["smoke"], runs_dir=str(tmp_path / "runs"), train_images=128, test_images=64,
                   model=vcfg.ViTConfig(dim=16, depth=2, heads=2, mlp_ratio=2, fixed_box=3), batch_size=32,
                   eval_batch_size=64, figure_scale=1, figure_samples=(1, 4), figure_images=2)
    return replace(base, **kw)


def test_cli_smoke_writes_table_and_figure(tmp_path, capsys):
    args = ["vision", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--train-images", "128",
            "--test-images", "64", "--model.dim", "16", "--model.heads", "2", "--batch-size", "32",
            "--figure-scale", "1", "--figure-samples", "1", "4", "--no-progress"]
    assert cli.main(args) == 0
    md = (tmp_path / "out" / "table.md").read_text()
    print(md)
    assert "Learned absolute positions" in md and "2-D PosLSH, s=2" in md and "Findings" in md
    cpu = [line.rstrip(" |").rsplit("| ", 1)[1] for line in md.splitlines() if line.startswith(("| Learned", "| 2-D"))]
    assert len(cpu) == 2 and all(float(x) > 0 for x in cpu), cpu        # a fast run's 0.4 s is not "0"
    assert " of poslsh-s2" not in md and "poslsh-s2: " in md              # one method: its accuracy, no tally
    for name in ("table.csv", "table.json", "convergence.png", "convergence.json"):
        assert (tmp_path / "out" / name).is_file()
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    keys = {r["scale"] for r in table["rows"]}
    assert keys == {"1x", "2x", "2x-scaled"}
    fig = json.loads((tmp_path / "out" / "convergence.json").read_text())
    assert fig["tokens"] == 49 and set(fig["summary"]) == {"spectral", "max", "output"}
    # a second call trains nothing and rewrites the same table
    assert cli.main(args + ["--skip-figure"]) == 0
    assert "0 of 2 runs to train" not in capsys.readouterr().out     # --no-progress: silent


def test_resume_is_bit_exact(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, epochs=2, ckpt_interval=2)
    full = vtrain.train_run(cfg, "poslsh-s2", 0)
    # Interrupt a second copy after step 5 (checkpoint at 4), then resume it.
    cfg2 = replace(cfg, runs_dir=str(tmp_path / "runs2"))
    real = vtrain.lr_at

    def boom(step, total, c):
        if step == 5:
            raise KeyboardInterrupt
        return real(step, total, c)

    monkeypatch.setattr(vtrain, "lr_at", boom)
    with pytest.raises(KeyboardInterrupt):
        vtrain.train_run(cfg2, "poslsh-s2", 0)
    assert not (vcfg.run_dir(cfg2, "poslsh-s2", 0) / vtrain.RESULT).exists()
    monkeypatch.setattr(vtrain, "lr_at", real)
    resumed = vtrain.train_run(cfg2, "poslsh-s2", 0)
    print("full", full["history"][-2:], full["eval"]["1x"]["acc"], "resumed", resumed["history"][-2:],
          resumed["eval"]["1x"]["acc"])
    assert resumed["history"] == full["history"] and resumed["eval"]["1x"]["acc"] == full["eval"]["1x"]["acc"]


@pytest.mark.parametrize("method", vcfg.METHODS)
def test_every_method_runs_at_both_resolutions(method):
    cfg = vcfg.ViTConfig(dim=16, depth=1, heads=2, fixed_box=3)
    model = ViT(cfg, vcfg.parse_method(method))
    model.set_seeds(0, 1)
    out = model(torch.randn(3, 1, 28, 28), step=0)
    assert out.shape == (3, 10)
    model.eval()
    with torch.no_grad():
        a = model(torch.randn(3, 1, 56, 56))
        model.set_sigma_mult(2)
        b = model(torch.randn(3, 1, 56, 56))
    assert a.shape == b.shape == (3, 10)


def test_learned_positions_are_resized_bicubically():
    model = ViT(vcfg.ViTConfig(dim=8, depth=1, heads=2), vcfg.parse_method("learned"))
    assert model.positions((7, 7)) is model.pos
    big = model.positions((14, 14))
    assert big.shape == (1, 8, 14, 14)
    expect = torch.nn.functional.interpolate(model.pos, size=(14, 14), mode="bicubic", align_corners=False)
    assert torch.equal(big, expect)


def test_scaled_sigma_changes_the_bias():
    model = ViT(vcfg.ViTConfig(dim=8, depth=1, heads=2), vcfg.parse_method("alibi-2d"))
    attn = model.blocks[0].attn
    b1 = attn.bias((4, 4), "cpu")
    model.set_sigma_mult(2)
    assert torch.allclose(attn.bias((4, 4), "cpu"), b1 / 2)


def test_missing_fashion_mnist_gives_the_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(images.FASHION_MNIST_ENV, str(tmp_path / "none"))
    with pytest.raises(images.ImagesNotFound, match="apt-get install dataset-fashion-mnist"):
        images.load_fashion_mnist("train")
    code = cli.main(["vision", "--dataset", "fashion-mnist", "--runs-dir", str(tmp_path / "r"), "--out",
                     str(tmp_path / "o")])
    err = capsys.readouterr().err
    print(err)
    assert code == 2 and "apt-get install dataset-fashion-mnist" in err and err.count("\n") == 1


def test_idx_reader_roundtrip(tmp_path, monkeypatch):
    import gzip
    import struct
    data = torch.randint(0, 256, (3, 28, 28), dtype=torch.uint8)
    for split, (img, lab) in images._FILES.items():
        with gzip.open(tmp_path / img, "wb") as f:
            f.write(struct.pack(">iiii", 2051, 3, 28, 28) + data.numpy().tobytes())
        with gzip.open(tmp_path / lab, "wb") as f:
            f.write(struct.pack(">ii", 2049, 3) + bytes([1, 2, 3]))
    monkeypatch.setenv(images.FASHION_MNIST_ENV, str(tmp_path))
    got = images.load_fashion_mnist("test")
    assert torch.equal(got.images, data) and got.labels.tolist() == [1, 2, 3]


@pytest.mark.parametrize("flag,value,match", [
    ("--methods", "rope", "unknown method 'rope'"),
    ("--model.patch-size", "5", "patch_size must divide"),
    ("--epochs", "0", "epochs must be at least 1"),
    ("--eval-scales", "0", "eval_scales must be positive"),
    ("--figure-layer", "7", "figure_layer must lie in"),
])
def test_bad_config_is_one_line(tmp_path, capsys, flag, value, match):
    code = cli.main(["vision", flag, value, "--runs-dir", str(tmp_path / "r"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and match in err and err.count("\n") == 1


def test_parallel_runs_train_in_worker_processes(tmp_path, monkeypatch):
    """``--jobs 2``: each run in a worker subprocess (the sweep runner's), logs in its run
    directory, the same table rows as runs trained here."""
    import os
    from pathlib import Path

    from poslsh_paper.experiments.vision import table as vtable
    repo = Path(__file__).resolve().parents[3]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(repo), str(repo / "paper"),
                                                                 os.environ.get("PYTHONPATH", "")) if p))
    cfg = tiny(tmp_path, methods=("learned", "poslsh-s2"), seeds=(0,))
    lines = []
    vtable.run_all(cfg, jobs=2, progress=lines.append)
    print("\n".join(lines))
    for m in cfg.methods:
        d = vcfg.run_dir(cfg, m, 0)
        assert (d / vtrain.RESULT).is_file() and "acc@1x" in (d / "train.log").read_text()
    assert sum(line.startswith("[done]") for line in lines) == 2 and any("acc@2x" in line for line in lines)
    assert {r["method"] for r in vtable.collect(cfg)} == set(cfg.methods)


def _rows(methods, seeds, accs):
    """Table rows of ``methods`` at 1x / 2x / 2x-scaled (``accs[method] = (1x, 2x, 2x-scaled)``)."""
    rows = []
    for m in methods:
        for key, acc in zip(("1x", "2x", "2x-scaled"), accs[m]):
            if acc is not None:
                rows.append({"method": m, "scale": key, "seeds": seeds, "acc_mean": acc, "acc_std": 1.0})
    return rows


def test_findings_name_only_what_was_trained_and_one_seed_establishes_nothing():
    """``poslsh vision --quick`` (learned and 2-D PosLSH s=2, one seed, near chance) said
    '2-D ALiBi and 2-D PosLSH extrapolate ... better than learned positions: holds' twice."""
    from poslsh_paper.experiments.vision.findings import ONE_SEED, findings
    accs = {"learned": (21.1, 12.5, None), "poslsh-s2": (31.2, 14.8, 16.4)}
    one = findings(_rows(("learned", "poslsh-s2"), 1, accs))
    print("\n".join(one))
    assert len(one) == 2
    for line in one:
        assert "ALiBi" not in line and line.startswith("2-D PosLSH extrapolates")
        assert line.endswith(f"holds on its one seed, {ONE_SEED}.")
    three = findings(_rows(("learned", "poslsh-s2"), 3, accs))
    assert [line.endswith("): holds.") for line in three] == [True, True]
    assert "; learned, resized bicubically: 12.50%; poslsh-s2: 14.80%)" in one[0]
    two = findings(_rows(("learned", "alibi-2d", "poslsh-s2"), 3, {**accs, "alibi-2d": (40.0, 10.0, 35.0)}))
    assert two[0].startswith("2-D ALiBi and 2-D PosLSH extrapolate")
    assert "alibi-2d: 10.00%, poslsh-s2: 14.80%; better: poslsh-s2 (1 of 2)" in two[0], two[0]
