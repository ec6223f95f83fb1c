"""The Bennett mixture e-value of a sum of bounded increments, and where it rejects.

For increments Y_t <= 1 with E[Y_t | past] = 0 and Var[Y_t | past] = σ_t², Bennett's lemma gives
E exp(λY_t) <= exp(ψ(λ)σ_t²), ψ(λ) = e^λ - 1 - λ, for every λ > 0; so exp(λS - ψ(λ)W)
(S = ΣY_t, W = Σσ_t²) is a nonnegative supermartingale, and so is a fixed-weight mixture over λ:
by Ville's inequality min(1, 1/e) is a p-value valid under any stopping rule. The e-value tests
(`losscheck.stats.conditional`, `losscheck.cells.conformance`) and their power models
(`losscheck.stats.effects`) share this arithmetic.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike
from scipy import optimize

from losscheck.stats._checks import check_open_unit

# Bennett mixture grid, equal weights. The mixture's log e-value is within log(len) of the best
# λ on the grid and, with steps of √2, within 4% of the best λ's exponent (at λ = c·λ*, the
# Gaussian exponent is (2c - c²) of the optimum; c = 2^(±1/4) gives 0.96). The optimum for a sum
# with variance W that must reach log(1/α) is λ* ≈ sqrt(2 log(1/α) / W): 2^-12 covers W up to
# ~10^8 (a surprisal sum over ~10^9 tokens, far beyond any cell), and λ up to 2 serves rare ids
# whose count is several times its tiny expectation (λ* = log(observed / expected)).
LAMBDAS = np.exp2(np.arange(-24, 3) / 2.0)  # 2^-12 ... 2^1, 27 points


def log_mixture_evalue(s: ArrayLike, w: ArrayLike, one_sided: bool = False) -> np.ndarray:
    """log of the two-sided Bennett mixture e-value of sums `s` with variance sums `w` (same shape,
    w >= 0): log( (mean_λ exp(λs - ψ(λ)w) + mean_λ exp(-λs - ψ(λ)w)) / 2 ), λ over `LAMBDAS`;
    `one_sided`: log mean_λ exp(λs - ψ(λ)w), evidence for S > 0 only (valid when every increment
    of S is <= 1; it spends no e-value on the other side, so it rejects with about log 2 less).
    Computed in log space (logaddexp): finite for any finite s, however large."""
    s = np.asarray(s, dtype=np.float64)[..., None]  # [..., 1]
    w = np.asarray(w, dtype=np.float64)[..., None]  # [..., 1]
    psi = np.expm1(LAMBDAS) - LAMBDAS  # [K]
    up = np.logaddexp.reduce(LAMBDAS * s - psi * w, axis=-1)  # [...]
    if one_sided:
        return up - math.log(len(LAMBDAS))
    down = np.logaddexp.reduce(-LAMBDAS * s - psi * w, axis=-1)  # [...]
    return np.logaddexp(up, down) - math.log(2 * len(LAMBDAS))


def mixture_evalue(s: ArrayLike, w: ArrayLike) -> np.ndarray:
    """The two-sided Bennett mixture e-value of (S, W) (any shape; inf where it overflows a float,
    `log_mixture_evalue` keeps its size). Valid when every increment of S and of -S is <= 1."""
    return np.exp(log_mixture_evalue(s, w))


def evalue_threshold(w: float, alpha: float, one_sided: bool = False) -> float:
    """Smallest |S| (S for `one_sided`) at which the mixture e-value of (S, `w`) reaches
    1 / `alpha`: where the e-value tests reject."""
    target = -math.log(check_open_unit("alpha", alpha))

    def gap(s: float) -> float:
        return float(log_mixture_evalue(s, w, one_sided)) - target

    # The mixture lies between its largest term and that term / (K, or 2K two-sided), so the
    # threshold lies between the best single λ's and the same with log K (log 2K) added: a
    # bracket a few percent wide, found without a search.
    psi = np.expm1(LAMBDAS) - LAMBDAS  # [K]
    spread = math.log(len(LAMBDAS) * (1 if one_sided else 2))
    low = float(((target + psi * w) / LAMBDAS).min())
    high = float(((target + spread + psi * w) / LAMBDAS).min())
    if gap(high) < 0:  # round-off at the bracket's edge
        high *= 1 + 1e-9
    if gap(low) >= 0:
        return low
    return float(optimize.brentq(gap, low, high, xtol=1e-9, rtol=1e-12))
