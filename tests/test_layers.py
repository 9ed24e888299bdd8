"""The package's layers import one way: core <- attention <- models <- data <- integrations <- paths <- cli, and the
fixtures (``vlm_pack.testing``) above them all: nothing in the library imports them.

Every import of a vlm_pack module (module level or inside a function) is read from the source with ``ast`` and
checked against the floor of the importing module; all of them together (fixtures included) must form no cycle,
module level or inside a function (imports under ``if TYPE_CHECKING:`` never run and are not counted). The package
root keeps at most 10 modules besides the subpackages.
"""

from __future__ import annotations

import ast
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
