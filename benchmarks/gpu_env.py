"""What the GPU scripts run with, in one line: the interpreter, torch (and its GPU), triton, numpy and
transformers, each with where it comes from, so a run's results name their versions.

``python benchmarks/gpu_env.py [--out DIR] [--dry-run]``: prints the line (and, with ``--out``, writes it
as the ``env`` row of ``DIR/results.md``). In the dry run a second line says when Triton's interpreter
cannot run the kernels here (triton < 3.9 with numpy >= 2.4, triton-lang/triton#9171): every Triton row
of the stages is then ``unavailable`` with that reason, as the tests skip with it. Exit status 2 when
the interpreter has no torch (the wrong python: gpu_stages.sh takes .venv/bin/python when it exists).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _where(module) -> str:
    """``bundle`` (the carried wheels of ``make gpu-bundle``), ``tree`` or ``installed``."""
    path = os.path.abspath(getattr(module, "__file__", "") or "")
    if os.environ.get("POSLSH_GPU_BUNDLE") and path.startswith(os.path.abspath(os.environ["POSLSH_GPU_BUNDLE"])):
        return "from .gpu"
    return "installed"


def versions() -> str:
    import torch

    parts = [f"python {sys.executable} ({sys.version.split()[0]})"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    parts.append(f"torch {torch.__version__} ({gpu})")
    for name in ("triton", "numpy", "transformers"):
        try:
            mod = importlib.import_module(name)
            parts.append(f"{name} {mod.__version__}" + (f" ({_where(mod)})" if name == "transformers" else ""))
        except ImportError:
            parts.append(f"{name} missing")
    return ", ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder of results.md / results.csv (the env row)")
    p.add_argument("--dry-run", action="store_true", help="also say whether Triton's interpreter runs here")
    args = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"gpu_env: {sys.executable} has no torch ({e}): run from the project's environment (make setup "
              "creates .venv, which the script takes when it exists) or set PYTHON=/path/to/python",
              file=sys.stderr)
        return 2
    sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]
    line = versions()
    print(f"env: {line}")
    problem = None
    if args.dry_run:
        from gpu_common import interpreter_problem
        problem = interpreter_problem()
        if problem:
            print(f"dry run: every Triton row is unavailable here: {problem}")
    if args.out:
        from gpu_rows import Recorder
        rec = Recorder(args.out, "env")
        rec.row("versions", "info", detail=line, quiet=True)
        if problem:
            rec.row("Triton interpreter", "unavailable", detail=problem, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
