import json
import re

import pytest

from poslsh_paper.cli import commands, main, overview
from poslsh_paper.experiments import demo


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
    print(out[-600:])
    assert "||T*-T~||_max" in out and "figure1.png" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    # the crossover was measured (n = 256, and 512 if poslsh lost at 256) and printed, busy or not
    xo = data["crossover"]
    assert xo["s"] == 10 and [p["n"] for p in xo["points"]][:1] == [256] and len(xo["points"]) <= 2
    assert all(p["poslsh_ms"] > 0 and p["exact_ms"] > 0 for p in xo["points"])
    assert "crossover (s=10, 4 heads, measured)" in out
    t = data["timing"]
    assert t["wall_s"] > 0 and t["cpu_s"] > 0 and (t["warning"] is None) == ("WARNING" not in out)
    rows = data["rows"]
    assert {r["s"] for r in rows} == {1, 10, 100} and {r["sampler"] for r in rows} == {"iid", "grouped"}
    # more samples, smaller max-norm error (averaged over heads)
    err = {s: sum(r["max_norm"] for r in rows if r["s"] == s) for s in (1, 100)}
    assert err[100] < err[1]
    # each sampler against its own eq. (3) bound: grouped has fewer independent terms, a larger eps
    bound = {(r["sampler"], r["s"]): r["max_bound"] for r in rows}
    assert bound[("grouped", 100)] > bound[("iid", 100)] and bound[("grouped", 1)] == bound[("iid", 1)]
    assert "error ratio to iid at the same s" in out and "grouped s=100" in out
    assert (tmp_path / "figure1.png").stat().st_size > 10_000


def test_crossover_length_needs_a_lasting_win():
    pts = lambda *pairs: [dict(n=256 << i, poslsh_ms=p, exact_ms=e) for i, (p, e) in enumerate(pairs)]
    assert demo.crossover_length(pts((2, 1), (2, 1), (1, 2), (1, 4))) == 1024
    # a lucky win at a small n does not count when poslsh loses again later
    assert demo.crossover_length(pts((1, 2), (3, 1), (1, 2))) == 1024
    assert demo.crossover_length(pts((1, 2), (1, 3))) == 256
    assert demo.crossover_length(pts((2, 1), (2, 1))) is None


def test_crossover_goes_past_n_only_when_needed(monkeypatch):
    sig = demo.alibi_sigmas(2)
    monkeypatch.setattr(demo, "BUSY_CPU_PER_WALL", 0.0)        # never "busy" here
    won = demo.crossover(sig, 2, 64, start=32, head_dim=8, known=(1.0, 2.0))
    lost = demo.crossover(sig, 2, 64, start=32, head_dim=8, known=(2.0, 1.0))
    monkeypatch.setattr(demo, "BUSY_CPU_PER_WALL", 1e9)        # always "busy": 2n is not worth timing
    busy = demo.crossover(sig, 2, 64, start=32, head_dim=8, known=(2.0, 1.0))
    print(won, lost, busy, sep="\n")
    assert [p["n"] for p in won["points"]] == [32, 64] and won["points"][-1]["poslsh_ms"] == 1.0
    assert [p["n"] for p in lost["points"]] == [32, 64, 128] and lost["not_beyond"] is None
    assert [p["n"] for p in busy["points"]] == [32, 64] and busy["not_beyond"] == "the machine is busy"
    assert won["n"] in (32, 64) and lost["n"] in (None, 128) and busy["n"] is None


def test_busy_warning():
    quiet = demo.busy_warning(cpu_per_wall=1.6, load=0.5, cpus=2)
    starved = demo.busy_warning(cpu_per_wall=0.4, load=0.5, cpus=2)
    loaded = demo.busy_warning(cpu_per_wall=1.2, load=5.7, cpus=2)
    print(starved, loaded, sep="\n")
    assert quiet is None
    assert "0.40 s of CPU per wall-clock second" in starved and "not reliable" in starved
    assert "load average 5.7 on 2 CPUs" in loaded


@pytest.mark.parametrize("name", ["demo", "convergence", "audit"])
def test_no_promised_durations(name, capsys):
    """Durations nobody measured on the user's machine are not promised in help texts."""
    import importlib
    with pytest.raises(SystemExit):
        main([name, "--help"])
    text = capsys.readouterr().out + importlib.import_module(f"poslsh_paper.experiments.{name}").__doc__
    found = re.findall(r"(?:under|about|within|a few) \w* ?(?:seconds?|minutes?)", text)
    print(found)
    assert not found
