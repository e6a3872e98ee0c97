"""Crash points: each name is one call site, and the docstring list and the kill -9 suite agree.

An armed ``name:n`` dies at the n-th pass of ``crash_point(name)``; two sites under one name make
``n`` count passes of both, so a test that means "the 9th disk sync" may die somewhere else.
"""

import ast
import collections
import pathlib
import re

import prefixd.crashpoints

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"


def _call_sites() -> dict[str, list[str]]:
    """name -> ``path:line`` of every ``crash_point("name")`` call under prefixd/."""
    sites = collections.defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "crash_point"):
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                    f"{path}:{node.lineno}: crash_point takes a string literal (so it can be found)"
                sites[arg.value].append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return sites


def test_every_crash_point_name_is_used_at_one_site_only():
    """Regression: ``data_synced``, ``data_written`` and ``checkpoint_inside`` were each used at
    two sites (engine and storage / log), so ``PREFIXD_CRASH=data_synced:9`` meant the 9th pass
    of either."""
    sites = _call_sites()
    assert sites, "no crash_point call found: the scan is broken"
    shared = {name: where for name, where in sites.items() if len(where) > 1}
    assert not shared, f"crash point names used at several sites: {shared}"


def test_the_docstring_and_the_kill9_suites_name_every_crash_point():
    """The engine's kill -9 suite arms the points its workload passes; the sparse pool file's
    grow and shrink points are armed by their own suite until the engine grows pool files."""
    from tests.crash.test_extents_kill9 import CRASH_POINTS as EXTENT_POINTS
    from tests.crash.test_kill9 import CRASH_POINTS

    names = set(_call_sites())
    items = [line for line in prefixd.crashpoints.__doc__.splitlines() if line.startswith("- ``")]
    listed = {name for line in items for name in re.findall(r"``(\w+)``", line.split(":")[0])}
    assert listed == names, \
        f"prefixd/crashpoints.py docstring lists {sorted(listed)}, code has {sorted(names)}"
    armed = set(CRASH_POINTS) | set(EXTENT_POINTS)
    assert armed == names, f"the kill -9 suites arm {sorted(armed)}, code has {sorted(names)}"
