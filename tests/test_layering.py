"""The parts depend one way (DESIGN.md "The parts and which way they depend"), for every module.

A part is a subpackage of ``prefixd`` or a declared bottom-layer module (``crashpoints``); the
package's top level holds nothing else but ``__init__``. ``config`` (every setting, validated,
TOML in and out) imports only ``api``, so every part above ``api`` may use it, the client
included (its default socket path is the daemon's). tests/test_import_cycles.py checks that no
two modules import each other, inside a part too.

A module that names another part's module as a string to run it as a child process
(``python -m prefixd.x.y``) depends on it as surely as an import, so such strings are checked
too, and the few allowed are declared in ``RUNS`` with their reason. The client has exactly one:
``prefixctl verify`` runs ``prefixd.tools.verify`` as a child process, because the check opens
the engine's files with the engine's own recovery (wal, storage, torch: none of which the client
may load), and because a damaged LMDB file can kill its reader with SIGSEGV/SIGBUS, which a
child process turns into a report instead of a dead ``prefixctl``.
"""

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"
MODULE_NAME = re.compile(r"prefixd(\.[A-Za-z_][A-Za-z0-9_]*)+")

# part -> the parts of ours it may import. ``crashpoints`` is a bottom layer any part may use;
# ``config`` imports only ``api`` and every other part may use it.
ALLOWED = {
    "crashpoints": {"config"},
    "api": set(),
    "config": {"api"},
    "kernels": {"config"},
    "wal": {"config", "crashpoints"},
    "storage": {"api", "config", "kernels", "crashpoints"},  # never the WAL: storage emits events, the engine logs them
    "cache": {"api", "config", "storage", "crashpoints"},    # the in-memory core: no WAL, no engine
    "engine": {"api", "config", "kernels", "wal", "storage", "cache", "crashpoints"},
    "daemon": {"api", "config", "kernels", "wal", "storage", "cache", "engine", "crashpoints"},
    "client": {"api", "config", "kernels"},
    "tools": {"api", "config", "kernels", "wal", "storage", "cache", "engine", "crashpoints",
              "client"},
}

# part -> the modules of parts it may not import that it may run as a child process
RUNS = {
    "client": {"prefixd.tools.verify"},  # prefixctl verify: see the module docstring
    "tools": {"prefixd.daemon.cli"},     # the daemon process the demos and benchmarks drive
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
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "prefixd":  # ``from prefixd import part``
                found.update(f"prefixd.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add(f"<relative import, level {node.level}>")
    return found


def _part_of_path(rel: pathlib.PurePath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_belongs_to_a_declared_part():
    unknown = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if _part_of_path(p.relative_to(ROOT)) not in ALLOWED | {"__init__": None}]
    assert not unknown, f"modules outside every declared part (add the part to ALLOWED): {unknown}"


def test_parts_import_only_parts_above_them():
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        part = _part_of_path(rel)
        for module in _imports(path):
            if module.startswith("<relative"):
                violations.append(f"{rel}: {module} (write absolute imports)")
                continue
            target = _part_of(module)
            if target is None or target == part:
                continue
            if part == "__init__" or target not in ALLOWED[part]:
                violations.append(f"{rel} imports {module}")
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_nothing_imports_the_daemon_or_the_tools():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        part = _part_of_path(path.relative_to(ROOT))
        for module in _imports(path):
            if _part_of(module) in ("daemon", "tools") and _part_of(module) != part:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, f"only the daemon and the tools are at the top: {offenders}"


def test_no_two_modules_share_a_name():
    """A newcomer must tell modules apart by name (``errors.py``, one per part, is the exception)."""
    by_name = collections.defaultdict(list)
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "errors.py"):
            by_name[path.name].append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"module names used more than once: {shared}"


def _named_modules(path: pathlib.Path) -> set[str]:
    """The string constants of ``path`` that name a module of ours (``"prefixd.tools.verify"``
    in ``[sys.executable, "-m", ...]``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and MODULE_NAME.fullmatch(node.value)):
            continue
        where = ROOT.joinpath(*node.value.split(".")[1:])
        if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file():
            found.add(node.value)
    return found


def test_parts_run_only_the_declared_modules_of_other_parts():
    """A child process of another part's module is declared in ``RUNS`` (the client's one:
    ``prefixctl verify``), and a declared one is still there (a stale rule would hide a new
    one)."""
    violations, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        part = _part_of_path(path.relative_to(ROOT))
        for module in _named_modules(path):
            target = _part_of(module)
            if target == part or (part != "__init__" and target in ALLOWED[part]):
                continue
            if module in RUNS.get(part, ()):
                used.add((part, module))
            else:
                violations.append(f"{path.relative_to(ROOT)} names {module}")
    assert not violations, ("modules of other parts run without a rule in RUNS:\n"
                            + "\n".join(violations))
    declared = {(part, module) for part, modules in RUNS.items() for module in modules}
    assert used == declared, f"rules in RUNS that no module uses: {sorted(declared - used)}"
