"""What a test sees per token under a bug class, and the tokens and power that follow.

An *effect* answers two questions at a test's level α: the tokens it needs to reject with a given
power (`tokens_needed`, math.inf when it has none within `MAX_TOKENS`) and its power after n
tokens (`power`). A test's *power model* (`PowerModel`, carried by its registration in
`losscheck.stats.registry`) builds its effect from a `ClassView`: one bug class's sufficient sums
(`losscheck.stats.bugsums`) at one member of its family, and the same steps' sums under H0.

- χ² tests (`ChisquareEffect`): noncentrality n·w² with w² = B·Σ_b (π̄_b - 1/B)² of the average
  bin law (`w2`), power from the noncentral χ² (`losscheck.stats.power.chisquare_power`).
- e-value tests (`EvalueEffect`): per token the drift d = E_{p'}[Y] of the increment, its variance
  under H0 σ² (what the test's W adds) and under the bug τ². The rejection threshold on S given
  W = n·σ² is solved exactly from the mixture (`losscheck.stats.evalue.evalue_thresholds`); the
  power is the normal approximation P(S_n >= threshold) with S_n ~ N(n·d, n·τ²). The level of
  the tests is exact; their power here is that approximation.
- the likelihood-ratio bound (`LikelihoodRatioEffect`): the Neyman–Pearson test that knows the
  bug's law at every step, its log-LR sum taken as Gaussian, or the support check where p' puts
  mass outside p's support. A benchmark, not a test a cell runs.
- Wald's sequential probability ratio test (`wald_size`): the fewest tokens any test of p against
  p' needs on average at error rates α and β = 1 - power, under the bug and under H0 — the
  information bound a cell's draws are compared with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from numpy.typing import ArrayLike
from scipy import special, stats

from losscheck.errors import LosscheckError
from losscheck.stats.buglaws import BugClass
from losscheck.stats.bugsums import SUMS, NullSums, Sums
from losscheck.stats.evalue import evalue_thresholds
from losscheck.stats.power import chisquare_power, chisquare_required_n

MAX_TOKENS = 1e13  # beyond this a test is reported as having no power (math.inf)


class Effect(Protocol):
    """What one test sees per token under one law."""

    def tokens_needed(self, alpha: float, power: float) -> float:
        """Tokens for the test, at level `alpha`, to reject with probability `power`; math.inf: never."""
        ...

    def power(self, n: float, alpha: float) -> float:
        """The probability that the test, at level `alpha`, rejects after `n` tokens."""
        ...


@dataclass(frozen=True)
class ClassView:
    """What a power model reads about one bug class at one member ρ of its family."""

    bug: BugClass
    sums: Sums  # the class's sums at the member; the per-id class's at its reported id
    h0: NullSums  # the same steps under H0
    n_bins: int  # the PIT tests' equal bins
    has_slots: bool  # the run recorded each token's slot
    reported_id: int | None  # the per-id class: the id it is reported at
    id_fixed: bool  # that id was fixed before the sample (so pit.bug_classes aims a score at it)
    class_scores: tuple[int, ...]  # the class scores pit.bug_classes holds (indices into the classes)

    @property
    def steps(self) -> float:
        return float(self.h0.steps)


@dataclass(frozen=True)
class PowerModel:
    """A test's power model: `effect(view)` is what the test sees per token under the class of
    `view` (None: the test has no entry for that class); `reads` names the sufficient sums
    (fields of `losscheck.stats.bugsums.Sums`) it needs, checked when it is declared."""

    effect: Callable[[ClassView], Effect | None]
    reads: frozenset[str]

    def __post_init__(self) -> None:
        unknown = set(self.reads) - SUMS
        if unknown:
            raise LosscheckError(
                f"a power model reads sums {sorted(unknown)} that the bug-class design does not keep; "
                f"it keeps {sorted(SUMS)} (losscheck.stats.bugsums.Sums)"
            )


@dataclass(frozen=True)
class ChisquareEffect:
    """A χ² goodness-of-fit test of B cells, per token: its noncentrality w², and the share of
    tokens it sees."""

    w2: float  # per-token noncentrality
    n_bins: int  # cells (df + 1)
    support: float  # share of tokens the test sees (inside p's support)

    def tokens_needed(self, alpha: float, power: float) -> float:
        if self.w2 <= 0 or self.support <= 0:
            return math.inf
        n = chisquare_required_n(math.sqrt(self.w2), self.n_bins, alpha, power) / self.support
        return n if n <= MAX_TOKENS else math.inf

    def power(self, n: float, alpha: float) -> float:
        if self.w2 <= 0:
            return alpha
        return chisquare_power(self.w2 * n * self.support, self.n_bins, alpha)


@dataclass(frozen=True)
class EvalueEffect:
    """Mixture e-value tests of candidate sums, per token: drift d, H0 variance σ², H1 variance τ²;
    judged at alpha / `bonferroni`, the best candidate counts; `one_sided`: only d > 0 is seen."""

    drift: list[float]
    h0_var: list[float]
    h1_var: list[float]
    bonferroni: int
    one_sided: bool = False

    def tokens_needed(self, alpha: float, power: float) -> float:
        if not self.drift:
            return math.inf
        needed = evalue_tokens(*self._candidates(), alpha / self.bonferroni, power, self.one_sided)
        return float(needed.min())

    def power(self, n: float, alpha: float) -> float:
        if not self.drift:
            return 0.0
        return float(evalue_power(n, *self._candidates(), alpha / self.bonferroni, self.one_sided).max())

    def _candidates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(drift, H0 variance, H1 variance) of every candidate, as arrays [C]."""
        return np.asarray(self.drift), np.asarray(self.h0_var), np.asarray(self.h1_var)


def evalue_power(
    n: ArrayLike, d: ArrayLike, h0_var: ArrayLike, h1_var: ArrayLike, alpha: float, one_sided: bool = False
) -> np.ndarray:
    """P(mixture e-value of S_n >= 1/alpha) with S_n ~ N(n·d, n·τ²), W_n = n·σ² (the far side
    of a two-sided test left out: it is never the one that rejects here), elementwise over the
    broadcast of `n`, `d`, `h0_var` (σ²) and `h1_var` (τ²); 0 where the test has no drift."""
    n, d, h0_var, h1_var = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (n, d, h0_var, h1_var)))
    shift = d if one_sided else np.abs(d)
    live = (shift > 0) & (h0_var > 0)
    threshold = evalue_thresholds(np.where(live, n * h0_var, 0.0), alpha, one_sided)
    sd = np.sqrt(n * np.maximum(h1_var, 1e-300))
    return np.where(live, special.ndtr((n * shift - threshold) / sd), 0.0)  # the normal survival function


def evalue_tokens(
    d: ArrayLike, h0_var: ArrayLike, h1_var: ArrayLike, alpha: float, power: float, one_sided: bool = False
) -> np.ndarray:
    """Smallest n (to 0.1%) with `evalue_power` >= power, elementwise over the candidates
    (`d`, `h0_var`, `h1_var` broadcast); inf beyond `MAX_TOKENS`. Every candidate's search runs
    at once: each step is one vectorised `evalue_power` call."""
    d, h0_var, h1_var = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (d, h0_var, h1_var)))
    shift = d if one_sided else np.abs(d)
    live = (shift > 0) & (h0_var > 0)

    def enough(n: np.ndarray) -> np.ndarray:
        return evalue_power(n, d, h0_var, h1_var, alpha, one_sided) >= power

    # start from the fixed-sample z test's n, which the mixture's threshold exceeds by a small
    # factor: a few doublings bracket the answer where doubling from 1 takes a dozen or more
    z = float(stats.norm.isf(alpha)) * np.sqrt(h0_var) + float(stats.norm.isf(1 - power)) * np.sqrt(h1_var)
    high = np.maximum(1.0, np.floor((np.maximum(z, 0.0) / np.where(live, shift, 1.0)) ** 2))
    short = live.copy()  # still doubling
    while (short := short & ~enough(high) & (high <= MAX_TOKENS)).any():
        high = np.where(short, high * 2, high)
    live &= high <= MAX_TOKENS
    halving = live.copy()
    while (halving := halving & (high > 1) & enough(high / 2)).any():
        high = np.where(halving, high / 2, high)
    low = high / 2
    while (wide := live & (high - low > np.maximum(1.0, 1e-3 * high))).any():
        mid = (low + high) / 2
        ok = enough(mid)
        low, high = np.where(wide & ~ok, mid, low), np.where(wide & ok, mid, high)
    return np.where(live, np.ceil(high), math.inf)


@dataclass(frozen=True)
class LikelihoodRatioEffect:
    """The Neyman–Pearson test of p' against p, per token: the log-LR's mean and variance under
    the bug and under H0; the sum of n is taken as Gaussian."""

    h1_mean: float
    h1_var: float
    h0_mean: float
    h0_var: float
    outside: float  # mean mass of p' outside p's support (caught by the support check)

    def tokens_needed(self, alpha: float, power: float) -> float:
        gap = self.h1_mean - self.h0_mean
        # a class whose p' equals p sums to zero up to round-off: a variance may come out at -1e-20
        h0_sd, h1_sd = math.sqrt(max(self.h0_var, 0.0)), math.sqrt(max(self.h1_var, 0.0))
        spread = float(stats.norm.isf(alpha)) * h0_sd + float(stats.norm.ppf(power)) * h1_sd
        gauss = (spread / gap) ** 2 if gap > 0 else math.inf
        support = math.log1p(-power) / math.log1p(-self.outside) if 0 < self.outside < 1 else math.inf
        n = min(gauss, support)
        return float(max(1, math.ceil(n))) if n <= MAX_TOKENS else math.inf

    def wald(self, alpha: float, power: float) -> WaldSize:
        """Wald's SPRT of p against this p' at `alpha` and `power` (`wald_size`)."""
        return wald_size(self.h1_mean, self.h0_mean, alpha, power, self.outside)

    def power(self, n: float, alpha: float) -> float:
        gap = self.h1_mean - self.h0_mean
        gauss = 0.0
        if gap > 0:
            z = (math.sqrt(n) * gap - float(stats.norm.isf(alpha)) * math.sqrt(max(self.h0_var, 0.0))) / math.sqrt(
                max(self.h1_var, 1e-300)
            )
            gauss = float(stats.norm.cdf(z))
        support = 1.0 - (1.0 - self.outside) ** n if self.outside > 0 else 0.0
        return max(gauss, support)


class WaldSize(NamedTuple):
    """Wald's SPRT's expected tokens: under the bug and under H0 (the certification case)."""

    under_bug: float
    under_h0: float


def wald_size(h1_drift: float, h0_drift: float, alpha: float, power: float, outside: float = 0.0) -> WaldSize:
    """The expected tokens of Wald's sequential probability ratio test of p against p' at error
    rates α and β = 1 - `power` — by Wald and Wolfowitz the fewest any test at those rates needs on
    average — from the per-token drift of ℓ = log(p'/p): `h1_drift` = KL(p'‖p) under the bug,
    `h0_drift` = -KL(p‖p') under H0. With A = (1 - β)/α and B = β/(1 - α), Wald's approximations
    (the boundaries' overshoot neglected):

        E_bug[N] = ((1 - β)·log A + β·log B) / KL(p'‖p)
        E_H0[N]  = ((1 - α)·log(1/B) - α·log A) / KL(p‖p')

    Mass `outside` p's support ends the test at its first token (expected 1/outside tokens under
    the bug): the smaller of the two is taken. The drifts come from the tokens both laws can emit
    (`bugsums.log_lr_moments`): a token only p can emit would end the test under H0 at once, so
    where p' has such tokens E_H0[N] is an upper estimate and a cell's ratio to it a lower one.
    math.inf where a drift is not positive."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise LosscheckError(f"wald_size needs 0 < alpha, power < 1, got {alpha}, {power}")
    beta = 1.0 - power
    log_a, log_b = math.log(power / alpha), math.log(beta / (1.0 - alpha))
    bug = (power * log_a + beta * log_b) / h1_drift if h1_drift > 0 else math.inf
    if outside > 0:
        bug = min(bug, 1.0 / outside)
    h0 = ((1.0 - alpha) * -log_b - alpha * log_a) / -h0_drift if h0_drift < 0 else math.inf
    return WaldSize(bug, h0)


def w2(masses: torch.Tensor, n_bins: int) -> float:
    """Cohen's w² of the average bin law `masses` [B] (normalised) against uniform."""
    total = float(masses.sum())
    if total <= 0:
        return 0.0
    return float(n_bins * ((masses / total - 1 / n_bins) ** 2).sum())
