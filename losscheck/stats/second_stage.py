"""A black-box engine cell's second stage: its test and its power, planned with its first.

A one-sample engine cell FAILs only when both stages reject (`losscheck.cells.engine.attribution`):
the first tests the engine's speculative rows against losscheck's reference, the second compares
fresh speculative rows with speculation-off rows, m a side, on row scores. The two draw
independent rows, so what a cell can claim against a class is P(S1)·P(S2); the first stage's
power alone overstates it (150 simulated cells at a stated 0.99 failed 0.973-0.980 of the time).
The cell splits β = 1 - power between them (`SECOND_STAGE_SHARE`), sizes the second from the
first's sums, and states the product.

The test (`sign_flip_test`): the two sides draw as many rows per prompt, so the i-th speculative
row and the i-th speculation-off row continue one prompt. Under H0 the two are independent and
identically distributed, so their difference D_i is symmetric given |D_i|, and Hoeffding's bound
on Rademacher signs gives P(Σ D_i >= t) <= exp(-t² / (2 Σ D_i²)): the level holds at any α for
any law of the scores, heavy-tailed or tied. (A U test's power is not a function of the scores'
moments: on a rare-slot bug's rows, whose log-LR is mostly zero, a U test sized by the t test's
efficiency caught 19 of 50 at a stated 0.9.)

The model, per class and row score R = Σ_t s_t over a row's tested tokens: under H0 (speculation
off, or a lossless engine) R has mean μ0 and variance v0 per row, under the class μ1 and v1, so
D has mean Δ = μ1 - μ0, variance v = v0 + v1 and E D² = v + Δ². With c = sqrt(2 log(1/α)) (α / 2
for a two-sided score) and m pairs, Σ D² ≈ m·E D² and

    P(S2) = Φ((m·Δ - c·sqrt(m·E D²)) / sqrt(m·v)).

A row's variance splits into the positions' conditional variances and the spread of their
conditional means over rows, Var R = E Σ_t Var_t(s_t) + Var(Σ_t E_t s_t); both constructors below
bound the second part from above (above one half, where claims are made, a larger v lowers the
stated power). Like the
first stage's models, they evaluate the class's law along the rows drawn (the bug changes the
tokens' law, not which prefixes the rows visit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit, check_positive

# the part of a cell's β = 1 - power left to the second stage; the rest is the first stage's
SECOND_STAGE_SHARE = 0.1


def stage_one_power(power: float) -> float:
    """The power the first stage is designed for so that, with the second at `stage_two_power`,
    the cell keeps `power`: (1 - β1)(1 - β2) >= 1 - β1 - β2 = `power`."""
    check_open_unit("power", power)
    return 1.0 - (1.0 - power) * (1.0 - SECOND_STAGE_SHARE)


def stage_two_power(power: float) -> float:
    """The power the second stage is sized for."""
    check_open_unit("power", power)
    return 1.0 - (1.0 - power) * SECOND_STAGE_SHARE


@dataclass(frozen=True)
class RowShift:
    """One row score's law under H0 and under a class, per row: the shift of its mean
    (μ1 - μ0, oriented so that a one-sided test looks above), its variance under each, and
    whether its test is two-sided."""

    shift: float
    var_h0: float
    var_bug: float
    two_sided: bool = False

    def power(self, rows: int, alpha: float) -> float:
        """P(S2) of `sign_flip_test` with `rows` pairs at level `alpha` (0 when the shift is not positive)."""
        threshold = _threshold(alpha, self.two_sided)
        spread = self.var_h0 + self.var_bug
        if rows <= 0 or self.shift <= 0 or not math.isfinite(self.shift) or not math.isfinite(spread):
            return 0.0
        spread = max(spread, 1e-300)
        z = (rows * self.shift - threshold * math.sqrt(rows * (spread + self.shift**2))) / math.sqrt(rows * spread)
        return float(stats.norm.cdf(z))

    def rows_needed(self, alpha: float, level: float) -> float:
        """The fewest pairs at which `power` reaches `level` (inf when it never does)."""
        check_open_unit("level", level)
        threshold = _threshold(alpha, self.two_sided)
        spread = self.var_h0 + self.var_bug
        if self.shift <= 0 or not math.isfinite(self.shift) or not math.isfinite(spread):
            return math.inf
        root = threshold * math.sqrt(spread + self.shift**2) + float(stats.norm.ppf(level)) * math.sqrt(spread)
        return float(max(1, math.ceil((root / self.shift) ** 2)))


@dataclass(frozen=True)
class SupportShift:
    """The `support` score's law under a class that puts mass outside p's support (a token the
    reference cannot emit): per token the rate of such tokens under the class (its lower bound)
    and a row's tested tokens; speculation-off rows of a lossless engine hold none. The score's
    pairs differ then only where a speculative row holds one, D_i >= 1, and `sign_flip_test`
    rejects once about c² rows do (exactly, where each holds one): P(S2) = P(Binomial(m, π) >= c²),
    π = 1 - (1 - rate)^n the chance a row holds one (two-sided, as `attribution` tests `support`)."""

    rate: float
    per_row: float

    def power(self, rows: int, alpha: float) -> float:
        """P(S2) with `rows` pairs at level `alpha`."""
        events = math.ceil(_threshold(alpha, True) ** 2)
        hit = -math.expm1(self.per_row * math.log1p(-min(max(self.rate, 0.0), 1.0))) if self.rate < 1 else 1.0
        if rows <= 0 or hit <= 0:
            return 0.0
        return float(stats.binom.sf(events - 1, rows, hit))

    def rows_needed(self, alpha: float, level: float) -> float:
        """The fewest pairs at which `power` reaches `level` (inf when no row can hold one)."""
        check_open_unit("level", level)
        if self.power(10**9, alpha) < level:
            return math.inf
        low, high = 0, 1
        while self.power(high, alpha) < level:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.power(mid, alpha) < level else (low, mid)
        return float(high)


def detectable_shift(rows: int, alpha: float, power: float, two_sided: bool = False) -> float:
    """The mean difference, in standard deviations of a pair's difference, that `sign_flip_test`
    with `rows` pairs catches at `power` (the root of `RowShift.power` at v = 1; inf when c² >= rows):
    from sqrt(m)·d - z = c·sqrt(1 + d²), (m - c²)·d² - 2·z·sqrt(m)·d + z² - c² = 0."""
    c, z = _threshold(alpha, two_sided), float(stats.norm.ppf(power))
    m = float(rows)
    if m <= c * c:
        return math.inf
    root = z * z * m - (m - c * c) * (z * z - c * c)
    return (z * math.sqrt(m) + math.sqrt(max(root, 0.0))) / (m - c * c)


def _threshold(alpha: float, two_sided: bool) -> float:
    """c: `sign_flip_test` rejects where Σ D >= c·sqrt(Σ D²) (|Σ D| for a two-sided score)."""
    check_open_unit("alpha", alpha)
    return math.sqrt(2 * math.log((2 if two_sided else 1) / alpha))


def sign_flip_test(on: torch.Tensor, off: torch.Tensor, two_sided: bool = False) -> tuple[float, float]:
    """Paired rows' scores `on`, `off` [m] (pair i: one prompt's i-th row of each side): the
    statistic Σ D / sqrt(Σ D²), D = on - off, and its p-value by Hoeffding's bound on the signs,
    exp(-statistic² / 2) on the tested side (doubled for a two-sided score), 1 on the other.
    An infinite score counts as ±`CLIP` (a fixed function of the rows: the level holds)."""
    if on.shape != off.shape or on.dim() != 1:
        raise LosscheckError(
            f"sign_flip_test: paired scores need two [m] tensors of one shape, got {tuple(on.shape)} and "
            f"{tuple(off.shape)}: draw as many rows a side for each prompt, in one order"
        )
    d = (_clip(on) - _clip(off)).double()
    square = float((d * d).sum())
    if square == 0.0:
        return 0.0, 1.0
    statistic = float(d.sum()) / math.sqrt(square)
    tail = math.exp(-statistic * statistic / 2)
    if two_sided:
        return statistic, min(1.0, 2 * tail)
    return statistic, tail if statistic > 0 else 1.0


# an infinite row score (a log-LR at a token one law cannot emit) counts as ±CLIP, so that one row
# does not take the whole of Σ D² (the `support` score is the test of such tokens)
CLIP = 30.0


def _clip(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x.double(), nan=0.0, posinf=CLIP, neginf=-CLIP)


def clustered_shift(
    tokens: float,
    rows: float,
    bug_mean: float,
    bug_second: float,
    bug_row_spread: float,
    h0_mean: float,
    h0_second: float,
    h0_row_spread: float,
) -> RowShift:
    """A one-sided row score's law from per-token sums over `tokens` positions in `rows` rows
    (the round filter's log-LR, `RoundsPower.row_shift`): under each law the mean and second
    moment of the increment per token and the spread over rows of a row's summed conditional
    mean, Var_r(Σ_t E_t s_t). A row's variance is taken as its summed second moments plus that
    spread, an upper bound (the conditional means' squares are not taken off)."""
    check_positive("rows", rows)
    per_row = tokens / rows
    return RowShift(
        shift=per_row * (bug_mean - h0_mean),
        var_h0=per_row * h0_second + h0_row_spread,
        var_bug=per_row * bug_second + bug_row_spread,
    )


def token_shift(per_row: float, bug_drift: float, bug_var: float, bug_mean_sq: float, h0_var: float) -> RowShift:
    """A two-sided row score centred under H0 (E_p s_t = 0 at every position, so no spread over
    rows there) from per-token means over the tested positions: under the class the increment's
    mean `bug_drift`, conditional variance `bug_var` and squared conditional mean `bug_mean_sq`;
    under H0 its variance `h0_var`. Rows of `per_row` tokens; the spread of a row's summed
    conditional means under the class is bounded by Cauchy–Schwarz, (Σ_t μ_t)² <= n·Σ_t μ_t²."""
    check_positive("per_row", per_row)
    return RowShift(
        shift=per_row * abs(bug_drift),
        var_h0=per_row * h0_var,
        var_bug=per_row * bug_var + per_row * per_row * bug_mean_sq,
        two_sided=True,
    )
