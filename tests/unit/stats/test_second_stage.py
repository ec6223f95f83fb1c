"""The second stage's test and power model (`losscheck.stats.second_stage`): the split of β
between the stages, the closed-form size, the paired sign-flip test's level and its catch rate at
the stated power, simulated."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats.second_stage import (
    RowShift,
    detectable_shift,
    sign_flip_test,
    stage_one_power,
    stage_two_power,
    token_shift,
)


@pytest.mark.parametrize("power", [0.8, 0.9, 0.99, 0.999])
def test_the_two_stages_keep_the_cell_s_power_between_them(power):
    one, two = stage_one_power(power), stage_two_power(power)
    assert one * two >= power
    assert (1 - one) + (1 - two) == pytest.approx(1 - power)
    assert one > power and two > power


@pytest.mark.parametrize("two_sided", [False, True])
def test_the_rows_needed_are_the_fewest_that_reach_the_level(two_sided):
    shift = RowShift(shift=0.3, var_h0=2.0, var_bug=3.0, two_sided=two_sided)
    rows = shift.rows_needed(1e-3, 0.99)
    assert shift.power(int(rows), 1e-3) >= 0.99 > shift.power(int(rows) - 1, 1e-3)
    assert shift.power(int(rows), 1e-3) > shift.power(int(rows), 1e-5)  # a lower level costs power


@pytest.mark.parametrize("two_sided", [False, True])
def test_the_detectable_shift_is_the_one_the_model_catches_at_the_power(two_sided):
    for rows in (50, 400, 10_000):
        d = detectable_shift(rows, 1e-3, 0.99, two_sided)
        assert RowShift(d, 0.5, 0.5, two_sided).power(rows, 1e-3) == pytest.approx(0.99, abs=1e-9)
    assert detectable_shift(10, 1e-3, 0.99) == math.inf  # c² = 13.8 pairs are the least that can reject


def test_no_shift_has_no_power_and_needs_every_row():
    for dead in (RowShift(0.0, 1.0, 1.0), RowShift(-1.0, 1.0, 1.0), RowShift(1.0, math.inf, 1.0)):
        assert dead.power(10**6, 0.01) == 0.0
        assert dead.rows_needed(0.01, 0.9) == math.inf


def test_a_level_outside_the_unit_interval_is_refused_by_name():
    with pytest.raises(LosscheckError, match="alpha"):
        RowShift(1.0, 1.0, 1.0).power(10, 1.5)
    with pytest.raises(LosscheckError, match="per_row"):
        token_shift(0.0, 0.1, 1.0, 0.01, 1.0)


def _draw(law: str, shift: bool, m: int, rng: np.random.Generator) -> np.ndarray:
    """m row scores of one side: `shift` the class's side. normal: N(0.5, 1.5) against N(0, 1);
    gamma: 16 exponential increments a row, mean 1.1 against 1 (skewed, unequal variances);
    rare: mostly exactly zero, a rare-slot bug's log-LR (a +2 row at 1.5% against 1%)."""
    if law == "normal":
        return rng.normal(0.5, math.sqrt(1.5), m) if shift else rng.normal(0.0, 1.0, m)
    if law == "gamma":
        return rng.gamma(16, 1.1 if shift else 1.0, m)
    return np.where(rng.random(m) < (0.015 if shift else 0.01), 2.0, 0.0)


MODELS = {
    "normal": RowShift(shift=0.5, var_h0=1.0, var_bug=1.5),
    "gamma": RowShift(shift=16 * 0.1, var_h0=16.0, var_bug=16 * 1.1**2),
    "rare": RowShift(shift=2 * 0.005, var_h0=4 * 0.01 * 0.99, var_bug=4 * 0.015 * 0.985),
}


@pytest.mark.parametrize(("law", "two_sided"), [("normal", False), ("normal", True), ("gamma", False), ("rare", False)])
def test_the_sign_flip_test_catches_at_the_power_the_model_states(law, two_sided):
    """400 simulated second stages at a stated power of 0.8, α 0.01: the catches lie within
    4 binomial standard deviations (a false alarm of this check has probability under 1e-4).
    The rare law is the one a U test sized by its efficiency missed (19 of 50 at a stated 0.9)."""
    rng = np.random.default_rng(20261208)
    model = dataclasses.replace(MODELS[law], two_sided=two_sided)
    alpha, trials = 0.01, 400
    rows = int(model.rows_needed(alpha, 0.8))
    caught = 0
    for _ in range(trials):
        on, off = (torch.from_numpy(_draw(law, side, rows, rng)) for side in (True, False))
        caught += sign_flip_test(on, off, two_sided)[1] <= alpha
    stated = model.power(rows, alpha)
    sd = math.sqrt(trials * stated * (1 - stated))
    assert abs(caught - trials * stated) <= 4 * sd, (caught, trials * stated, rows)


@pytest.mark.parametrize("law", ["gamma", "rare"])
def test_under_h0_the_sign_flip_test_keeps_its_level_whatever_the_scores_law(law):
    """Both sides of one law, 2,000 second stages of 200 pairs at α 0.05: false alarms within the
    binomial 0.999 quantile of 2,000 × 0.05 (Hoeffding's bound is conservative: they are fewer)."""
    rng = np.random.default_rng(7)
    alpha, trials = 0.05, 2000
    alarms = sum(
        sign_flip_test(*(torch.from_numpy(_draw(law, False, 200, rng)) for _ in range(2)))[1] <= alpha
        for _ in range(trials)
    )
    assert alarms <= stats.binom.ppf(0.999, trials, alpha), alarms


def test_unpaired_scores_are_refused_by_name():
    with pytest.raises(LosscheckError, match="as many rows a side for each prompt"):
        sign_flip_test(torch.zeros(3), torch.zeros(4))
    assert sign_flip_test(torch.zeros(3), torch.zeros(3)) == (0.0, 1.0)  # no difference: no evidence
    statistic, p = sign_flip_test(torch.tensor([math.inf, 1.0]), torch.tensor([0.0, 0.0]))
    assert math.isfinite(statistic) and 0 < p < 1  # an infinite score counts as the clip


def test_a_centred_score_s_row_law_is_the_sum_of_its_tokens():
    """iid positions: H0's row variance is n times the token's; the class's is bounded above."""
    shift = token_shift(per_row=16, bug_drift=-0.05, bug_var=0.9, bug_mean_sq=0.0025, h0_var=1.0)
    assert shift.shift == pytest.approx(0.8) and shift.two_sided
    assert shift.var_h0 == pytest.approx(16.0)
    assert shift.var_bug == pytest.approx(16 * 0.9 + 256 * 0.0025)
