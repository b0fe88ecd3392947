"""The benchmark scripts depend on the library and on ``benchmarks/bench_common.py``, never on
the paper's app (``poslsh_paper``): read statically for every script, and checked by running
every ``bench_*.py --help`` in one process where importing the app fails."""
import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def app_imports(path: Path):
    """Every import of ``poslsh_paper`` in ``path`` (function-level ones included), and every
    string naming it (an ``importlib`` or ``-m poslsh_paper`` call)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "poslsh_paper"]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if (node.module or "").split(".")[0] == "poslsh_paper" else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = ["a string naming poslsh_paper"] if "poslsh_paper" in node.value else []
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names]
    return found


def test_no_benchmark_imports_the_app():
    assert SCRIPTS, "no benchmark scripts found"
    bad = {p.name: app_imports(p) for p in SCRIPTS}
    assert not {k: v for k, v in bad.items() if v}, f"benchmarks that import the app: {bad}"


def test_the_checker_sees_an_app_import(tmp_path):
    script = tmp_path / "bench_x.py"
    script.write_text("def f():\n    from poslsh_paper.io import atomic_write_json\n")
    assert app_imports(script) == ["line 2: poslsh_paper.io"]


def test_every_bench_script_answers_help_without_the_app():
    scripts = [str(p) for p in SCRIPTS if p.name.startswith("bench_") and p.name != "bench_common.py"]
    code = textwrap.dedent(f"""
        import contextlib, io, runpy, sys
        class NoApp:                     # importing the app fails, installed or not
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "poslsh_paper":
                    raise ImportError("a benchmark imported the app: " + name)
        sys.meta_path.insert(0, NoApp())
        sys.path.insert(0, {str(BENCHMARKS)!r})
        failed = []
        for script in {scripts!r}:
            sys.argv = [script, "--help"]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_path(script, run_name="__main__")
                failed.append(script + ": --help returned without exiting")
            except SystemExit as e:
                if e.code not in (0, None) or "usage" not in out.getvalue():
                    failed.append(f"{{script}}: exit {{e.code}}, output {{out.getvalue()[:200]!r}}")
            except BaseException as e:
                failed.append(f"{{script}}: {{type(e).__name__}}: {{e}}")
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}      # the library only: paper/ is not on the path
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
