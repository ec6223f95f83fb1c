"""`--losscheck-perf-compare` end to end: a perf run against a saved run whose speedup and τ it
cannot reach fails, naming the rung, the metric and the threshold; the report is written."""

from __future__ import annotations

import json

import pytest

from tests.support import run_shipped
from tests.unit.perf.runs import run_file

pytestmark = pytest.mark.e2e  # starts processes (subprocess pytest, ranks, a venv)

pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_a_regression_against_the_saved_run_fails_and_names_the_rung(pytester, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the subprocess is no xdist worker
    saved = run_file(100.0, 9.0, target={"name": "elsewhere", "sha256": "0"}).to_json()
    run = pytester.path / "saved.json"
    run.write_text(json.dumps(saved))
    result = run_shipped(
        pytester,
        "-m",
        "perf",
        "-k",
        "compare or (test_rung and A-c1 and not c16)",
        f"--losscheck-perf-compare={run}",
        "--losscheck-perf-compare-fail=speedup:10%,tau:5%",
        f"--losscheck-out={pytester.path / 'out'}",
        module="losscheck.plugin.certify.test_perf",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*A c=1 ladder: speedup 100.000 -> *REGRESSED*",
            "*A c=1 ladder: tau 9.000 -> *REGRESSED*",
            "*the runs differ in*target: elsewhere -> target*",
        ]
    )
    report = (pytester.path / "out" / "perf" / "perf.md").read_text()
    assert "REGRESSED" in report and (pytester.path / "out" / "perf" / "speedup.png").exists()
