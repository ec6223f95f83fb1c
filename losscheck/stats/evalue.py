"""The Bennett mixture e-value of a sum of bounded increments, and where it rejects.

For increments Y_t <= 1 with E[Y_t | past] = 0 and Var[Y_t | past] = σ_t², Bennett's lemma gives
E exp(λY_t) <= exp(ψ(λ)σ_t²), ψ(λ) = e^λ - 1 - λ, for every λ > 0; so exp(λS - ψ(λ)W)
(S = ΣY_t, W = Σσ_t²) is a nonnegative supermartingale, and so is a fixed-weight mixture over λ:
by Ville's inequality min(1, 1/e) is a p-value valid under any stopping rule. The e-value tests
(`losscheck.stats.conditional`, `losscheck.cells.conformance`) and their power models
(`losscheck.stats.effects`) share this arithmetic.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numpy.typing import ArrayLike

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
    return float(evalue_thresholds(np.asarray(w, dtype=np.float64), alpha, one_sided))


def evalue_thresholds(w: np.ndarray, alpha: float, one_sided: bool = False) -> np.ndarray:
    """`evalue_threshold` at every variance sum of `w` (any shape, w >= 0) at once, by Newton's
    method from above: the log mixture is a log-sum-exp of lines in S, so convex, and increasing
    for S > 0; from a point past the root each step lands between the root and that point, and
    the steps shrink quadratically. The power models call this tens of thousands of times per
    cell, where a bracketing search cost a quarter of a PIT cell's seconds; about half of those
    calls repeat an earlier one exactly (a family member's power at the tokens of another: its
    H0 variance does not depend on the member), so results are memoised. Read-only."""
    w = np.asarray(w, dtype=np.float64)
    return _thresholds(w.shape, w.tobytes(), float(check_open_unit("alpha", alpha)), bool(one_sided))


@functools.lru_cache(maxsize=8192)
def _thresholds(shape: tuple[int, ...], w_bytes: bytes, alpha: float, one_sided: bool) -> np.ndarray:
    """`evalue_thresholds` of the float64 array `w_bytes` of `shape`, computed, read-only."""
    s = np.array(_solve_thresholds(np.frombuffer(w_bytes, dtype=np.float64).reshape(shape), alpha, one_sided))
    s.flags.writeable = False
    return s


def _solve_thresholds(w: np.ndarray, alpha: float, one_sided: bool) -> np.ndarray:
    """Newton's method of `evalue_thresholds`."""
    target = -math.log(alpha)
    w = w[..., None]  # [..., 1]
    psi = np.expm1(LAMBDAS) - LAMBDAS  # [K]
    # The mixture lies between its largest term and that term / (K, or 2K two-sided), so the
    # root lies between the best single λ's threshold and the same with log K (log 2K) added.
    spread = math.log(len(LAMBDAS) * (1 if one_sided else 2))
    low = ((target + psi * w) / LAMBDAS).min(axis=-1)  # [...]
    s = ((target + spread + psi * w) / LAMBDAS).min(axis=-1)  # [...], at or past the root
    for _ in range(_NEWTON_STEPS):
        up = LAMBDAS * s[..., None] - psi * w  # [..., K] log terms of the S > 0 side
        terms = up if one_sided else np.concatenate([up, -LAMBDAS * s[..., None] - psi * w], axis=-1)
        slopes = LAMBDAS if one_sided else np.concatenate([LAMBDAS, -LAMBDAS])  # [K] or [2K]
        top = terms.max(axis=-1, keepdims=True)  # [..., 1]
        weights = np.exp(terms - top)  # [..., K or 2K]
        mass = weights.sum(axis=-1)  # [...]
        gap = top[..., 0] + np.log(mass) - spread - target  # [...] log e-value - log(1/alpha)
        step = gap / ((weights * slopes).sum(axis=-1) / mass)  # [...] gap / its slope
        s = np.maximum(s - np.maximum(step, 0.0), low)
        if not (step > 1e-13 * s).any():
            break
    return s


# Newton's steps from the bracket's top (a few percent past the root): 4-6 reach round-off.
_NEWTON_STEPS = 50
