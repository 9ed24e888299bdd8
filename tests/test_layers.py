"""The package's layers import one way: core <- attention <- models <- data <- integrations <- paths <- cli, and the
fixtures (``vlm_pack.testing``) above them all: nothing in the library imports them.

Every import of a vlm_pack module (module level or inside a function) is read from the source with ``ast`` and
checked against the floor of the importing module; all of them together (fixtures included) must form no cycle,
module level or inside a function (imports under ``if TYPE_CHECKING:`` never run and are not counted). The package
root keeps at most 10 modules besides the subpackages.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vlm_pack"
FLOORS = {"core": 1, "attention": 2, "models": 3, "data": 4, "integrations": 5,
          "offline": 6, "budget": 6, "preference": 6, "rl": 6, "streaming": 6,
          "sequence_parallel": 6, "cli": 7, "testing": 8}
ROOT_HELPERS = {"lazy_exports", "assets"}  # floor 0: standard-library helpers every layer may use


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package root's lazy export table names every layer on purpose
    if parts[1] in ROOT_HELPERS:
        return 0
    return FLOORS.get(parts[1])


def _imports(path: Path, source: str | None = None) -> list[tuple[str, bool]]:
    """(imported vlm_pack module, at module level) for every import statement of ``path`` (or ``source``)."""
    tree = ast.parse(path.read_text() if source is None else source)
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    unchecked = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node.test)
                 for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in unchecked:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target + "." + alias.name for alias in node.names] if not node.module else [target]
            found += [(name, id(node) in top_level) for name in names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
    return [(name, top) for name, top in found if name == "vlm_pack" or name.startswith("vlm_pack.")]


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


MODULES = sorted(PACKAGE.rglob("*.py"))  # the library and its fixtures


def test_root_holds_few_modules():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 10, modules
    assert set(modules) - {"__init__", "__main__"} <= ROOT_HELPERS, modules


def _upward_imports(path: Path, source: str | None = None) -> list[str]:
    module = _module_name(path)
    floor = _floor(module)
    if floor is None:
        return []
    wrong = []
    for target, _ in _imports(path, source):
        if target.startswith("vlm_pack.testing"):
            if module != "vlm_pack.cli.demo" and not module.startswith("vlm_pack.testing"):
                wrong.append(f"{module} imports the fixtures {target}")
            continue
        target_floor = _floor(target)
        if target_floor is None or target_floor > floor:
            wrong.append(f"{module} (floor {floor}) imports {target} (floor {target_floor}): move the piece down")
    return wrong


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    assert _floor(_module_name(path)) is not None or path.parent == PACKAGE, f"{path} is in no layer: add it to FLOORS"
    assert _upward_imports(path) == []


def _cycle(planted: dict[Path, str] | None = None) -> list[str] | None:
    """The first import cycle among all modules (module level and inside functions), or None. ``planted``: source
    to read instead of a file's."""
    planted = planted or {}
    graph = {_module_name(path): {t for t, _ in _imports(path, planted.get(path))} for path in MODULES}
    modules = set(graph)

    def resolve(target):  # `from .x import name` names a module or an attribute of one
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    edges = {m: {resolve(t) for t in ts} - {m, "", "vlm_pack"} for m, ts in graph.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for module in sorted(edges):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_checker_catches_a_cycle_through_a_function_import():
    """Corruption: the streaming trainer importing the dataset inside a function (the dataset imports the trainer)
    is a cycle; under ``if TYPE_CHECKING:`` it is not (it never runs)."""
    path = PACKAGE / "streaming" / "trainer.py"
    late = path.read_text() + "\n\ndef _late():\n    from .dataset import StreamingPackDataset\n"
    assert _cycle({path: late}) == ["vlm_pack.streaming.dataset", "vlm_pack.streaming.trainer",
                                    "vlm_pack.streaming.dataset"]
    typing_only = path.read_text() + "\n\nif TYPE_CHECKING:\n    from .dataset import StreamingPackDataset\n"
    assert _cycle({path: typing_only}) is None


def test_checker_catches_a_fixture_circle_and_a_library_import_of_fixtures():
    """Corruption: a family fixture imported back by the shared fixture helpers it imports is a cycle; the data
    layer importing the fixtures is reported."""
    parts = PACKAGE / "testing" / "family_parts.py"
    back = parts.read_text() + "\n\ndef _late():\n    from .families.llava import BUILDERS\n"
    assert _cycle({parts: back}) is not None
    collator = PACKAGE / "data" / "collator.py"
    planted = collator.read_text() + "\n\ndef _late():\n    from ..testing.tiny_families import tiny_vlm\n"
    assert any("imports the fixtures" in line for line in _upward_imports(collator, planted))


def test_checker_catches_an_upward_import():
    """Corruption: a core module importing the data layer, inside a function, is reported."""
    path = PACKAGE / "core" / "packing.py"
    planted = path.read_text() + "\n\ndef _late():\n    from ..data.collator import VLMPackingCollator\n"
    assert _upward_imports(path) == []
    assert any("imports vlm_pack.data.collator" in line for line in _upward_imports(path, planted))


# ------------------------------------------------------------------ house rules (issue 46)

LIBRARY = [path for path in MODULES if "testing" not in path.relative_to(PACKAGE).parts]
MANY_PARAMETERS = 12
# Public entry points whose keywords are their documented interface.
MAY_TAKE_MANY = {"vlm_pack.data.collator.VLMPackingCollator.__init__", "vlm_pack.attention.varlen.varlen_attention"}


def _functions(path: Path, source: str | None = None):
    """(qualified name, parameter count) of every function and method of ``path`` (``self`` / ``cls`` not counted;
    ``*args`` and ``**kwargs`` one each)."""
    tree = ast.parse(path.read_text() if source is None else source)
    module = _module_name(path)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                count = len(names) - (names[:1] in (["self"], ["cls"])) + (args.vararg is not None) + (
                    args.kwarg is not None)
                yield f"{prefix}.{child.name}", count
                yield from walk(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}.{child.name}")

    yield from walk(tree, module)


def test_few_functions_take_many_parameters():
    """Internal pipelines take config objects (``PrepareOptions``, ``EncodingRules``): no library function takes
    more than 12 parameters but the public entry points in ``MAY_TAKE_MANY``."""
    many = {name: count for path in LIBRARY for name, count in _functions(path) if count > MANY_PARAMETERS}
    assert set(many) <= MAY_TAKE_MANY, many


def test_parameter_count_catches_a_long_signature():
    """Corruption: a 13-parameter function is counted (methods without ``self``, ``*args`` / ``**kwargs`` counted)."""
    path = PACKAGE / "data" / "chat.py"
    planted = "class C:\n    def f(self, a, b, c, d, e, f, g, h, i, j, k, *rest, **options):\n        pass\n"
    assert dict(_functions(path, planted)) == {"vlm_pack.data.chat.C.f": 13}


def _family_branches(source: str) -> list[int]:
    """Lines of ``family is None`` / ``family is not None`` tests (any name or attribute called ``family``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            names = {getattr(o, "id", None) or getattr(o, "attr", None) for o in operands}
            if "family" in names and any(isinstance(o, ast.Constant) and o.value is None for o in operands):
                found.append(node.lineno)
    return found


def test_data_layer_has_no_per_family_branches():
    """The data layer reads one ``EncodingRules`` (a text tokenizer's without a model) and never asks whether a
    family is there: a new processor quirk touches the family's module and ``EncodingRules`` only."""
    data = {str(path.relative_to(PACKAGE)): _family_branches(path.read_text())
            for path in sorted((PACKAGE / "data").glob("*.py"))}
    assert {name: lines for name, lines in data.items() if lines} == {}
    assert _family_branches("if self.family is None or spec.family is not None:\n    pass\n") == [1, 1]


def test_nothing_is_named_after_a_round():
    """Modules and tests are named by what they hold (a family, a family kind), never by the round that brought
    them."""
    tests = Path(__file__).resolve().parent
    named = [p.name for p in [*MODULES, *tests.glob("*.py")] if re.search(r"round_?\d", p.stem)]
    assert named == []


def _private_imports(path: Path, source: str | None = None) -> list[str]:
    tree = ast.parse(path.read_text() if source is None else source)
    return [f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names if alias.name.startswith("_") and node.module != "__future__"]


def test_fixtures_import_no_private_names():
    """The family fixtures share helpers through ``vlm_pack.testing.family_parts`` (public names), never a private
    name taken from another module."""
    fixtures = [path for path in MODULES if "testing" in path.relative_to(PACKAGE).parts]
    assert {str(p.relative_to(PACKAGE)): _private_imports(p) for p in fixtures if _private_imports(p)} == {}
    planted = "def _late():\n    from ..tiny_models import _SMALL_VOCAB\n"
    assert _private_imports(PACKAGE / "testing" / "families" / "llava.py", planted) == ["tiny_models._SMALL_VOCAB"]
