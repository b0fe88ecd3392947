"""Equal-cost frontier: positional LSH against exact ALiBi cut at a per-head window, on SmolLM2's
Q/K/V of real text and on random Q/K/V (error vs keys per query, error vs CPU time).

A thin wrapper of the app job ``poslsh frontier``
(``paper/poslsh_paper/experiments/frontier.py``; ``docs/frontier.md`` explains the study): every
flag of that command works here.

* ``python benchmarks/frontier.py --quick``: a smoke run (n = 256, well under a minute), to
  ``outputs/frontier/quick``;
* ``python benchmarks/frontier.py --out results/frontier --checkpoints outputs/frontier/checkpoints``:
  the committed reference (n = 1,024 / 4,096 / 16,384; about 30 CPU minutes on 2 cores); resumable;
* ``python benchmarks/frontier.py --out results/frontier --only-timing``: re-time every method of
  the committed report on the torch backend (e.g. once ``windowed_alibi_attention`` has a torch
  backend) without recomputing an error (a few CPU minutes).
"""
from __future__ import annotations

import sys

from poslsh_paper.cli import main

if __name__ == "__main__":
    sys.exit(main(["frontier", *sys.argv[1:]]))
