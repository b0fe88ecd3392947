"""``poslsh audit``: the checks are computed right, fail when they should, and the
command runs on a tiny random Llama (no model package, no corpus)."""
import json
import math

import pytest

from poslsh.cli import main
from poslsh.experiments import audit
from poslsh.experiments.audit import AuditConfig, allowed_violations, c3_constant, output_checks


def test_constants():
    # C3 turns Theorem 2.2's Delta_P (||P||_{2,inf} = 1) into eq. (3)'s eps exactly
    n, delta, s = 4096, 0.05, 1000
    from poslsh import theory
    assert c3_constant(n, delta) == pytest.approx(0.948, abs=1e-3)
    assert theory.delta_p(1.0, 8.0, n, s, delta, c3_constant(n, delta)) == pytest.approx(
        theory.max_norm_deviation_bound(n, s, delta))
    assert allowed_violations(100, 0.05) >= 5 and allowed_violations(100, 0.05) <= 15
    assert allowed_violations(10, 0.05) >= 1


def test_matrix_checks_pass_on_small_n():
    cfg = AuditConfig(n_matrix=96, trials=6, samples=(1, 10, 100, 1000), slope_tol=0.15)
    sigmas = [1.41, 8.0, 64.0]
    rows = audit.matrix_trials(cfg, sigmas)
    assert len(rows) == 6 * 3 * 4
    table, details = audit.matrix_checks(rows, cfg, heads=[0, 1, 2])
    assert len(table) == 9
    assert all(r["result"] == "PASS" for r in table), audit.format_table(table)
    for d in details["eq3"]:
        assert d["quantile"] < d["bound"]


def _record(draw, t_err, beta=0.5, mx=0.01, s=1000, head=0, sigma=2.0, v_max=1.0):
    return dict(draw=draw, head=head, sigma=sigma, s=s, t_err=t_err, beta_star=beta, p_2inf=1.0, v_max=v_max,
                max=mx)


def test_output_checks_detect_violations():
    n, delta = 1024, 0.05
    ok = [_record(d, 1e-4) for d in range(20)]
    table, det = output_checks(ok, n, delta)
    assert [r["result"] for r in table] == ["PASS", "PASS"]
    # the smallest C solves 2 C D / (beta - C D) v = err
    D = math.sqrt(math.log(n / delta) / 1000)
    c = det[0]["C_max"]
    assert 2 * c * D / (0.5 - c * D) == pytest.approx(1e-4)
    # errors far above the bound in every draw: Theorem 2.2 and the deterministic step both fail
    bad = [_record(d, 5.0) for d in range(20)]
    table, det = output_checks(bad, n, delta)
    assert [r["result"] for r in table] == ["FAIL", "FAIL"]
    assert det[0]["deterministic_violations"] == 20
    # s below log(n/delta) is outside the theorem and ignored
    assert output_checks([_record(0, 5.0, s=5)], n, delta)[0] == []


def test_audit_cli_on_tiny_model(tmp_path, tiny_model_dir):
    pytest.importorskip("transformers")
    model = tiny_model_dir
    out = tmp_path / "audit"
    rc = main(["audit", "--model", str(model), "--inputs-from", "random", "--num-heads", "6",
               "--n-matrix", "64", "--trials", "4", "--samples", "1", "10", "100", "--slope-tol", "0.3",
               "--n-output", "96", "--inputs", "1", "--draws", "2", "--output-samples", "100", "1000",
               "--layers", "0", "1", "--convergence-rows", "", "--out", str(out)])
    res = json.loads((out / "audit.json").read_text())
    assert (out / "audit.md").read_text().startswith("| check |")
    checks = {r["check"] for r in res["table"]}
    assert {"eq. (3) max-norm", "eq. (4) block size", "spectral decay (eq. 1/2)", "Thm 2.2 output bound",
            "Thm 2.2 deterministic step"} <= checks
    assert all(r["result"] == "PASS" for r in res["table"] if r["check"] != "spectral decay (eq. 1/2)")
    assert rc == (0 if res["passed"] else 1)
    assert len(res["output"]["heads"]) == 4 and all(h["deterministic_violations"] == 0
                                                   for h in res["output"]["heads"])


def test_quick_preset_and_markdown(tmp_path):
    q = audit.PRESETS["quick"]
    assert (q.n_matrix, q.trials, q.inputs, q.draws, q.out) == (512, 20, 2, 2, "results/audit/quick")
    table = [dict(check="a|b", subject="s", result="PASS")]
    assert audit.format_table(table, markdown=True).splitlines()[2] == "| a\\|b | s |  |  |  |  |  | PASS |  |"


def test_missing_model_skips_output_checks(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "audit"
    rc = main(["audit", "--model", str(tmp_path / "none"), "--n-matrix", "48", "--trials", "3", "--samples", "1",
               "10", "--slope-tol", "2", "--convergence-rows", "", "--out", str(out)])
    res = json.loads((out / "audit.json").read_text())
    assert res["table"][-1]["result"] == "SKIP" and "not a local Hugging Face model" in res["table"][-1]["note"]
    assert rc == (0 if res["passed"] else 1)
