"""Power bounds: against scipy's noncentral χ² / Kolmogorov laws and against Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from statsmodels.stats.power import GofChisquarePower

from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.stats.budget import per_test_alpha
from losscheck.stats.power import (
    chisquare_detectable_w,
    chisquare_power,
    chisquare_required_n,
    dkwm_detectable,
    dkwm_required_n,
    dkwm_two_sample_detectable,
    predicted_power,
    require_power,
)


@settings(max_examples=60, deadline=None)
@given(
    nc=st.floats(0.0, 5e3),
    n_bins=st.integers(2, 500),
    alpha=st.floats(1e-9, 0.2),
)
def test_chisquare_power_is_statsmodels_power(nc, n_bins, alpha):
    expected = GofChisquarePower().power(1.0, nc, alpha, n_bins)
    assert chisquare_power(nc, n_bins, alpha) == pytest.approx(expected, abs=1e-10)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(20, 10**6),
    n_bins=st.integers(2, 500),
    alpha=st.floats(1e-7, 0.1),
    power=st.floats(0.5, 0.999),
)
def test_detectable_w_has_the_stated_noncentral_chisquare_power(n, n_bins, alpha, power):
    w = chisquare_detectable_w(n, n_bins, alpha, power)
    df = n_bins - 1
    achieved = stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * w**2)
    assert achieved == pytest.approx(power, abs=1e-6)


@pytest.mark.parametrize("n, n_bins, alpha", [(1000, 10, 0.01), (60_000, 10, 0.01 / 40 / 3), (5000, 50, 1e-5)])
def test_detectable_w_and_required_n_agree_with_statsmodels_solver(n, n_bins, alpha):
    solver = GofChisquarePower()
    w = solver.solve_power(effect_size=None, nobs=n, alpha=alpha, power=0.99, n_bins=n_bins)
    assert chisquare_detectable_w(n, n_bins, alpha, 0.99) == pytest.approx(w, rel=1e-4)
    required = solver.solve_power(effect_size=0.05, nobs=None, alpha=alpha, power=0.99, n_bins=n_bins)
    assert chisquare_required_n(0.05, n_bins, alpha, 0.99) == pytest.approx(required, rel=1e-4)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(20, 10**6), n_bins=st.integers(2, 200), alpha=st.floats(1e-6, 0.1))
def test_required_n_inverts_detectable_w(n, n_bins, alpha):
    w = chisquare_detectable_w(n, n_bins, alpha, 0.99)
    assert abs(chisquare_required_n(w, n_bins, alpha, 0.99) - n) <= 1


def _pearson_rejection_rate(p0: np.ndarray, p1: np.ndarray, n: int, alpha: float, reps: int, seed: int) -> float:
    counts = np.random.default_rng(seed).multinomial(n, p1, size=reps)  # [reps, K]
    return float((stats.chisquare(counts, n * p0, axis=1).pvalue <= alpha).mean())


def test_detectable_w_matches_monte_carlo_power():
    n, n_bins, alpha, power, reps = 2000, 10, 0.01, 0.9, 4000
    w = chisquare_detectable_w(n, n_bins, alpha, power)
    p0 = np.full(n_bins, 1 / n_bins)
    # move mass d from bin 0 to bin 1: w² = 2d² / (1/K)
    d = w / math.sqrt(2 * n_bins)
    p1 = p0 + np.r_[-d, d, np.zeros(n_bins - 2)]
    rate = _pearson_rejection_rate(p0, p1, n, alpha, reps, seed=1)
    mc_sd = math.sqrt(power * (1 - power) / reps)
    # tolerance: 5 MC standard deviations plus 0.02 for the noncentral-χ² approximation at n=2000
    assert abs(rate - power) < 5 * mc_sd + 0.02, (
        f"MC power {rate:.4f} vs stated {power} (MC sd {mc_sd:.4f}); false-failure probability < 1e-6 "
        "(5 MC sd, two-sided) while the stated power is within 0.02 of the true one"
    )


def test_predicted_power_matches_monte_carlo():
    p0 = np.array([0.4, 0.3, 0.2, 0.1])
    p1 = np.array([0.36, 0.3, 0.22, 0.12])
    n, alpha, reps = 1500, 0.01, 4000
    predicted = predicted_power(p0, p1, n, alpha)
    rate = _pearson_rejection_rate(p0, p1, n, alpha, reps, seed=2)
    mc_sd = math.sqrt(predicted * (1 - predicted) / reps)
    assert 0.2 < predicted < 0.95  # a power the MC check can resolve
    assert abs(rate - predicted) < 5 * mc_sd + 0.02, (
        f"MC power {rate:.4f} vs predicted {predicted:.4f} (MC sd {mc_sd:.4f}); false-failure probability "
        "< 1e-6 (5 MC sd, two-sided) while the prediction is within 0.02 of the true power"
    )


def test_predicted_power_counts_mass_outside_the_null_support():
    p0 = np.array([0.5, 0.5, 0.0])
    p1 = np.array([0.5, 0.49, 0.01])
    assert predicted_power(p0, p1, 1000, 0.01) >= 1 - 0.99**1000
    assert predicted_power(p0, p0, 1000, 0.01) == pytest.approx(0.01)


@pytest.mark.parametrize("n", [100, 1000, 100_000])
@pytest.mark.parametrize("alpha", [0.05, 1e-4])
def test_dkwm_detectable_is_conservative_but_close_to_exact_kolmogorov_quantiles(n, alpha):
    power = 0.99
    exact = stats.kstwo.isf(alpha, n) + stats.kstwo.isf(1 - power, n)
    bound = dkwm_detectable(n, alpha, power)
    assert exact <= bound <= 1.1 * exact


def test_dkwm_detectable_matches_monte_carlo_power():
    n, alpha, power, reps = 500, 0.01, 0.9, 1000
    d = dkwm_detectable(n, alpha, power)
    rng = np.random.default_rng(3)
    # alternative at Kolmogorov distance d from U(0,1): an atom of mass d at 0
    u = np.where(rng.random((reps, n)) < d, 0.0, rng.random((reps, n)))  # [reps, n]
    rate = float((stats.kstest(u, "uniform", axis=1).pvalue <= alpha).mean())
    mc_sd = math.sqrt(power * (1 - power) / reps)
    assert rate >= power - 3 * mc_sd, (
        f"MC power {rate:.4f} below the stated {power} (MC sd {mc_sd:.4f}); false-failure probability "
        "<= 1.8e-3 (P(Binomial(1000, 0.9) < 872)), less as the true power exceeds the stated one"
    )


@pytest.mark.parametrize("eps", [0.3, 0.05, 0.01])
def test_dkwm_required_n_is_the_smallest_n_reaching_eps(eps):
    n = dkwm_required_n(eps, 1e-4, 0.99)
    assert dkwm_detectable(n, 1e-4, 0.99) <= eps < dkwm_detectable(n - 1, 1e-4, 0.99)


def test_two_sample_dkwm_bound_is_above_exact_two_sample_quantiles():
    n, alpha, power = 2000, 0.001, 0.99
    bound = dkwm_two_sample_detectable(n, n, alpha, power)
    # asymptotic two-sample KS critical value: sqrt(2/n) times the Kolmogorov quantile
    critical = math.sqrt(2 / n) * stats.kstwobign.isf(alpha)
    assert critical < bound < 3 * critical


def test_require_power_names_test_n_detectable_target_and_needed_n():
    with pytest.raises(UnderpoweredError) as err:
        require_power(0.08, 0.05, "pooled PIT χ²", n=1000, required_n=2600, unit="PIT values")
    message = str(err.value)
    for part in ("pooled PIT χ²", "1000 PIT values", "0.08", "0.05", "n >= 2600"):
        assert part in message
    require_power(0.04, 0.05, "pooled PIT χ²", n=3000, required_n=2600)


def test_per_test_alpha_splits_and_validates():
    assert per_test_alpha(0.01, 40) == pytest.approx(0.01 / 40)
    for bad in [(0.0, 3), (1.0, 3), (0.01, 0), (0.01, 2.5)]:
        with pytest.raises(LosscheckError):
            per_test_alpha(*bad)
