"""The one ``interpret`` fixture of the Triton tests: kernels on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, set per test, so the rest of the suite is unaffected), skipped
with the reason when the installed triton cannot interpret. A test module that sets
``SMALL_TILES = True`` gets 32 x 32 tiles, so that small awkward sizes already span several tiles;
one that sets ``INTERPRET_TILES = (bm, bn)`` gets those (fewer programs: faster)."""
from __future__ import annotations

import pytest


@pytest.fixture
def interpret(monkeypatch, request):
    pytest.importorskip("triton")
    from poslsh.ops.triton import _config, _launch

    problem = _config.interpreter_problem()
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if getattr(request.module, "SMALL_TILES", False):
        for name in ("fwd", "dq", "dkdv"):
            monkeypatch.setitem(_launch.INTERPRET_BLOCKS, name, (32, 32))
    tiles = getattr(request.module, "INTERPRET_TILES", None)
    if tiles is not None:
        for name in ("fwd", "dq", "dkdv"):
            monkeypatch.setitem(_launch.INTERPRET_BLOCKS, name, tuple(tiles))
    yield monkeypatch
