"""The exact multinomial law of Pearson's X² and the G statistic (`losscheck.stats.multinomial`)
against enumeration, closed forms and a seeded simulation, and `goodness_of_fit` choosing it."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from losscheck.stats.gof import goodness_of_fit
from losscheck.stats.multinomial import (
    asymptotic_level,
    equal_bins_tail,
    exact_law_applies,
    false_alarm_rate,
    multinomial_tail,
)


def _count_vectors(n: int, k: int) -> Iterator[tuple[int, ...]]:
    """Every vector of k counts adding up to n."""
    for head in itertools.product(range(n + 1), repeat=k - 1):
        if sum(head) <= n:
            yield (*head, n - sum(head))


def _pmf(counts: tuple[int, ...], probs: tuple[Fraction, ...]) -> Fraction:
    """Multinomial probability of `counts`, exactly."""
    ways = math.factorial(sum(counts))
    for c in counts:
        ways //= math.factorial(c)
    return ways * math.prod((p**c for p, c in zip(probs, counts)), start=Fraction(1))


def _statistic(counts: tuple[int, ...], expected: np.ndarray, statistic: str) -> float:
    return float(stats.power_divergence(np.array(counts, dtype=float), expected, lambda_=statistic).statistic)


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("n", range(1, 9))
def test_equal_bins_pearson_is_exact_against_enumeration(n: int, k: int) -> None:
    """For every count vector of n <= 8 values in k <= 4 equal bins the p-value is P(U >= U_obs),
    U = Σ (O - c)² an integer, summed over all vectors in exact arithmetic."""
    c = round(n / k)
    law = [(sum((o - c) ** 2 for o in v), _pmf(v, (Fraction(1, k),) * k)) for v in _count_vectors(n, k)]
    for v in _count_vectors(n, k):
        u = sum((o - c) ** 2 for o in v)
        tail = multinomial_tail(v, np.full(k, n / k))
        assert tail.exact
        assert tail.p_value == pytest.approx(float(sum(p for w, p in law if w >= u)), rel=1e-12), v
        assert tail.log10_p == pytest.approx(math.log10(tail.p_value), rel=1e-12)


@pytest.mark.parametrize("statistic", ["pearson", "log-likelihood"])
@pytest.mark.parametrize(
    "probs",
    [(Fraction(7, 10), Fraction(3, 10)), (Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)), (Fraction(1, 4),) * 4],
)
def test_grid_bounds_the_exact_p_value_against_enumeration(statistic: str, probs: tuple[Fraction, ...]) -> None:
    """Unequal bins, and the G statistic on any bins, are rounded onto a grid: the p-value is at
    least the exact P(X >= x_obs) and at most the exact P(X >= 0.99·x_obs) (rounding lowers the
    statistic by <= K/2 of 100·K steps, 0.5%), for every vector of n <= 8 values. Pearson on equal
    bins, exact, passes the same check."""
    k = len(probs)
    for n in range(1, 9):
        expected = n * np.array([float(p) for p in probs])
        law = [(_statistic(v, expected, statistic), float(_pmf(v, probs))) for v in _count_vectors(n, k)]
        for v in _count_vectors(n, k):
            x = _statistic(v, expected, statistic)
            tail = multinomial_tail(v, expected, statistic)
            exact = sum(p for y, p in law if y >= x - 1e-9 * max(1.0, x))
            loose = sum(p for y, p in law if y >= 0.99 * x - 1e-9 * max(1.0, x))
            assert tail.exact == (statistic == "pearson" and len(set(probs)) == 1)
            assert exact * (1 - 1e-12) <= tail.p_value <= loose * (1 + 1e-12) + 1e-15, (n, v)


def _partitions(n: int, parts: int, largest: int) -> Iterator[tuple[int, ...]]:
    """Count vectors of `parts` counts adding up to n, in non-increasing order."""
    if parts == 0:
        if n == 0:
            yield ()
        return
    for first in range(min(n, largest), (n + parts - 1) // parts - 1, -1):
        for rest in _partitions(n - first, parts - 1, first):
            yield (first, *rest)


def test_equal_bins_tail_matches_partitions_down_to_tiny_p() -> None:
    """50 values in 10 equal bins (every DP step and the odd/even meeting at work): the law of U
    summed over the 62,740 partitions of 50 into 10 counts, each weighted by its arrangements,
    matches the DP to 1e-9 relative at every tail from 1 down to 1e-14."""
    n, k = 50, 10
    law: Counter[int] = Counter()
    for part in _partitions(n, k, n):
        arrangements = math.factorial(k) // math.prod(math.factorial(m) for m in Counter(part).values())
        log_p = math.lgamma(n + 1) - sum(math.lgamma(o + 1) for o in part) - n * math.log(k)
        law[sum((o - 5) ** 2 for o in part)] += arrangements * math.exp(log_p)
    checked = 0
    for u in range(0, max(law) + 1, 7):
        exact = math.fsum(p for w, p in law.items() if w >= u)
        if exact < 1e-14:
            break
        assert equal_bins_tail(n, k, u) == pytest.approx(exact, rel=1e-9), u
        checked += 1
    assert checked > 50


@pytest.mark.parametrize("n", [20, 41])
def test_tiny_p_value_matches_closed_form(n: int) -> None:
    """All n values in one of 2 bins is the largest statistic, reached by 2 of the 2^n equally likely assignments:
    p = 2^(1-n), 9.1e-13 at n = 41, exact to 1e-12 relative."""
    tail = multinomial_tail([n, 0], [n / 2, n / 2])
    assert tail.exact
    assert tail.p_value == pytest.approx(2.0 ** (1 - n), rel=1e-12)
    assert tail.log10_p == pytest.approx((1 - n) * math.log10(2), rel=1e-12)


def test_statistic_beyond_the_fine_limit_reports_an_upper_bound() -> None:
    """60 values in one of 2 bins (χ² tail ~1e-14): the tail at the statistic of χ² tail 1e-12,
    which bounds the exact 2^-59 from above and stays far below any level."""
    tail = multinomial_tail([60, 0], [30.0, 30.0])
    assert not tail.exact
    assert 2.0**-59 <= tail.p_value < 1e-10
    assert equal_bins_tail(60, 2, 3600) == pytest.approx(2.0**-59, rel=1e-12)


@pytest.mark.parametrize("n, chi2_at_least", [(50, 3.0), (100, 2.0)])
def test_exact_law_holds_alpha_where_the_chi2_law_does_not(n: int, chi2_at_least: float) -> None:
    """At α = 3.2e-6, n values in 10 equal bins: the probability mass of the outcomes the exact
    law rejects is at most α (it is exact, so no more can be asked of a discrete test), while the
    χ² law rejects outcomes of mass 3.17α (n = 50) and 2.11α (n = 100), both computed by the DP."""
    alpha = 3.2e-6
    exact = false_alarm_rate(n, 10, alpha, "exact")
    chi2 = false_alarm_rate(n, 10, alpha, "asymptotic")
    assert 0.8 * alpha <= exact <= alpha, f"exact law rejects mass {exact:.4g} at alpha {alpha:g}"
    assert chi2 >= chi2_at_least * alpha, f"χ² law rejects mass {chi2:.4g} at alpha {alpha:g}"


def test_simulated_false_alarm_rate_within_binomial_bound() -> None:
    """10^6 seeded samples of 50 values in 10 equal bins under H0, each judged at α = 1e-3 by
    both laws. A test of level α rejects at most B = 1,099 of them with probability 0.999 (the
    binomial(10^6, 1e-3) 0.999 quantile). The exact law (true rate 0.931e-3, by the DP: more than
    B with probability 4e-8) stays within it; the χ² law (true rate 1.223e-3: 1,223 expected, B or
    fewer with probability 1.5e-4) does not."""
    n, k, alpha, draws = 50, 10, 1e-3, 1_000_000
    bound = int(stats.binom.ppf(0.999, draws, alpha))
    rng = np.random.default_rng(20261129)
    samples = np.concatenate([rng.multinomial(n, np.full(k, 1 / k), size=draws // 4).astype(np.int8) for _ in range(4)])
    u = ((samples.astype(np.int64) - 5) ** 2).sum(1)  # [draws] U = Σ (O - 5)²
    values, first, seen = np.unique(u, return_index=True, return_counts=True)  # [D] distinct U
    exact_p = np.array([multinomial_tail(samples[i], np.full(k, n / k)).p_value for i in first])  # [D]
    chi2_p = stats.chi2.sf(values * k / n, k - 1)  # [D] X² = U·k/n as n/k = 5 exactly
    exact_rejections = int(seen[exact_p <= alpha].sum())
    chi2_rejections = int(seen[chi2_p <= alpha].sum())
    assert bound == 1099
    assert exact_rejections <= bound, f"exact law: {exact_rejections} rejections, bound {bound}"
    assert chi2_rejections > bound, f"χ² law: {chi2_rejections} rejections, bound {bound}"


def test_goodness_of_fit_takes_the_exact_law_where_affordable() -> None:
    """50 values in 10 equal bins: p and log10 p from the exact law, which the result names; the
    statistic stays Pearson's X²."""
    counts = np.array([12, 3, 5, 5, 4, 6, 5, 2, 4, 4])
    result = goodness_of_fit("t", "uniform", counts, np.full(10, 5.0), alpha=3.2e-6, power=0.9)
    tail = multinomial_tail(counts, np.full(10, 5.0))
    assert (result.p_value, result.log10_p) == (tail.p_value, tail.log10_p)
    assert result.statistic == pytest.approx(float(((counts - 5) ** 2).sum()) / 5)
    assert result.observed.endswith("p from the exact multinomial law")


def test_goodness_of_fit_keeps_the_chi2_law_beyond_the_budget() -> None:
    """20,000 values (the DP would cost far more than its budget) keep the asymptotic law, its p
    scaled by α / a (`asymptotic_level`), named in the result with the factor; the detectable
    effect is stated at a. The G statistic, and non-integer counts, keep the law unscaled."""
    counts = np.array([2100, 1950, 2000, 2010, 1940, 2000, 2000, 2000, 2000, 2000])
    result = goodness_of_fit("t", "uniform", counts, np.full(10, 2000.0), alpha=1e-6, power=0.9)
    scale = 1e-6 / asymptotic_level(10, 2000.0, 1e-6)
    assert 1.0 < scale < 1.02  # E = 2,000: the χ² law's excess is small
    assert result.p_value == pytest.approx(float(stats.chisquare(counts).pvalue) * scale, rel=1e-12)
    assert result.log10_p == pytest.approx(math.log10(result.p_value), rel=1e-9)
    assert "p from the asymptotic χ² law times" in result.observed
    g = goodness_of_fit("t", "uniform", counts, np.full(10, 2000.0), 1e-6, 0.9, statistic="log-likelihood")
    assert g.observed.endswith("p from the asymptotic χ² law")
    assert not exact_law_applies(np.array([2.5, 2.5]), np.array([2.5, 2.5]))


@pytest.mark.parametrize(("e", "alpha", "before"), [(20, 1e-5, 1.39), (20, 1e-7, 2.41), (50, 1e-7, 1.50)])
def test_past_the_cut_the_chi2_law_is_judged_at_a_level_that_holds_alpha(e: int, alpha: float, before: float) -> None:
    """10 equal bins of E values each, past the exact law's cut (179 values): computed exactly
    (`false_alarm_rate`), the χ² law's test at α rejects `before`·α or more of the time, and at
    `asymptotic_level`'s level between 0.9α and 1.01α (its excess is read at 179 values and taken
    down as 1/E: an approximation, checked here, not a bound)."""
    n = 10 * e
    assert not exact_law_applies(np.full(10, e), np.full(10, float(e)))
    assert false_alarm_rate(n, 10, alpha, "asymptotic") >= before * alpha
    rate = false_alarm_rate(n, 10, asymptotic_level(10, float(e), alpha), "asymptotic")
    assert 0.9 * alpha <= rate <= 1.01 * alpha, rate / alpha


def test_goodness_of_fit_g_test_reports_an_upper_bound() -> None:
    """The G-test on small counts: an upper bound on its exact p-value, said so."""
    counts = np.array([9, 1, 2, 3])
    result = goodness_of_fit("t", "uniform", counts, np.full(4, 3.75), 1e-3, 0.9, statistic="log-likelihood")
    assert result.observed.endswith("p an upper bound from the exact multinomial law")
    assert result.log10_p == pytest.approx(math.log10(result.p_value))


def test_exact_law_covers_the_small_samples_of_the_pit_and_conformance_tests() -> None:
    """The sizes at which the χ² law is worst run exactly: 50 and 100 values on 10 bins (the
    conformance and residual-order minimum and beyond), 125 pairs on the 25-cell grid."""
    for n, k in [(50, 10), (100, 10), (125, 25)]:
        assert exact_law_applies(np.full(k, n // k), np.full(k, n / k)), (n, k)
