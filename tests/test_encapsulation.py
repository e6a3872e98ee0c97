"""No module reads or writes another object's private state (``obj._name`` with ``obj`` other
than ``self`` / ``cls``): a part's internals stay its own, and what others need is a public
method or property (DESIGN.md: each concept in one place)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"

# Underscore names that are public API of the standard library.
ALLOWED = {"os._exit", "sys._getframe",
           # CPython's: the one way to run the exit handlers before os._exit (daemon/server.py)
           "atexit._run_exitfuncs",
           "config._attn_implementation"}  # transformers: the attention in use has no public getter
GENERATED = ("_pb2.py", "_pb2_grpc.py")
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _private_reads(path: pathlib.Path, root: pathlib.Path = ROOT.parent) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE_API:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if text not in ALLOWED:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_no_module_reaches_into_another_objects_private_state():
    # protoc's generated modules (committed, never edited by hand) are not ours to judge
    found = [hit for path in sorted(ROOT.rglob("*.py")) if not path.name.endswith(GENERATED)
             for hit in _private_reads(path)]
    assert not found, ("private state used from outside its object (add a public method or "
                       "property):\n" + "\n".join(found))


def test_the_check_sees_private_access(tmp_path):
    """The check itself: ``self.cache._seqs`` (the access this test was written for) is seen."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(self, cache):\n    return self.cache._seqs, cache._next_id, self._ok\n")
    assert [h.split(": ")[1] for h in _private_reads(probe, tmp_path)] == ["self.cache._seqs", "cache._next_id"]
