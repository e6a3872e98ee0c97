"""The parts depend one way (DESIGN.md "The parts and which way they depend")."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"

# part -> the parts of ours it may import
ALLOWED = {
    "api": set(),
    "kernels": set(),
    "wal": set(),
    "storage": {"api", "kernels"},  # never the WAL: storage emits events, the engine logs them
    "cache": {"api", "kernels", "wal", "storage"},
    "daemon": {"api", "kernels", "wal", "storage", "cache"},
    "client": {"api", "kernels"},
}


def _part_of(module: str) -> str | None:
    pieces = module.split(".")
    if pieces[0] != "prefixd" or len(pieces) < 2:
        return None
    return pieces[1]


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_parts_import_only_parts_above_them():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if len(rel.parts) < 2:
            continue  # prefixd/__init__.py, demo, workloads: top-level glue
        part = rel.parts[0]
        if part not in ALLOWED:
            continue
        for module in _imports(path):
            target = _part_of(module)
            if target is None or target == part or target not in ALLOWED:
                continue
            if target not in ALLOWED[part]:
                violations.append(f"{rel} imports {module}")
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_nothing_imports_the_daemon():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "daemon":
            continue
        if any(_part_of(m) == "daemon" for m in _imports(path)):
            offenders.append(str(rel))
    assert not offenders, f"these import prefixd.daemon: {offenders}"
