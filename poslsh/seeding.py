"""Stable seeds: one hash for every seed the library derives from its parts.

Partitions of a training step (``seed, step, layer``), dropout of a step and rank,
and the per-input draws of the convergence experiment all come from
:func:`stable_seed`, so a run is reproducible across processes and machines
(Python's own ``hash`` is salted per process).
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["stable_seed", "generator"]


def stable_seed(*parts) -> int:
    """A 63-bit seed from ``parts`` (their ``str`` joined by ``:``), stable everywhere."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`stable_seed` of ``parts``."""
    return torch.Generator().manual_seed(stable_seed(*parts))
