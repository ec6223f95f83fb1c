"""Plain `pytest` collects the certification matrix when the run names a target, a drafter or an
engine, and only then; never twice (`losscheck.plugin.collect`). In process: the run's paths after
the plugin's `pytest_configure` (collection itself: tests/e2e/test_plain_pytest.py)."""

from __future__ import annotations

import pytest

from losscheck import bundled
from losscheck.plugin.collect import MATRIX, PACKAGE
from tests.support import ROOT

pytest_plugins = ["pytester"]


def run_paths(pytester: pytest.Pytester, *args: str) -> list[str]:
    """The run's collection paths once every plugin is configured."""
    return list(pytester.parseconfigure("-p", "no:cacheprovider", *args).args)


def drafter() -> str:
    return f"--losscheck-drafter={bundled.fixtures_dir() / 'drafter_a'}"


def test_naming_a_drafter_adds_the_matrix_to_the_users_own_paths(pytester):
    assert run_paths(pytester, drafter()) == [str(pytester.path), str(MATRIX)]
    assert run_paths(pytester, "mytests", drafter()) == ["mytests", str(MATRIX)]


def test_a_drafter_named_in_the_ini_files_addopts_adds_the_matrix(pytester):
    pytester.makeini(f"[pytest]\naddopts = {drafter()}\n")
    assert run_paths(pytester) == [str(pytester.path), str(MATRIX)]


@pytest.mark.parametrize(
    "option",
    ["--losscheck-engine=losscheck.engines.spec_loop:spec_loop", f"--losscheck-target={bundled.target_path()}"],
)
def test_naming_an_engine_or_a_target_adds_the_matrix(pytester, option):
    assert run_paths(pytester, option) == [str(pytester.path), str(MATRIX)]


def test_a_run_naming_nothing_keeps_its_paths(pytester):
    assert run_paths(pytester) == [str(pytester.path)]
    assert run_paths(pytester, "--pyargs", "losscheck.plugin.certify") == ["losscheck.plugin.certify"]


@pytest.mark.parametrize(
    "paths",
    [
        ["--pyargs", "losscheck.plugin.certify"],  # CI's form
        ["--pyargs", "losscheck.plugin.certify.test_greedy::test_greedy_equals_baseline"],  # a part of it, chosen
        [str(MATRIX / "test_sampling.py")],
        [str(ROOT)],  # a directory pytest recurses into down to the matrix (this repository)
    ],
)
def test_paths_that_reach_the_matrix_collect_it_once(pytester, paths):
    assert run_paths(pytester, *paths, drafter()) == paths[-1:]


def test_a_directory_holding_the_matrix_where_pytest_does_not_recurse_gets_it_added(pytester):
    """A virtualenv inside the user's repository, or `--ignore`, keeps pytest out of the installed
    package: the matrix is added."""
    assert PACKAGE.parent == ROOT  # the package this suite imports is the checkout's
    ignored = f"--ignore={PACKAGE / 'plugin'}"
    assert run_paths(pytester, str(ROOT), ignored, drafter()) == [str(ROOT), str(MATRIX)]
