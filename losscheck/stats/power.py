"""How small a distortion each test detects, and how many samples a target distortion needs.

Two families of bound, both stated at a level `alpha` and a power `power`:

* Pearson χ² (and the G-test, which has the same noncentral-χ² power to first order): the
  statistic under an alternative with Cohen's effect size w over the bins is approximately
  noncentral χ² with df = n_bins - 1 and noncentrality n·w² (statsmodels `GofChisquarePower`).
  Total variation: an alternative at total variation δ from the null *on the bins* has
  w² = Σ (p1 - p0)² / p0 >= (Σ |p1 - p0|)² = (2δ)² by Cauchy-Schwarz, so w >= 2δ and a test that
  detects w detects every binned TV >= w/2. Binning can only lower TV, so this is a guarantee
  about the distance the bins see, not about every distortion of the full distribution.
* Kolmogorov-Smirnov, through the Dvoretzky-Kiefer-Wolfowitz-Massart inequality
  P(sup |F_n - F| > ε) <= 2·exp(-2nε²), i.e. ε(n, a) = sqrt(ln(2/a) / (2n)). The KS test at
  level α rejects at a sup-distance no larger than ε(n, α); under an alternative at Kolmogorov
  distance D the empirical CDF stays within ε(n, β) of it with probability >= 1 - β
  (β = 1 - power), so every D >= ε(n, α) + ε(n, β) is detected. Kolmogorov distance <= TV.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize, special
from statsmodels.stats.gof import chisquare_effectsize

from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.stats._checks import check_open_unit, check_positive, check_tv


@functools.lru_cache(maxsize=1024)  # a cell asks for the same few levels thousands of times
def _critical_value(df: int, alpha: float) -> float:
    return float(special.chdtri(df, alpha))  # the χ² (df) upper-α quantile


def chisquare_power(noncentrality: float, n_bins: int, alpha: float) -> float:
    """Power of a Pearson χ² test with `n_bins` cells at level `alpha` at `noncentrality` n·w²:
    statsmodels' `GofChisquarePower().power(w, n, alpha, n_bins)`, computed from scipy's
    noncentral χ² CDF with the critical value cached; the power models call it thousands of times
    per cell, where statsmodels' argument handling and scipy's distribution objects cost 0.4 ms
    a call (tests/unit/test_power.py checks the two agree)."""
    df = n_bins - 1
    return float(1.0 - special.chndtr(_critical_value(df, alpha), df, noncentrality))


def _check_bins(n_bins: int) -> None:
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 2:
        raise LosscheckError(f"a χ² test needs at least 2 bins (df >= 1), got n_bins = {n_bins!r}")


@functools.lru_cache(maxsize=1024)  # a run asks again and again for the same few levels
def _noncentrality(n_bins: int, alpha: float, power: float) -> float:
    """Noncentrality λ at which a Pearson χ² test with `n_bins` cells at level `alpha` has power
    `power`; a test of n samples then detects w = sqrt(λ / n), and w needs n = λ / w².

    Solved once for λ (w = 1, nobs = λ in statsmodels' power) rather than by statsmodels'
    `solve_power` for w or n, whose tolerance leaves the power off in the 6th digit.
    """
    _check_bins(n_bins)
    alpha = check_open_unit("alpha", alpha)
    power = check_open_unit("power", power)
    if power <= alpha:
        raise LosscheckError(f"power ({power}) must exceed alpha ({alpha}): a test has power alpha at no effect")

    def gap(lam: float) -> float:
        return chisquare_power(lam, n_bins, alpha) - power

    high = float(n_bins)
    while gap(high) < 0:
        high *= 2
    return float(optimize.brentq(gap, 0.0, high, xtol=1e-12, rtol=1e-13))


def chisquare_detectable_w(n: float, n_bins: int, alpha: float, power: float) -> float:
    """Smallest Cohen's w that a Pearson χ² test with `n_bins` cells (df = n_bins - 1) on `n`
    samples detects with probability `power` at level `alpha`. Detectable binned TV = w / 2.

    For a test whose df is not cells - 1 (e.g. a table with fixed row totals), pass
    n_bins = df + 1: only df enters the power.
    """
    return math.sqrt(_noncentrality(n_bins, alpha, power) / check_positive("n", n))


def chisquare_required_n(w: float, n_bins: int, alpha: float, power: float) -> int:
    """Smallest n at which a Pearson χ² test with `n_bins` cells detects effect `w`."""
    return math.ceil(_noncentrality(n_bins, alpha, power) / check_positive("w", w) ** 2)


def _dkwm_epsilon(n: float, level: float) -> float:
    """DKWM radius: P(sup |F_n - F| > ε) <= `level` for ε = sqrt(ln(2/level) / (2n))."""
    return math.sqrt(math.log(2.0 / level) / (2.0 * n))


def dkwm_detectable(n: float, alpha: float, power: float) -> float:
    """Kolmogorov distance sup |F - U| a one-sample KS test on `n` values detects with
    probability `power` at level `alpha`: ε(n, α) + ε(n, 1 - power) (module docstring)."""
    check_positive("n", n)
    alpha = check_open_unit("alpha", alpha)
    beta = 1.0 - check_open_unit("power", power)
    return _dkwm_epsilon(n, alpha) + _dkwm_epsilon(n, beta)


def dkwm_required_n(eps: float, alpha: float, power: float) -> int:
    """Smallest n at which `dkwm_detectable(n, alpha, power) <= eps`."""
    check_positive("eps", eps)
    alpha = check_open_unit("alpha", alpha)
    beta = 1.0 - check_open_unit("power", power)
    root_n = (math.sqrt(math.log(2.0 / alpha) / 2.0) + math.sqrt(math.log(2.0 / beta) / 2.0)) / eps
    return math.ceil(root_n**2)


def dkwm_two_sample_detectable(n_a: float, n_b: float, alpha: float, power: float) -> float:
    """Kolmogorov distance between two distributions that a two-sample KS test on `n_a` and `n_b`
    values detects with probability `power` at level `alpha`.

    sup |F_a - F_b| deviates from the true distance by at most the two samples' DKWM radii; each
    side gets half of α and half of β: ε(n_a, α/2) + ε(n_b, α/2) + ε(n_a, β/2) + ε(n_b, β/2).
    """
    half_power = 1.0 - (1.0 - check_open_unit("power", power)) / 2.0
    half_alpha = check_open_unit("alpha", alpha) / 2.0
    return dkwm_detectable(n_a, half_alpha, half_power) + dkwm_detectable(n_b, half_alpha, half_power)


def require_power(
    detectable_tv: float,
    target_tv: float,
    what: str,
    *,
    n: int,
    required_n: int,
    unit: str = "samples",
) -> None:
    """Raise `UnderpoweredError` unless a test detects every distortion of TV >= `target_tv`.

    `what` names the test (and its level and power), `n` is its sample size in `unit`,
    `required_n` the size at which it would reach `target_tv`.
    """
    check_tv("target TV", target_tv)
    if detectable_tv > target_tv:
        raise UnderpoweredError(
            f"{what} is underpowered: with n = {n} {unit} it detects only TV >= "
            f"{detectable_tv:.4g}, above the target TV {target_tv:.4g}; it needs n >= "
            f"{required_n} {unit}. Draw more samples or raise the target TV."
        )


def predicted_power(p_null: ArrayLike, p_alt: ArrayLike, n: float, alpha: float) -> float:
    """Power of a Pearson χ² test of `n` samples against the bin probabilities `p_null` [K] when
    they are really drawn from `p_alt` [K] (noncentral χ², df = K - 1, noncentrality n·w²).

    Mass that `p_alt` puts where `p_null` is 0 is caught by the support check whenever one such
    sample is drawn; the power returned is then the larger of that probability and the χ² power
    on the rest, a lower bound on the power of the two together.
    """
    check_positive("n", n)
    alpha = check_open_unit("alpha", alpha)
    p0 = np.asarray(p_null, dtype=np.float64)  # [K]
    p1 = np.asarray(p_alt, dtype=np.float64)  # [K]
    if p0.ndim != 1 or p0.shape != p1.shape:
        raise LosscheckError(f"p_null and p_alt must be 1-D of one length, got {p0.shape} and {p1.shape}")
    if (p0 < 0).any() or (p1 < 0).any() or p0.sum() <= 0 or p1.sum() <= 0:
        raise LosscheckError("p_null and p_alt must be non-negative with positive total mass")
    p0, p1 = p0 / p0.sum(), p1 / p1.sum()
    support = p0 > 0
    outside = float(p1[~support].sum())
    caught_by_support = 1.0 - (1.0 - outside) ** n
    if support.sum() < 2 or outside >= 1.0:
        return caught_by_support
    w = float(chisquare_effectsize(p0[support], p1[support]))
    n_inside = n * (1.0 - outside)  # expected number of samples the χ² test sees
    chisquare = chisquare_power(w * w * n_inside, int(support.sum()), alpha)
    return max(caught_by_support, chisquare)
