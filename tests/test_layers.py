"""The package's layers import one way: core <- attention <- models <- data <- integrations <- paths <- cli.

Every import of a vlm_pack module (module level or inside a function) is read from the source with ``ast`` and
checked against the floor of the importing module; module-level imports must also form no cycle. The package root
keeps at most 10 modules besides the subpackages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vlm_pack"
FLOORS = {"core": 1, "attention": 2, "models": 3, "data": 4, "integrations": 5,
          "offline": 6, "budget": 6, "preference": 6, "rl": 6, "streaming": 6,
          "sequence_parallel": 6, "cli": 7}
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
    found = []
    for node in ast.walk(tree):
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


LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts)


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
            if module != "vlm_pack.cli.demo":
                wrong.append(f"{module} imports the fixtures {target}")
            continue
        target_floor = _floor(target)
        if target_floor is None or target_floor > floor:
            wrong.append(f"{module} (floor {floor}) imports {target} (floor {target_floor}): move the piece down")
    return wrong


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    assert _floor(_module_name(path)) is not None or path.parent == PACKAGE, f"{path} is in no layer: add it to FLOORS"
    assert _upward_imports(path) == []


def test_no_import_cycles():
    graph = {}
    for path in LIBRARY:
        graph[_module_name(path)] = {t for t, top in _imports(path) if top}
    modules = set(graph)

    def resolve(target):  # `from .x import name` names a module or an attribute of one
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    edges = {m: {resolve(t) for t in ts} - {m, "", "vlm_pack"} for m, ts in graph.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in edges.get(node, ()):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_checker_catches_an_upward_import():
    """Corruption: a core module importing the data layer, inside a function, is reported."""
    path = PACKAGE / "core" / "packing.py"
    planted = path.read_text() + "\n\ndef _late():\n    from ..data.collator import VLMPackingCollator\n"
    assert _upward_imports(path) == []
    assert any("imports vlm_pack.data.collator" in line for line in _upward_imports(path, planted))
