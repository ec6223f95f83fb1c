"""Architecture checks: no import cycles among losscheck's modules (imports inside functions and
under TYPE_CHECKING count: a lazy import still ties the two modules together)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "losscheck"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the losscheck modules it imports. `from pkg import sub` is an edge to `pkg.sub`
    when that is a module, and to `pkg` (whose `__init__` runs first) unless the importer lives
    inside `pkg`: a package's `__init__` that imports its own submodules is not a cycle."""
    modules = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = edges
    return graph


def test_no_import_cycles():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import cycle among losscheck modules: " + " -> ".join(exc.args[1]))


def test_the_check_finds_a_cycle():
    graph = import_graph()
    graph["losscheck.errors"] = graph["losscheck.errors"] | {"losscheck.run.session"}  # session imports errors
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
