"""The e-value power model's searches, run for every candidate at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from losscheck.stats.effects import EvalueEffect, evalue_power, evalue_tokens


@pytest.mark.parametrize("one_sided", [False, True])
def test_evalue_tokens_is_the_smallest_n_with_the_power(one_sided):
    """Each candidate's n reaches the power and n less 0.2% (and one token) does not: the 0.1%
    search, run for 200 candidates in one vectorised pass."""
    rng = np.random.default_rng(7)
    d = rng.normal(0, 0.05, 200) * np.exp(rng.uniform(-6, 0, 200))
    h0 = np.exp(rng.uniform(-8, 1, 200))
    h1 = h0 * np.exp(rng.normal(0, 0.3, 200))
    alpha, power = 1e-5, 0.99
    n = evalue_tokens(d, h0, h1, alpha, power, one_sided)
    live = (d > 0 if one_sided else d != 0) & np.isfinite(n)
    assert live.sum() > 50 and np.isinf(n[~live]).all()
    assert (evalue_power(n[live], d[live], h0[live], h1[live], alpha, one_sided) >= power).all()
    below = np.maximum(n[live] * (1 - 2e-3) - 1, 1.0)
    reached = evalue_power(below, d[live], h0[live], h1[live], alpha, one_sided) >= power
    assert not (reached & (n[live] > 1)).any()


def test_an_effect_is_its_best_candidate():
    effect = EvalueEffect(drift=[0.0, 0.01, 0.03], h0_var=[1.0, 1.0, 1.0], h1_var=[1.0, 1.0, 1.0], bonferroni=2)
    each = [EvalueEffect([d], [1.0], [1.0], 2).tokens_needed(1e-4, 0.9) for d in effect.drift]
    assert math.isinf(each[0]) and effect.tokens_needed(1e-4, 0.9) == min(each) == each[2]
    assert effect.power(each[2], 1e-4) >= 0.9 > EvalueEffect([0.01], [1.0], [1.0], 2).power(each[2], 1e-4)
    assert EvalueEffect([], [], [], 1).tokens_needed(1e-4, 0.9) == math.inf
    assert EvalueEffect([1e-9], [1.0], [1.0], 1).tokens_needed(1e-4, 0.9) == math.inf  # past MAX_TOKENS
