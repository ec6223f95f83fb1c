"""Moved public paths keep working, with a DeprecationWarning naming the new one; the package
exports what the drafter contract needs; `losscheck --version` reports the installed version."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from importlib.metadata import version

import pytest

import losscheck
from losscheck.cli import main
from tests.support import ROOT


def fresh_import(name: str):
    """Import `name` anew (its top-level code, the warning, runs again)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


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


def test_plain_pytest_collects_the_certification_tests_from_their_path():
    line = re.search(r"^testpaths = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert line, "pyproject.toml sets no testpaths"
    assert "losscheck/plugin/certify" in ast.literal_eval(line[1])


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
