"""The ``poslsh`` command: a thin argparse front over library functions.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds a parser and sets ``func`` to a callable taking the parsed args.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide subcommands (one line each; add yours here).
COMMAND_MODULES = [
    "poslsh.experiments.demo",
    "poslsh.experiments.theory_cmd",
    "poslsh.experiments.train",     # poslsh train
    "poslsh.experiments.lm_eval",   # poslsh eval, poslsh table
    "poslsh.experiments.convergence",  # poslsh convergence
    "poslsh.experiments.audit",        # poslsh audit
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poslsh", description="Positional-LSH attention tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
