"""The conditional tests' calibration under H0 and their e-values' validity, over 2,000
replicates of the toy chain of tests/unit/test_conditional.py."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from losscheck.stats.buglaws import CATALOGUE
from tests.unit.test_conditional import _h0_replicates


@pytest.mark.parametrize("alpha", [0.05, 0.01])
def test_calibrated_under_h0(alpha):
    """2000 replicates of 200 steps, every test at level alpha: the rejection count stays below
    the binomial(2000, alpha) 0.999 quantile."""
    p_values, _ = _h0_replicates()
    replicates = len(p_values["surprisal"])
    bound = int(stats.binom.ppf(0.999, replicates, alpha))
    for name, ps in p_values.items():
        count = int((ps <= alpha).sum())
        assert count <= bound, (
            f"{name} rejected {count} of {replicates} H0 replicates at alpha = {alpha}; a valid test exceeds "
            f"{bound} (the binomial 0.999 quantile) with probability <= 0.001"
        )


def test_bug_class_evalues_have_mean_at_most_one_under_h0():
    """What makes the e-values valid under any stopping rule: E[e] <= 1 for every class's score.
    Over 2000 H0 replicates the mean e-value of each class stays below 1 + 4 standard errors."""
    _, evalues = _h0_replicates()
    mean = evalues.mean(0)  # [classes]
    bound = 1 + 4 * evalues.std(0) / math.sqrt(len(evalues))
    names = [bug.name for bug in CATALOGUE]
    assert (mean <= bound).all(), f"mean e-values {dict(zip(names, mean.round(3)))}, bounds {bound.round(3)}"
    assert (mean > 0.3).all(), f"the e-values should not collapse under H0: {dict(zip(names, mean.round(3)))}"
