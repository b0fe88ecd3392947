"""The house rules, checked on the source of the library (``poslsh``) and of the paper's app
(``paper/poslsh_paper``), see docs/architecture.md: every import points down the floors (a package's
``__init__`` included, which runs before any of its modules), the library never imports the app, no
import cycles, no oversized modules."""
import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"poslsh": REPO / "poslsh", "poslsh_paper": REPO / "paper" / "poslsh_paper"}

# Lowest floor first. A module may import from its own floor or any floor below it.
# The library's floors come first, the app's after them: the library never imports the app.
FLOORS: List[Tuple[str, List[str]]] = [
    ("base", ["poslsh._validation", "poslsh.threads", "poslsh.seeding"]),
    ("core math", ["poslsh.alibi", "poslsh.cost", "poslsh.documents", "poslsh.merge", "poslsh.sampling",
                   "poslsh.widths"]),
    # the positional protocol and the kinds that implement it
    # (poslsh.window: the window's package, whose face is its kind; its theory and op sit on their floors)
    ("positional kinds", ["poslsh.positional", "poslsh.partitions", "poslsh.partitions_nd", "poslsh.window",
                          "poslsh.window.kind"]),
    # what is proved or computed densely about the kinds: below every op
    ("theory and oracles", ["poslsh.theory", "poslsh.window.theory", "poslsh.reference"]),
    ("op", ["poslsh.ops", "poslsh.attention", "poslsh.window.op", "poslsh.distributed", "poslsh.decoding"]),
    ("modules", ["poslsh.modules", "poslsh"]),  # "poslsh" = the package's public face
    ("integrations", ["poslsh.integrations"]),      # the tested transformers range
    # the Hugging Face integration (poslsh/integrations/hf/): the pieces both families of models share, the
    # cache they both decode on, the families side by side (each its own sub-package), the public face
    ("hf shared", ["poslsh.integrations.hf.config", "poslsh.integrations.hf.masks", "poslsh.integrations.hf.rows",
                   "poslsh.integrations.hf.dense"]),
    ("hf cache", ["poslsh.integrations.hf.cache"]),
    ("hf model families", ["poslsh.integrations.hf.schemes", "poslsh.integrations.hf.alibi",
                           "poslsh.integrations.hf.encoders"]),
    ("hf public face", ["poslsh.integrations.hf"]),
    # ---- the paper's app (paper/poslsh_paper)
    ("app base", ["poslsh_paper", "poslsh_paper.io", "poslsh_paper.timing"]),
    ("analysis, data, models", ["poslsh_paper.analysis", "poslsh_paper.data", "poslsh_paper.models"]),
    ("experiments", ["poslsh_paper.experiments"]),
    ("cli", ["poslsh_paper.cli", "poslsh_paper.__main__"]),
]
LIBRARY_FLOORS = 11
MAX_LINES = 420


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, Path] = {module_name(root, p): p for root in PACKAGES.values() for p in root.rglob("*.py")}


def floor_of(module: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            hit = module == p if p in PACKAGES else (module == p or module.startswith(p + "."))
            if hit and len(p) > best:
                best, level = len(p), i
    if level is None:
        raise AssertionError(f"module {module} is on no floor: add it to FLOORS and docs/architecture.md")
    return level


def imports_of(module: str) -> Set[str]:
    """poslsh modules imported anywhere in ``module`` (function-level imports included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports the module pkg.mod when it exists
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:     # `import poslsh.ops.triton._launch` etc.
                name = name.rpartition(".")[0]
            if name.split(".")[0] in PACKAGES and name != module:
                out.add(name)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_import_points_down():
    upward = [f"{m} (floor {FLOORS[floor_of(m)][0]!r}) imports {t} (floor {FLOORS[floor_of(t)][0]!r})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if floor_of(t) > floor_of(m)]
    print("\n".join(upward) or "no upward imports")
    assert not upward, "upward imports:\n" + "\n".join(upward)


# The public faces: importing one runs everything below it anyway (the library, the app, and the Hugging
# Face integration, whose face registers its attention implementations with transformers on import).
ROOTS = set(PACKAGES) | {"poslsh.integrations.hf"}
SUBPACKAGES = sorted(m for m, path in MODULES.items() if path.name == "__init__.py" and m not in ROOTS)


def packages_above_their_modules(floor) -> List[str]:
    return [f"{p} (floor {FLOORS[floor(p)][0]!r}) holds {m} (floor {FLOORS[floor(m)][0]!r})"
            for p in SUBPACKAGES for m in sorted(MODULES) if m.startswith(p + ".") and floor(p) > floor(m)]


def test_a_package_sits_no_higher_than_its_modules():
    """Importing any module runs its packages' ``__init__`` first: a package whose ``__init__`` sits
    above one of its modules (e.g. imports an op while holding a positional kind) is an upward arrow
    the import statements do not show. The roots (the public faces) are exempt."""
    high = packages_above_their_modules(floor_of)
    print("\n".join(high) or "every package sits on its lowest module's floor or below")
    assert not high, "packages above their modules:\n" + "\n".join(high)


def test_no_import_cycles():
    state: Dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    print("\n".join(cycles) or "no cycles")
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_library_never_imports_the_app():
    """Not even lazily, nor by a module name in a string (``importlib.import_module``)."""
    offenders = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if m.split(".")[0] == "poslsh"
                 for t in sorted(targets) if t.split(".")[0] == "poslsh_paper"]
    offenders += [f"{m} names poslsh_paper" for m, path in sorted(MODULES.items())
                  if m.split(".")[0] == "poslsh" and "poslsh_paper" in path.read_text()]
    assert not offenders, "the library imports the app:\n" + "\n".join(offenders)
    assert all(floor_of(m) < LIBRARY_FLOORS for m in MODULES if m.split(".")[0] == "poslsh")
    assert all(floor_of(m) >= LIBRARY_FLOORS for m in MODULES if m.split(".")[0] == "poslsh_paper")


def test_the_checker_sees_violations():
    """The two rules above can fail: an upward import and a cycle are detected."""
    assert floor_of("poslsh_paper.experiments.lm.loop") > floor_of("poslsh.partitions")
    assert floor_of("poslsh.ops.triton._launch") == floor_of("poslsh.attention")
    assert "poslsh.ops.registry" in GRAPH["poslsh.ops.triton"]       # from ..registry import ...
    assert "poslsh.partitions" in GRAPH["poslsh.ops.triton._plan"]   # from ...partitions import ...
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("poslsh_other")
    # the window's package on the op floor (as when its __init__ imported the op) would be caught
    op_floor = floor_of("poslsh.attention")
    moved = lambda m: op_floor if m == "poslsh.window" else floor_of(m)  # noqa: E731
    assert any(h.startswith("poslsh.window ") and "poslsh.window.kind" in h for h in packages_above_their_modules(moved))


HF_FAMILIES = ("poslsh.integrations.hf.schemes", "poslsh.integrations.hf.alibi", "poslsh.integrations.hf.encoders")


def hf_family(module: str):
    return next((f for f in HF_FAMILIES if module == f or module.startswith(f + ".")), None)


def test_the_hf_families_of_models_never_import_each_other():
    """The families of models share the floors below them (the cache, rows, masks, config) and nothing else:
    a new family is a sibling package, and no family reaches into another."""
    crossing = [f"{m} imports {t}" for m, targets in sorted(GRAPH.items()) if hf_family(m)
                for t in sorted(targets) if hf_family(t) not in (None, hf_family(m))]
    assert not crossing, "one family of models imports another:\n" + "\n".join(crossing)
    assert hf_family("poslsh.integrations.hf.alibi.families.bloom") == "poslsh.integrations.hf.alibi"
    assert hf_family("poslsh.integrations.hf.cache") is None
    assert (floor_of("poslsh.integrations") < floor_of("poslsh.integrations.hf.rows")
            < floor_of("poslsh.integrations.hf.cache.heads") < floor_of("poslsh.integrations.hf.alibi.attend")
            == floor_of("poslsh.integrations.hf.schemes.attention") < floor_of("poslsh.integrations.hf"))


def test_modules_stay_small():
    big = []
    for m, path in sorted(MODULES.items()):
        rel = str(path.relative_to(REPO))
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            big.append(f"{rel}: {lines} lines")
    print("\n".join(big) or f"every module <= {MAX_LINES} lines")
    assert not big, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(big)


# ------------------------------------------------------------------ the positional protocol
KIND_CLASSES = {"Partitions", "AlibiWindow", "PartitionsND"}
PROTOCOL = "poslsh.positional"
MAX_SWITCH_FILES = 2        # the protocol module and at most one kind file


def _names(node) -> Set[str]:
    """Class names in an isinstance target (a name, an attribute, or a tuple of them)."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def kind_switches(source: str) -> List[str]:
    """Where ``source`` tells the positional kinds apart: ``isinstance`` on a kind class, a call of
    ``op_of``, or a comparison of an ``.op`` with a string (each kind answers for itself instead)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name == "isinstance" and len(node.args) == 2 and _names(node.args[1]) & KIND_CLASSES:
                out.append(f"line {node.lineno}: isinstance(..., {sorted(_names(node.args[1]) & KIND_CLASSES)})")
            elif name == "op_of":
                out.append(f"line {node.lineno}: op_of(...)")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "op" \
                and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators):
            out.append(f"line {node.lineno}: .op == {node.comparators[0].value!r}")
    return out


def test_kinds_are_told_apart_in_at_most_two_files():
    """Positional kinds answer for themselves (poslsh.positional): no module switches on the kind,
    except the protocol and at most one kind file (a PartitionsND checks its axes are Partitions)."""
    found = {m: kind_switches(path.read_text()) for m, path in sorted(MODULES.items()) if m.split(".")[0] == "poslsh"}
    found = {m: hits for m, hits in found.items() if hits}
    print("\n".join(f"{m}: {'; '.join(h)}" for m, h in found.items()) or "no switches on positional kinds")
    kind_files = [m for m in found if m != PROTOCOL]
    assert len(found) <= MAX_SWITCH_FILES and len(kind_files) <= 1, f"switches on positional kinds: {found}"
    assert all(floor_of(m) == floor_of(PROTOCOL) for m in found), f"switches outside the kinds' floor: {found}"


def test_the_switch_checker_sees_switches():
    assert kind_switches("isinstance(p, (Partitions, int))") and kind_switches("poslsh.decoding.op_of(p)")
    assert kind_switches("if call.positional.op == 'window': pass")
    assert not kind_switches("isinstance(p, Positional)") and not kind_switches("type(a) is type(b)")


def test_the_new_rooms_have_floors():
    """The protocol sits with the kinds, the window's object below the theory, its op with the ops."""
    assert floor_of("poslsh.positional") == floor_of("poslsh.partitions") == floor_of("poslsh.window.kind")
    assert floor_of("poslsh.window.kind") < floor_of("poslsh.reference") < floor_of("poslsh.window.op")
    assert floor_of("poslsh.window") == floor_of("poslsh.window.kind") < floor_of("poslsh.window.theory")
    assert floor_of("poslsh.ops.call") == floor_of("poslsh.attention") > floor_of("poslsh.theory")
    assert floor_of("poslsh.ops.torch.ops") == floor_of("poslsh.ops.triton._ops") == floor_of("poslsh.ops")
