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


@pytest.mark.parametrize("under", ["bug", "h0"])
def test_wald_size_is_the_mean_stopping_time_of_a_simulated_sprt(under):
    """Bernoulli p = 0.5 against p' = 0.55 (steps of ±0.1 in the log-LR, so the boundaries'
    overshoot is small): 4,000 SPRTs at α 0.01, power 0.99, fixed seed. Their mean stopping time
    is within 5% of Wald's approximation (the mean's standard error here is about 1%; the
    overshoot Wald neglects adds about 1%)."""
    from losscheck.stats.effects import wald_size

    p, q, alpha, power = 0.5, 0.55, 0.01, 0.99
    up, down = math.log(q / p), math.log((1 - q) / (1 - p))
    kl_bug = q * up + (1 - q) * down
    kl_h0 = -(p * up + (1 - p) * down)
    size = wald_size(kl_bug, -kl_h0, alpha, power)
    upper, lower = math.log(power / alpha), math.log((1 - power) / (1 - alpha))
    rng = np.random.default_rng(7)
    success = q if under == "bug" else p
    level, stopped = np.zeros(4000), np.zeros(4000)  # [runs] the log-LR so far; the stopping time (0: on)
    for start in range(0, 40_000, 1000):  # a block of 1,000 steps at a time: [runs, 1000]
        path = level[:, None] + np.where(rng.random((4000, 1000)) < success, up, down).cumsum(axis=1)
        crossed = (path >= upper) | (path <= lower)
        ends = (stopped == 0) & crossed.any(axis=1)
        stopped[ends] = start + crossed[ends].argmax(axis=1) + 1
        level = path[:, -1]
        if stopped.all():
            break
    assert stopped.all()
    mean = float(stopped.mean())
    expected = size.under_bug if under == "bug" else size.under_h0
    assert abs(mean / expected - 1) < 0.05, (mean, expected)
    assert 800 < expected < 1000  # ≈ log(99) / KL ≈ 4.5 / 0.005 either way


def test_wald_size_takes_the_support_check_and_refuses_a_bad_level():
    from losscheck.errors import LosscheckError
    from losscheck.stats.effects import wald_size

    assert wald_size(0.001, -0.001, 0.01, 0.99, outside=0.1).under_bug == pytest.approx(10.0)
    assert wald_size(0.0, 0.0, 0.01, 0.99) == (math.inf, math.inf)
    with pytest.raises(LosscheckError, match="wald_size needs 0 < alpha, power < 1"):
        wald_size(0.1, -0.1, 0.0, 0.99)
