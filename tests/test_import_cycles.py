"""No import circle in ``prefixd/``, module to module (DESIGN.md "no import circle").

The graph has an edge A -> B when module A names module B in any import statement: at the top,
inside a function, under ``if TYPE_CHECKING``; a circle through a deferred import is still two
modules that cannot be read, tested or moved one without the other. ``from P import N`` is an
edge to ``P.N`` when that is a module, else to ``P``. A package's ``__init__`` counts as the
module ``P`` itself; importing ``P.M`` is an edge to ``P.M`` only (Python also runs ``P``'s
``__init__`` first, but that is the package's own layout, not a dependency between modules).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module under ``root``."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: imported_modules(path, modules) - {name} for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) for each strongly connected group of two or more
    modules (Tarjan's algorithm, iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return [_one_circle(graph, group) for group in groups]


def _one_circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest path from ``group[0]`` back to itself inside ``group`` (breadth first)."""
    members = set(group)
    first = group[0]
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == first:  # node != first: the graph has no self-edges
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [first]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{group} is not strongly connected")


def describe(graph: dict[str, set[str]]) -> list[str]:
    """One line per circle group: its modules, and one circle through them."""
    lines = []
    for circle in circles(graph):
        group = sorted(_reaching(graph, circle[0]) & _reached(graph, circle[0]))
        lines.append(f"{' -> '.join(circle)}  (modules in the group: {', '.join(group)})")
    return lines


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _reaching(graph: dict[str, set[str]], start: str) -> set[str]:
    reverse: dict[str, set[str]] = {name: set() for name in graph}
    for name, targets in graph.items():
        for target in targets:
            reverse[target].add(name)
    return _reached(reverse, start)


def test_the_package_has_no_import_circle():
    found = describe(import_graph())
    assert not found, ("import circles (break each by moving what both sides need into a "
                       "module below both):\n" + "\n".join(found))


def test_a_circle_is_found_and_named(tmp_path):
    """The check itself: a circle through an import inside a function is found and named; a
    tree without one passes."""
    pkg = tmp_path / "prefixd"
    (pkg / "part").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "part" / "__init__.py").write_text("from prefixd.part.a import A\n")
    (pkg / "part" / "a.py").write_text("from prefixd.part import b\nA = 1\n")
    (pkg / "part" / "b.py").write_text("def f():\n    from prefixd.part.c import C\n")
    (pkg / "part" / "c.py").write_text("import os\nC = 2\n")
    assert circles(import_graph(pkg)) == []
    (pkg / "part" / "c.py").write_text("def g():\n    import prefixd.part.a\nC = 2\n")
    assert circles(import_graph(pkg)) == [["prefixd.part.a", "prefixd.part.b", "prefixd.part.c",
                                           "prefixd.part.a"]]
