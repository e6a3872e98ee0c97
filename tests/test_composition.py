"""Classes are split along a concept by composition, for every module of ``prefixd``.

Two rules (STYLE.md "One concept per module"), each checked on the source, not on imports:

1. No module-level function takes ``self`` as its first parameter: such a function is a method
   moved out of its class to keep a file short, writing the object's state from outside it.
   A function that builds state returns it; the constructor assigns it.
2. No class inherits from a *split-off half*: a plain class defined in the same part
   (subpackage of ``prefixd``) that exactly one class in ``prefixd`` inherits from and that no
   code of ``prefixd`` names except in that class's bases (nothing constructs it, checks for
   it or hands it on). Such a base is a file split by inheritance (a mixin that expects its
   host's attributes); it is held as a part instead. Not split-off halves, so allowed:
   exceptions, ABCs and protocols, NamedTuples, enums and typed dicts (they are types of their
   own), a base that several classes share, and a base used on its own.

``KNOWN_SPLITS`` names the splits not yet undone; the test fails when one is undone without
leaving the list, as when a new one appears.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefixd"

# Split-off halves still in the tree, each with why it stays for now.
KNOWN_SPLITS: set[str] = set()

# Bases that make a class a type of its own rather than a half of another class.
_TYPE_BASES = {"ABC", "Protocol", "NamedTuple", "TypedDict", "Enum", "IntEnum", "Flag", "IntFlag",
               "Exception", "BaseException", "Warning", "RuntimeError", "ValueError", "OSError",
               "KeyError", "LookupError", "TypeError"}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name.endswith("_pb2.py") or rel.name.endswith("_pb2_grpc.py"):
            continue  # generated code
        yield rel, ast.parse(path.read_text(), filename=str(path))


def _part(rel: pathlib.PurePath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):  # Generic[T], Protocol[T]
        return _base_name(node.value)
    return None


def functions_taking_self(modules) -> list[str]:
    """``module:function`` for every module-level function whose first parameter is ``self``."""
    found = []
    for rel, tree in modules:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args
                if params and params[0].arg == "self":
                    found.append(f"{rel}:{node.name}")
    return found


def split_off_bases(modules) -> list[str]:
    """``part: Class(Base)`` for every class inheriting from a split-off half (rule 2)."""
    classes = {}  # name -> (part, ClassDef); a name defined twice is ambiguous and skipped
    ambiguous = set()
    subclasses: dict[str, list[tuple[str, str]]] = {}
    named = set()  # names used other than as a base (a call, an isinstance, a variable...)
    for rel, tree in modules:
        part = _part(rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                if node.name in classes:
                    ambiguous.add(node.name)
                classes[node.name] = (part, node)
                for base in node.bases:
                    name = _base_name(base)
                    if name is not None:
                        subclasses.setdefault(name, []).append((part, node.name))
        as_bases = {id(base) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                    for base in node.bases}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and id(node) not in as_bases:
                named.add(_base_name(node))

    def is_type_of_its_own(name: str, seen=()) -> bool:
        if name in _TYPE_BASES or name.endswith(("Error", "Exception", "Warning")):
            return True
        if name not in classes or name in seen:
            return False
        node = classes[name][1]
        if any(isinstance(k.value, ast.Name) and k.value.id == "ABCMeta" for k in node.keywords):
            return True
        return any(is_type_of_its_own(b, seen + (name,))
                   for b in (_base_name(base) for base in node.bases) if b is not None)

    found = []
    for base, users in sorted(subclasses.items()):
        if base not in classes or base in ambiguous or len(users) != 1 or base in named:
            continue
        part, user = users[0]
        if classes[base][0] == part and not is_type_of_its_own(base):
            found.append(f"{part}: {user}({base})")
    return found


def test_no_module_level_function_takes_self():
    found = functions_taking_self(_modules())
    assert not found, (f"module-level functions taking self (a method moved out of its class): "
                       f"{found}; make the state a value the function returns, or a part the class holds")


def test_no_class_inherits_a_split_off_half_of_its_part():
    found = set(split_off_bases(list(_modules())))
    assert found <= KNOWN_SPLITS, (f"classes inheriting a base of their own part that exists only to split them "
                       f"(see the module docstring): {sorted(found - KNOWN_SPLITS)}; hold it as a part instead")
    assert found == KNOWN_SPLITS, f"undone, take them off KNOWN_SPLITS: {sorted(KNOWN_SPLITS - found)}"


def test_the_rules_flag_the_shapes_they_are_about():
    """Each rule catches the shape it names, and leaves the allowed ones alone."""
    src = '''
class Half:
    def step(self):
        return self.state

class Whole(Half):
    pass

class Shared:
    pass

class A(Shared):
    pass

class B(Shared):
    pass

class Failure(Exception):
    pass

class Specific(Failure):
    pass

class Standalone:
    pass

class Special(Standalone):
    pass

made = Standalone()

class Other:
    pass

class Pick(Other):
    pass

kind = Other if made else Pick

def moved(self, n):
    self.state = n

def fine(x, self=None):
    return x
'''
    modules = [(pathlib.PurePath("engine/example.py"), ast.parse(src))]
    assert functions_taking_self(modules) == ["engine/example.py:moved"]
    assert split_off_bases(modules) == ["engine: Whole(Half)"]
    other_part = [(pathlib.PurePath("engine/whole.py"), ast.parse("class Whole(Half):\n    pass\n")),
                  (pathlib.PurePath("daemon/half.py"), ast.parse("class Half:\n    pass\n"))]
    assert split_off_bases(other_part) == []
