"""The README's backend table says what the registry says: every backend, op and feature it claims
is registered, and every registered one is in the table (tests the claims, not the prose)."""
from pathlib import Path

import torch

import poslsh  # noqa: F401  (registers every backend)
from poslsh.ops import registry

README = Path(__file__).resolve().parents[1] / "README.md"
COLUMNS = {"positions": "spans", "packed": "documents", "lse": "lse"}    # column -> registry feature
OPTIONAL = {"triton": "triton is not installed", "flex": "this torch has no FlexAttention"}


def table():
    """``{backend: {column: cell}}`` of the README's backend table."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| backend | device | ops |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header, cells))
    return rows


def ops_in(cell: str) -> set:
    return set() if cell in ("—", "-", "") else {o.strip() for o in cell.split(",")}


def test_every_registered_backend_is_in_the_table_and_the_reverse():
    rows, backends = table(), {b.name for b in registry.registered()}
    assert backends <= set(rows), f"backends missing from the README table: {sorted(backends - set(rows))}"
    unregistered = set(rows) - backends
    assert all(name in OPTIONAL for name in unregistered), f"the README lists unknown backends {unregistered}"


def mismatches(rows, backends):
    """Where the table's ops or feature cells differ from the registry (empty: they agree)."""
    out = []
    for backend in backends:
        row = rows[backend.name]
        if ops_in(row["ops"]) != set(backend.fns):
            out.append((backend.name, "ops", row["ops"], sorted(backend.fns)))
        for column, feature in COLUMNS.items():
            want = {op for op in backend.fns if feature in backend.features[op]}
            if ops_in(row[column]) != want:
                out.append((backend.name, column, row[column], sorted(want)))
    return out


def test_ops_and_features_match_the_registry():
    """Each op and feature cell lists exactly the ops the backend registered with that feature."""
    backends = registry.registered()
    assert len(backends) >= 2            # torch and reference at least, whatever is installed
    assert not mismatches(table(), backends)


def test_the_device_column_matches_what_runs_on_the_cpu():
    """A backend whose row names the CPU (or "any") runs on CPU tensors; one that does not, does not."""
    q = torch.zeros(1, 1, 1, 8)
    for backend in registry.registered():
        device = table()[backend.name]["device"]
        claims_cpu = "CPU" in device or device == "any"
        assert claims_cpu == (backend.why_not(q) is None), (backend.name, device, backend.why_not(q))


def test_the_checker_sees_a_wrong_claim():
    """The table of 0.2 (triton: the sequence op only, no packing, no lse; the grid op with positions)
    fails the check."""
    rows = table()
    rows["torch"] = dict(rows["torch"], positions="sequence, window, nd")
    if "triton" in rows:
        rows["triton"] = dict(rows["triton"], ops="sequence", packed="—", lse="—")
    found = mismatches(rows, registry.registered())
    assert ("torch", "positions") in {(m[0], m[1]) for m in found}
    assert ops_in("sequence, window") == {"sequence", "window"} and ops_in("—") == set()


def test_the_window_page_lists_every_backend_of_the_window_op():
    """docs/window.md's backend table names exactly the backends registered for the window op
    (an optional one that is not installed here may be listed)."""
    lines = (README.parent / "docs" / "window.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| backend |"))
    listed = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        listed.add(line.strip("|").split("|")[0].strip().strip('`"'))
    registered = {b.name for b in registry.registered("window")}
    assert registered <= listed, f"docs/window.md misses {sorted(registered - listed)}"
    assert all(name in registered or name in OPTIONAL for name in listed), listed
