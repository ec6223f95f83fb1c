"""A verifier named with --losscheck-verifier, through the shipped certification tests in a
process of their own: a lossy one fails the greedy cell, an unimportable one stops the run."""

from __future__ import annotations

import textwrap

import pytest

from tests.support import run_in_process, run_shipped

pytestmark = pytest.mark.verifier

pytest_plugins = ["pytester"]


LOSSY_GREEDY = """
from losscheck.selftest.verifiers import verify_recovered_after_rejected_any

def factory():
    return verify_recovered_after_rejected_any
"""


def test_a_lossy_verifier_given_to_the_plugin_fails_the_greedy_cell(pytester, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: a second thread only contends
    pytester.makepyfile(myverifier=textwrap.dedent(LOSSY_GREEDY))
    pytester.syspathinsert()
    result = run_shipped(
        pytester,
        "-m",
        "lossless",
        "--losscheck-bundled=reference",
        "--losscheck-verifier=myverifier:factory",
        "-k",
        "test_greedy_equals_baseline and A-k4-greedy]",
        in_process=True,
    )
    result.assert_outcomes(failed=1)


def test_a_bad_verifier_option_stops_the_run(pytester):
    result = run_in_process(pytester, "-p", "no:cacheprovider", "--losscheck-verifier=no_such_pkg:factory")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--losscheck-verifier='no_such_pkg:factory': cannot import module 'no_such_pkg'" in result.stderr.str()
