"""Moved public paths keep working, with a DeprecationWarning naming the new one; the package
exports what the drafter contract needs; `losscheck --version` reports the installed version."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

import losscheck
from losscheck.cli import main
from tests.support import ROOT

ALIAS, MOVED = ROOT / "losscheck" / "certify", ROOT / "losscheck" / "plugin" / "certify"


def fresh_import(name: str):
    """Import `name` anew (its top-level code, the warning, runs again)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_the_old_sampling_path_warns_and_gives_the_same_functions():
    from losscheck.core import sampling

    with pytest.warns(DeprecationWarning, match=r"losscheck\.core\.sampling.*from losscheck"):
        old = fresh_import("losscheck.sampling")
    assert old.process_logits is sampling.process_logits and old.SamplingParams is sampling.SamplingParams


@pytest.mark.parametrize(
    "old, new, names",
    [
        ("losscheck.perf.runfile", "losscheck.report.perf_run", ("load", "compare", "SCHEMA", "parse_thresholds")),
        ("losscheck.perf.report", "losscheck.report.perf", ("write_report", "markdown", "plot")),
    ],
)
def test_the_old_perf_report_paths_warn_and_give_the_same_functions(old, new, names):
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        module = fresh_import(old)
    current = importlib.import_module(new)
    assert all(getattr(module, name) is getattr(current, name) for name in names)


def test_the_old_outcome_details_warn_and_give_the_sample_facts():
    from losscheck.cells.outcome import CellOutcome
    from losscheck.cells.record import SampleFacts
    from losscheck.plan.cell import Cell
    from losscheck.plan.matrix import GREEDY

    outcome = CellOutcome(Cell("A", 4, GREEDY), facts=SampleFacts(prompts=3, max_new_tokens=8))
    with pytest.warns(DeprecationWarning, match="CellOutcome.facts"):
        assert outcome.details == {"prompts": 3, "max_new_tokens": 8}


def test_process_logits_is_exported_with_the_contract():
    from losscheck.core.sampling import process_logits

    assert "process_logits" in losscheck.__all__ and losscheck.process_logits is process_logits


def test_version_comes_from_the_installed_metadata(capsys):
    assert main(["--version"]) == 0
    assert (
        capsys.readouterr().out.strip() == f"losscheck {version('losscheck')}" == f"losscheck {losscheck.__version__}"
    )


def test_the_old_certify_package_mirrors_every_test_module_and_warns():
    modules = sorted(p.name for p in MOVED.glob("test_*.py"))
    assert sorted(p.name for p in ALIAS.glob("test_*.py")) == modules, "add an alias module to losscheck/certify/"
    with pytest.warns(DeprecationWarning, match=r"losscheck\.plugin\.certify"):
        fresh_import("losscheck.certify")
    for name in modules:
        stem = name.removesuffix(".py")
        new = importlib.import_module(f"losscheck.plugin.certify.{stem}")
        with pytest.warns(DeprecationWarning):  # the package's warning, imported anew with each module
            sys.modules.pop("losscheck.certify", None)
            old = fresh_import(f"losscheck.certify.{stem}")
        tests = {n for n in vars(new) if n.startswith("test_")}
        assert tests and {n: getattr(old, n) for n in tests} == {n: getattr(new, n) for n in tests}, stem
        assert getattr(old, "pytestmark", None) == getattr(new, "pytestmark", None), stem


def test_plain_pytest_does_not_collect_the_alias():
    """The certification tests are collected once, from their new path (a testpath holding the
    alias would collect each cell twice)."""
    line = re.search(r"^testpaths = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml sets no testpaths"
    testpaths = ast.literal_eval(line[1])
    assert "losscheck/plugin/certify" in testpaths
    assert not [p for p in testpaths if ALIAS.is_relative_to(ROOT / p)], testpaths


@pytest.mark.e2e
def test_pyargs_of_the_old_path_collects_the_planned_cells_with_a_warning(tmp_path):
    """`--pyargs losscheck.certify` collects every cell of the plan, as the new path does
    (tests/e2e/test_plan_weight_free.py), and warns where the tests moved."""
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    args = [sys.executable, "-m", "pytest", "--pyargs", "losscheck.certify", "--collect-only", "-q", "-m", "lossless"]
    done = subprocess.run(
        [*args, "-p", "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = {m.group(1) for line in done.stdout.splitlines() if (m := re.search(r"\[(.+)\]$", line))}
    planned = {c.id for cells in Session(Options(), skeleton=True).plan.values() for c in cells}
    assert planned and planned <= collected, sorted(planned - collected)[:5]
    assert "DeprecationWarning: losscheck.certify moved to losscheck.plugin.certify" in done.stdout


@pytest.mark.parametrize(
    ("module", "old", "family", "count"),
    [
        ("losscheck.stats", "PIT_TESTS", "pit", 9),
        ("losscheck.stats.pit", "PIT_TESTS", "pit", 9),
        ("losscheck.stats.conditional", "CONDITIONAL_TESTS", "conditional", 5),
        ("losscheck.cells.conformance", "CONFORMANCE_TESTS", "conformance", 5),
    ],
)
def test_the_removed_test_counts_warn_and_read_the_registry(module, old, family, count):
    expected = rf"{re.escape(module)}\.{old} is deprecated.*budget_count\('{family}'\)"
    with pytest.warns(DeprecationWarning, match=expected):
        assert getattr(importlib.import_module(module), old) == count
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_COUNT'"):
        importlib.import_module(module).NO_SUCH_COUNT  # noqa: B018
