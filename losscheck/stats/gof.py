"""Sample counts against counts known exactly under H0: binned goodness of fit and support.

Shared by the PIT mode (bins of [0, 1], uniform under H0) and the exact mode (bins of
enumerated sequences, exact target probabilities). A χ² or G p-value comes from the exact
multinomial law wherever its dynamic programme fits its budget (`losscheck.stats.multinomial`:
about 160-180 values whatever the number of bins), from the asymptotic χ² law beyond: at the
small levels a test is judged at, the χ² tail understates small samples' false-alarm rate
several-fold (3.17x at α = 3.2e-6 for 50 values in 10 bins) and large ones' by a factor that falls
as 1/E (the table in that module's docstring).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from losscheck.stats.multinomial import asymptotic_level, exact_law_applies, multinomial_tail
from losscheck.stats.power import chisquare_detectable_w
from losscheck.stats.result import TestResult


def describe_worst_bin(observed: np.ndarray, expected: np.ndarray) -> str:
    """The bin with the largest standardized residual (O - E) / sqrt(E), in words."""
    residual = (observed - expected) / np.sqrt(expected)  # [K]
    k = int(np.argmax(np.abs(residual)))
    return (
        f"bin {k} of {len(expected)} furthest off: {observed[k]:g} samples where "
        f"{expected[k]:.1f} were expected (standardized residual {residual[k]:+.2f})"
    )


def chi2_log10_sf(statistic: float, df: int) -> float:
    """log10 of the χ² tail P(X >= statistic) for `df` degrees of freedom, or, where scipy's
    log-tail underflows too (statistics of ~1,500 and beyond), of the Chernoff upper bound
    P(X >= x) <= exp(-(x - df - df·ln(x / df)) / 2) for x > df: a p-value below 10^-300 is then
    reported by how far below it is at least."""
    log_sf = float(stats.chi2.logsf(statistic, df))
    if math.isfinite(log_sf) or statistic <= df:
        return log_sf / math.log(10)
    return -(statistic - df - df * math.log(statistic / df)) / (2 * math.log(10))


def goodness_of_fit(
    name: str,
    expected_desc: str,
    observed: ArrayLike,
    expected: ArrayLike,
    alpha: float,
    power: float,
    statistic: Literal["pearson", "log-likelihood"] = "pearson",
) -> TestResult:
    """Pearson χ² (or G-test, statistic="log-likelihood") of counts `observed` [K] against
    `expected` [K] (same total, K >= 2), with the detectable w and binned TV = w/2; the result's
    `observed` text names the law its p-value came from (`p_value_of`)."""
    obs = np.asarray(observed, dtype=np.float64)  # [K]
    exp = np.asarray(expected, dtype=np.float64)  # [K]
    n = int(round(obs.sum()))
    result = stats.power_divergence(obs, exp, lambda_=statistic)
    p_value, log10_p, law, level = p_value_of(obs, exp, float(result.statistic), statistic, alpha)
    w = chisquare_detectable_w(n, len(exp), level, power)
    return TestResult(
        name=name,
        expected=expected_desc,
        observed=f"{describe_worst_bin(obs, exp)}; {law}",
        statistic=float(result.statistic),
        p_value=p_value,
        alpha=alpha,
        n=n,
        power=power,
        detectable={"w": w, "tv": w / 2},
        log10_p=log10_p,
    )


def p_value_of(
    observed: np.ndarray,
    expected: np.ndarray,
    value: float,
    statistic: Literal["pearson", "log-likelihood"],
    alpha: float,
) -> tuple[float, float, str, float]:
    """(p, log10 p, the law in words, the level the detectable effect is stated at) of the
    statistic `value` of counts `observed` [K] against `expected` [K], judged at `alpha`: from the
    exact multinomial law where its DP is affordable (exact for Pearson on equal bins, else an
    upper bound on the exact p-value); else from the asymptotic χ² law, for Pearson scaled by
    α / a, a the level at which that law's test holds α (`multinomial.asymptotic_level`), so
    that p <= α exactly when the χ² p <= a."""
    if exact_law_applies(observed, expected, statistic):
        tail = multinomial_tail(observed.round().astype(np.int64), expected, statistic)
        law = "p from the exact multinomial law" if tail.exact else "p an upper bound from the exact multinomial law"
        return tail.p_value, tail.log10_p, law, alpha
    df = len(expected) - 1
    p, log10_p = float(stats.chi2.sf(value, df)), chi2_log10_sf(value, df)
    if statistic != "pearson" or not 0 < alpha < 1:
        return p, log10_p, "p from the asymptotic χ² law", alpha
    level = asymptotic_level(len(expected), float(np.min(expected)), alpha)
    scale = alpha / level
    law = f"p from the asymptotic χ² law times {scale:.3g}, its excess false alarms at α (E {np.min(expected):.3g})"
    return min(1.0, p * scale), min(0.0, log10_p + math.log10(scale)), law, level


def support_check(name: str, n_impossible: int, n: int, power: float, what: str) -> TestResult:
    """Fails when any of `n` sampled `what`s has probability 0 under the target."""
    return impossible_event(
        name,
        f"every sampled {what} to have positive probability under the target",
        f"{n_impossible} of {n} sampled {what}s have probability 0 under the target",
        n_impossible,
        n,
        power,
    )


def impossible_event(name: str, expected: str, observed: str, count: int, n: int, power: float) -> TestResult:
    """A check of an event that has probability 0 under H0, seen `count` times in `n` trials.

    The exact p-value is 1 without the event and 0 with one, so the check spends no share of the
    false-alarm budget (alpha = 0). It catches an event of probability m >= 1 - (1 - power)^(1/n)
    per trial with probability >= power.
    """
    return TestResult(
        name=name,
        expected=expected,
        observed=observed,
        statistic=float(count),
        p_value=1.0 if count == 0 else 0.0,
        alpha=0.0,
        n=n,
        power=power,
        detectable={"mass": 1.0 - (1.0 - power) ** (1.0 / n) if n > 0 else float("inf")},
    )
