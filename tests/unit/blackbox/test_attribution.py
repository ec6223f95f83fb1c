"""The second stage of a black-box cell (`losscheck.cells.engine.attribution`): which row scores a failing
test reads, and the paired sign-flip tests' level and stated power on samples of known law."""

from __future__ import annotations

import torch
from scipy import stats

from losscheck.cells.engine.attribution import attribution_tests, scores_for


def test_each_failing_test_is_compared_on_the_row_scores_it_sums():
    assert scores_for(["rounds.residual_is_p"]) == ("rounds.residual_is_p",)
    assert scores_for(["pit.surprisal", "pit.repeats"]) == ("surprisal", "repeats")
    assert scores_for(["pit.position_chisquare[3]", "pit.surprisal"]) == ("surprisal", "pit_mean", "pit_spread")
    assert scores_for(["pit.support"]) == ("support",)  # a cut-off the reference draws elsewhere


def _sides(shift: float, n: int, g: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    on = {name: torch.randn(n, generator=g, dtype=torch.float64) for name in ("surprisal", "rounds.residual_is_p")}
    off = {name: torch.randn(n, generator=g, dtype=torch.float64) for name in on}
    on["rounds.residual_is_p"] += shift
    return on, off


def test_one_law_on_both_sides_rejects_within_alpha():
    """400 cells at alpha 0.05 over two scores: false alarms at most the binomial bound
    (P(X > 32) < 1e-3 at 20 expected)."""
    g = torch.Generator().manual_seed(3)
    alarms = 0
    for _ in range(400):
        on, off = _sides(0.0, 100, g)
        alarms += any(
            not r.passed for r in attribution_tests(on, off, ("surprisal", "rounds.residual_is_p"), 0.05, 0.9)
        )
    assert alarms <= stats.binom.ppf(1 - 1e-3, 400, 0.05), alarms


def test_a_shift_at_the_stated_detectable_size_is_caught_at_the_stated_power():
    """A shift of the class score by the `d` the test states at power 0.9 is caught in at least
    34 of 40 cells (P(<34 | 0.9) = 0.07; normal scores, where the stated d is exact but for the
    normal approximation of the sign-flip statistic)."""
    g = torch.Generator().manual_seed(4)
    on, off = _sides(0.0, 100, g)
    (result,) = attribution_tests(on, off, ("rounds.residual_is_p",), 0.01, 0.9)
    d = result.detectable["d"]
    caught = 0
    for _ in range(40):
        on, off = _sides(d, 100, g)
        caught += not attribution_tests(on, off, ("rounds.residual_is_p",), 0.01, 0.9)[0].passed
    assert caught >= 34, (caught, d)


def test_the_row_score_tests_are_registered_and_split_alpha_over_the_scores_compared():
    """Every row score a second stage may compare is a registered test of family `attribution`
    (so the certificate lists it); the scores not compared spend nothing, and a score no failing
    test reads is refused by name."""
    import pytest

    from losscheck.cells.engine.attribution import ROW_SCORES, SCORES
    from losscheck.errors import LosscheckError
    from losscheck.stats import registry

    names = {t.name for t in registry.registered(registry.ATTRIBUTION)}
    assert names == {f"attribution.{n}" for n in ROW_SCORES} and {f"attribution.{s}" for s in SCORES} <= names
    on, off = _sides(0.0, 50, torch.Generator().manual_seed(1))
    (one,) = attribution_tests(on, off, ("surprisal",), 0.02, 0.9)
    two = attribution_tests(on, off, ("surprisal", "rounds.residual_is_p"), 0.02, 0.9)
    assert one.alpha == 0.02 and [r.alpha for r in two] == [0.01, 0.01]
    assert [r.name for r in two] == ["attribution.surprisal", "attribution.rounds.residual_is_p"]
    with pytest.raises(LosscheckError, match="no row score named \\['pit_median'\\]"):
        attribution_tests(on, off, ("pit_median",), 0.02, 0.9)
