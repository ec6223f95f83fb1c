"""TestResult messages, cell verdicts under one α budget, JSON certificates."""

from __future__ import annotations

import json
import math

import pytest

from losscheck.errors import LosscheckError
from losscheck.stats.result import TestResult, combine


def _result(name: str, p_value: float, alpha: float) -> TestResult:
    return TestResult(
        name=name,
        expected="PIT values uniform over 10 equal bins",
        observed="bin 3 of 10 furthest off",
        statistic=31.5,
        p_value=p_value,
        alpha=alpha,
        n=60_000,
        power=0.99,
        detectable={"w": 0.05, "tv": 0.025},
    )


def test_a_test_fails_when_p_is_at_most_alpha():
    assert _result("t", 0.2, 0.01).passed
    assert not _result("t", 0.01, 0.01).passed
    assert not _result("t", 1e-9, 0.01).passed


def test_message_says_expected_observed_statistic_p_alpha_n_and_detectable_effect():
    message = _result("pit.pooled_chisquare", 2.5e-5, 1e-4).message()
    for part in (
        "pit.pooled_chisquare FAILED",
        "PIT values uniform",
        "bin 3 of 10",
        "31.5",
        "2.5e-05",
        "<= alpha = 0.0001",
        "n = 60000",
        "tv >= 0.025",
        "power 0.99",
    ):
        assert part in message, part


def test_cell_fails_if_any_test_fails_and_names_the_failures():
    verdict = combine("k=4", [_result("a", 0.5, 0.005), _result("b", 0.001, 0.005)], alpha=0.01)
    assert not verdict.passed
    assert "1/2 tests passed" in verdict.message()
    assert "b FAILED" in verdict.message() and "a passed" not in verdict.message()
    assert combine("k=4", [_result("a", 0.5, 0.005)], alpha=0.01).passed


def test_combine_refuses_tests_that_overspend_the_cell_budget():
    with pytest.raises(LosscheckError, match="more than the cell's budget"):
        combine("k=4", [_result("a", 0.5, 0.01), _result("b", 0.5, 0.01)], alpha=0.01)
    with pytest.raises(LosscheckError):
        combine("k=4", [], alpha=0.01)


def test_verdict_serialises_to_json_with_infinities_as_null():
    unbounded = TestResult("c", "e", "o", 0.0, 1.0, 0.005, 0, 0.99, {"w": math.inf})
    verdict = combine("k=4", [_result("a", 0.5, 0.005), unbounded], alpha=0.01)
    data = json.loads(json.dumps(verdict.to_dict(), allow_nan=False))
    assert data["passed"] is True
    assert data["results"][0]["detectable"] == {"w": 0.05, "tv": 0.025}
    assert data["results"][1]["detectable"] == {"w": None}


def test_chi2_log10_tail_is_scipys_where_it_is_finite_and_an_upper_bound_beyond():
    import math

    from scipy import stats

    from losscheck.stats.gof import chi2_log10_sf

    assert chi2_log10_sf(100.0, 9) == pytest.approx(math.log10(stats.chi2.sf(100.0, 9)), rel=1e-9)
    # Where scipy's log-tail underflows, the Chernoff bound still orders the statistics.
    assert chi2_log10_sf(5e4, 24) < chi2_log10_sf(5e3, 24) < -300
    # The bound is an upper bound where both are finite.
    assert chi2_log10_sf(1400.0, 24) <= -(1400 - 24 - 24 * math.log(1400 / 24)) / (2 * math.log(10)) + 1e-9


def test_an_untestable_result_passes_and_claims_nothing():
    """Too few values to judge: p = 1, so it never fails, and every effect it names is infinite,
    so no claim can rest on it; the JSON says so with nulls."""
    r = TestResult.untestable("pit.pair_chisquare", "pairs uniform", "12 pairs: too few", 0.001, 0.99, 12)
    assert r.passed and r.p_value == 1.0 and r.n == 12
    assert r.detectable == {"w": math.inf, "tv": math.inf}
    assert r.to_dict()["detectable"] == {"w": None, "tv": None}
    assert "detects w >= inf" in r.message()
