"""Architecture checks: losscheck's packages form layers with every import pointing inward, and
no two modules or packages import each other in a circle. Imports inside functions and under
TYPE_CHECKING count: a lazy import still ties the two modules together."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "losscheck"

# Innermost first; a module may import its own layer and the layers before it. The verifier tier
# (`verifiers`) drives only a core `Verifier`, with the statistics, so it sits beside the drafters
# and engines: anything above may run it, and it knows nothing of cells or runs. `run` (options,
# models, the run's context and engine factory) comes before `cells`: a cell runs inside a run,
# and the run knows nothing of how cells certify. The self-test catalogue and the perf tier sit
# outside production: only the entry points (the CLI, the certification tests) may import them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "definitions", "bundled", "progress", "jsonrecord", "acceptance", "hashing", "stats"),
    ("core",),
    ("drafters", "engines", "verifiers"),
    ("serving",),
    ("plan",),
    ("run",),
    ("cells",),
    ("report",),
    ("selftest", "perf"),
    ("plugin", "cli"),
)
ROOT_MODULE = "losscheck"  # the package's __init__: the public contract's lazy re-exports


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the losscheck modules it imports. `from pkg import sub` is an edge to `pkg.sub`
    when that is a module, and to `pkg` (whose `__init__` runs first) unless the importer lives
    inside `pkg`: a package's `__init__` that imports its own submodules is not a cycle."""
    modules = {module_name(f): f for f in PACKAGE.rglob("*.py") if "fixtures" not in f.parts}
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


def layer_of(module: str) -> int:
    """The layer of `module` (by its first component under losscheck)."""
    top = module.split(".")[1] if module != ROOT_MODULE else ROOT_MODULE
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/unit/test_architecture.py: add its package to LAYERS")


def outward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph.items()
        if module != ROOT_MODULE
        for target in targets
        if target != ROOT_MODULE and layer_of(target) > layer_of(module)
    )


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the top-level packages its modules import."""
    top = {m: m.split(".")[1] if m != ROOT_MODULE else ROOT_MODULE for m in graph}
    found: dict[str, set[str]] = {}
    for module, targets in graph.items():
        found.setdefault(top[module], set()).update(top[t] for t in targets if top[t] != top[module])
    return found


def test_every_import_points_inward():
    bad = outward_imports(import_graph())
    assert not bad, (
        "imports against the layers (core <- serving <- plan <- run <- cells <- report <- plugin/cli):\n"
        + "\n".join(bad)
    )


def test_no_import_cycles_among_modules():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import cycle among losscheck modules: " + " -> ".join(exc.args[1]))


def test_no_import_cycles_among_packages():
    try:
        graphlib.TopologicalSorter(package_graph(import_graph())).prepare()
    except graphlib.CycleError as exc:
        pytest.fail("import cycle among losscheck packages: " + " -> ".join(exc.args[1]))


def test_production_never_imports_the_self_registered_tests():
    graph = import_graph()
    production = [m for m in graph if m != ROOT_MODULE and layer_of(m) < layer_of("losscheck.selftest")]
    bad = [f"{m} imports {t}" for m in production for t in graph[m] if t.startswith("losscheck.selftest")]
    assert not bad, "\n".join(bad)


def test_serving_knows_drafters_only_through_the_contract():
    """The scheduler and the serving axes carry a drafter's per-row state through the contract's
    protocols (`ForgetsRows`, `AdmitsRows`), never by naming a bundled drafter class."""
    graph = import_graph()
    bad = [
        f"{m} imports {t}"
        for m in graph
        if m.startswith("losscheck.serving")
        for t in graph[m]
        if t.startswith("losscheck.drafters")
    ]
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail():
    graph = import_graph()
    assert not outward_imports(graph)
    graph["losscheck.core.engine"] = graph["losscheck.core.engine"] | {"losscheck.plan.matrix"}
    assert outward_imports(graph) == ["losscheck.core.engine (layer 1) imports losscheck.plan.matrix (layer 4)"], (
        "an outward import must be reported"
    )
    graph["losscheck.errors"] = graph["losscheck.errors"] | {"losscheck.run.session"}  # session imports errors
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()
    packages = package_graph(import_graph())
    packages["core"] = packages["core"] | {"plan"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(packages).prepare()


def test_every_test_module_lives_in_a_tier_directory():
    """A test's tier is its directory (tests/conftest.py marks it): none sits outside one."""
    from tests.conftest import TIERS

    tests = ROOT / "tests"
    outside = [
        str(path.relative_to(tests))
        for path in tests.rglob("test_*.py")
        if path.relative_to(tests).parts[0] not in TIERS
    ]
    assert not outside, f"test modules outside the tier directories {sorted(TIERS)}: {outside}"
