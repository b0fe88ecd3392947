import json

from poslsh.cli import commands, main, overview


def test_overview_lists_core_commands():
    text = overview(commands())
    for cmd in ("demo", "theory", "convergence", "audit"):
        assert cmd in text


def test_theory_command(capsys):
    assert main(["theory", "--n", "256", "--s", "1", "50", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "eq.(4) b_max" in out and "||L*-M~||" in out
    assert len([l for l in out.splitlines() if l.strip().startswith(("4.00", "16.00", "64.00", "256.00"))]) == 8


def test_theory_writes_csv_and_rejects_bad_values(tmp_path, capsys):
    assert main(["theory", "--sigma", "2", "8", "--s", "10", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bounds.csv").read_text().splitlines()[0].startswith("sigma,s,psi,")
    assert len((tmp_path / "bounds.csv").read_text().splitlines()) == 3
    assert main(["theory", "--delta", "1.5"]) == 2
    assert "--delta" in capsys.readouterr().err


def test_demo_quick_writes_table_and_figure(tmp_path, capsys):
    assert main(["demo", "--quick", "--qkv", "random", "--n", "256", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "||T*-T~||_max" in out and "figure1.png" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    rows = data["rows"]
    assert {r["s"] for r in rows} == {1, 10, 100}
    # more samples, smaller max-norm error (averaged over heads)
    err = {s: sum(r["max_norm"] for r in rows if r["s"] == s) for s in (1, 100)}
    assert err[100] < err[1]
    assert (tmp_path / "figure1.png").stat().st_size > 10_000
