"""Exact tail probabilities of Pearson's X² and the G statistic under a multinomial H0.

Terms. n values fall in K bins; under H0 bin i has probability p_i, count O_i and expected count
E_i = n·p_i. Both statistics are sums of per-bin *contributions* x_i(O_i) >= 0: Pearson
(O - E)²/E, G 2·(O·ln(O/E) - O + E) (the usual 2·Σ O·ln(O/E), as Σ O = Σ E). A *score* is an
integer g_i(o) >= 0 standing for x_i(o); the *tail* of a threshold t is P(Σ_i g_i(O_i) >= t).

Method. Independent O_i ~ Poisson(E_i) conditioned on T = Σ O_i = n are multinomial(n, p), so
P(S >= t) = P_pois(S >= t, T = n) / P_pois(T = n). The numerator is a dynamic programme over the
bins whose state is (values so far m, score so far s) with s < t, plus one absorbing state per m
for "already >= t" (scores only grow). It meets in the middle: each half of the bins gets its
table and the tail is Σ_{m,s} f_A[m, s]·P_B(n - m values, score >= t - s), which halves the
passes (with equal bins one table serves both halves). Every term is a positive product of
Poisson weights, summed, never taken as 1 - cdf, so a p-value of 1e-12 is as accurate as one of
0.5 (relative error ~1e-13).

Exact or an upper bound. Pearson on equal bins is exact: with c = round(n/K),
X² = (K/n)·(U - K·(c - n/K)²) where U = Σ (O_i - c)² is an integer (`equal_bins_tail`).
Otherwise (unequal bins, the G statistic) the contributions are rounded onto a grid of 100·K steps
up to the observed statistic and t lowered by K/2 steps, so the p-value is an upper bound: the
exact tail of a statistic at most 0.5% below the observed. Beyond the statistic whose χ² tail is
1e-12 the tail at that statistic is reported, an upper bound far below any level a test is judged
at. Two more steps only ever add to the tail: a count whose Poisson weight is below
`_NEGLIGIBLE`, and a value of m whose live states weigh less than it, go straight to the
absorbing state (together < 1e-23 on any p-value).

When the χ² law is used instead (`exact_law_applies`). The DP's cost, in cell updates over the
worst counts (`dp_cost`), is known before it runs; it runs when that is at most `DP_BUDGET`,
4·10^7, measured at 16-37 ms a call on one core over the worst counts at the cut. That admits
Pearson on equal bins up to n = 179 values in 10 bins (E = 18), 164 in 25, 173 in 5, 159 in 50; G
on 10 equal bins up to 126; 10 unequal bins (E from n/20 to 3n/20) up to 70. The exact law is
right at every α, so α does not enter the rule. Beyond the cut the χ² law is used: the false-alarm
rate of the test that rejects at X² >= χ²_{K-1}(1 - α), computed exactly here
(`false_alarm_rate`), in units of α, for K equal bins of E expected values each:

    K    E      α = 1e-3   1e-5   3.2e-6   1e-7
    10   5      1.22       2.51   3.17     8.19
    10   10     1.10       1.82   2.11     4.26
    10   20     1.07       1.40   1.57     2.42
    10   30     1.03       1.26   1.39     1.89
    10   50     1.03       1.16   1.22     1.50
    10   100    1.01       1.08   1.11     1.25
    25   5      1.30       2.46   2.84     6.59
    25   20     1.07       1.31   1.38     1.86
    25   50     1.02       1.12   1.15     1.30
    5    20     1.02       1.28   1.38     2.07
    5    100    1.00       1.06   1.09     1.25

The excess falls as 1/E, to about 25/E at α = 1e-7 and 11/E at 3.2e-6, so no E that the budget
reaches makes the χ² law exact at the levels losscheck tests at: the DP takes every sample it can
afford. Unequal bins fare like equal ones of their smallest E (one bin of E = 5 among nine of 10:
2.5-2.9 at 3.2e-6, 5.8-6.9 at 1e-7, bracketed by the grid), and the G-test's χ² law understates
its rate 1.3-2x at E = 5-10 at every α from 1e-3 to 1e-7.

So Pearson's test past the cut is judged at a lowered level (`asymptotic_level`): the excess r - 1
of the χ² law at level a is computed exactly at the largest affordable n of the same K (or at
the test's own smallest E where that is smaller), taken down as 1/E to the test's E, and the level
a solves a·r(a) = α. Computed exactly past the cut (`false_alarm_rate`), the rate of the test at
that level, in units of α, for the table's K, E and α from 1e-3 to 1e-7 (E from 20 to 300): 0.79
to 1.01, against 1.00 to 2.42 at α itself. The G statistic keeps the χ² law past the cut.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from scipy import special, stats

Statistic = Literal["pearson", "log-likelihood"]

# A Poisson weight, or the live mass at one value of m, below this goes to the absorbing state: a
# few thousand such moves add < 1e-23 to a p-value and spare the DP the counts nothing reaches.
_NEGLIGIBLE = 1e-30
# The DP resolves a statistic up to the one whose χ² tail is this: beyond, the p-value is far
# below any level a test is judged at, and the tail at that point bounds it (tails only shrink).
_FINE_TAIL = 1e-12
# Grid steps per bin for a statistic that is not an integer: rounding lowers it by <= K/2 steps,
# K/(2·100·K) = 0.5%.
_COLUMNS_PER_BIN = 100
# Cell updates the DP may make at most, over all counts of a given n and expected [K] (`dp_cost`):
# 16-37 ms a call on one core at the cut.
DP_BUDGET = 4e7


@dataclass(frozen=True)
class Tail:
    """P(statistic >= observed) under H0, and whether it is exact or an upper bound."""

    p_value: float
    log10_p: float
    exact: bool


def _contributions(expected: np.ndarray, n: int, statistic: Statistic) -> np.ndarray:
    """x_i(o) for o = 0..n: each bin's term of the statistic, >= 0.

    expected [K] expected counts, summing to n; returns [K, n + 1] float64.
    """
    o = np.arange(n + 1, dtype=np.float64)[None, :]  # [1, n+1]
    e = expected[:, None]  # [K, 1]
    if statistic == "pearson":
        return (o - e) ** 2 / e
    return 2 * (special.xlogy(o, o / e) - o + e)


def _start(w: np.ndarray, g: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The table of one bin: live [n+1, t] mass by (m, score), absorbed [n+1] mass with score >= t.
    w [n+1] Poisson weights, g [n+1] scores (>= t: absorbing)."""
    live = np.zeros((len(w), t))
    keep = g < t  # [n+1]
    live[np.flatnonzero(keep), g[keep]] = w[keep]
    return live, np.where(keep, 0.0, w)


def _suffix(live: np.ndarray) -> np.ndarray:
    """above [n+1, t+1]: above[m, s] = Σ_{s' >= s} live[m, s']; column t is 0."""
    above = np.zeros((live.shape[0], live.shape[1] + 1))
    above[:, :-1] = np.cumsum(live[:, ::-1], axis=1)[:, ::-1]
    return above


def _add_bin(live: np.ndarray, absorbed: np.ndarray, w: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The table after one more bin of Poisson weights w [n+1] and scores g [n+1]."""
    size, t = live.shape  # n+1, threshold
    above = _suffix(live)  # [n+1, t+1]
    jumps = g >= t  # counts that end in the absorbing state from anywhere
    new_absorbed = np.convolve(absorbed, w)[:size] + np.convolve(above[:, 0], np.where(jumps, w, 0.0))[:size]
    new_live = np.zeros_like(live)
    rows = np.flatnonzero(above[:, 0])
    if len(rows) == 0:
        return new_live, new_absorbed
    lo, hi = int(rows[0]), int(rows[-1])
    for o in np.flatnonzero(~jumps):
        top = min(hi, size - 1 - o)  # values beyond n can never come back to T = n
        if top < lo:
            break
        go = int(g[o])
        new_live[lo + o : top + o + 1, go:] += w[o] * live[lo : top + 1, : t - go]
        new_absorbed[lo + o : top + o + 1] += w[o] * above[lo : top + 1, t - go]
    return _prune(new_live, new_absorbed)


def _prune(live: np.ndarray, absorbed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values of m whose live mass is negligible moved to the absorbing state (a conservative
    step: it can only add to the tail)."""
    mass = live.sum(axis=1)  # [n+1]
    light = (mass > 0) & (mass < _NEGLIGIBLE)
    absorbed[light] += mass[light]
    live[light] = 0.0
    return live, absorbed


def _table(w: np.ndarray, g: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """The table of the bins with weights w [J, n+1] and scores g [J, n+1], J >= 1."""
    live, absorbed = _start(w[0], g[0], t)
    for wj, gj in zip(w[1:], g[1:]):
        live, absorbed = _add_bin(live, absorbed, wj, gj)
    return live, absorbed


def _meet(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], n: int) -> float:
    """P(T = n, score >= t) from the tables of two halves of the bins."""
    live_a, absorbed_a = a
    live_b, absorbed_b = b
    t = live_a.shape[1]
    tail_b = _suffix(live_b) + absorbed_b[:, None]  # [n+1, t+1] mass with score >= s, by m
    rest = tail_b[n::-1]  # [n+1, t+1] row m: half B holds the other n - m values
    need = t - np.arange(t)  # [t] half B must reach t - s when half A is at s
    return float(absorbed_a @ rest[:, 0] + np.sum(live_a * rest[:, need]))


def _joint_tail(w: np.ndarray, g: np.ndarray, t: int, identical: bool) -> float:
    """P_pois(Σ_i g_i(O_i) >= t, T = n) for independent O_i with weights w [K, n+1], scores
    g [K, n+1]; `identical`: all bins alike, so the first half's table serves the second."""
    n, k = w.shape[1] - 1, w.shape[0]
    g = np.where(w < _NEGLIGIBLE, t, np.minimum(g, t))  # negligible counts: absorbed
    a = _table(w[: k // 2], g[: k // 2], t)
    if not identical:
        return _meet(a, _table(w[k // 2 :], g[k // 2 :], t), n)
    return _meet(a, a if k % 2 == 0 else _add_bin(*a, w[-1], g[-1]), n)


def _poisson_weights(expected: np.ndarray, n: int) -> np.ndarray:
    """w [K, n+1]: P(Poisson(E_i) = o) for o = 0..n."""
    return stats.poisson.pmf(np.arange(n + 1)[None, :], expected[:, None])


def _conditioned(joint: float, n: int) -> float:
    """P(event | T = n) from P_pois(event, T = n); T ~ Poisson(n) as Σ E_i = n."""
    return min(1.0, joint / float(stats.poisson.pmf(n, n)))


def equal_bins_tail(n: int, k: int, u: int) -> float:
    """Exact P(U >= u), U = Σ_i (O_i - c)², c = round(n/k), for n values in k equiprobable bins.

    The DP runs on H = Σ_i C(O_i - c, 2) = (U - (n - k·c)) / 2, an integer of half U's range:
    d² = 2·C(d, 2) + d and the d = O_i - c add up to n - k·c."""
    h = math.ceil((u - (n - k * round(n / k))) / 2)  # U >= u  <=>  H >= h
    if h <= 0:
        return 1.0
    d = np.arange(n + 1) - round(n / k)  # [n+1]
    g = np.tile(d * (d - 1) // 2, (k, 1))  # [K, n+1]
    return _conditioned(_joint_tail(_poisson_weights(np.full(k, n / k), n), g, h, identical=True), n)


def _grid_tail(x: np.ndarray, expected: np.ndarray, observed: float, identical: bool) -> float:
    """An upper bound on P(Σ_i x_i(O_i) >= observed) from the contributions x [K, n+1] rounded
    onto a grid of `_COLUMNS_PER_BIN`·K steps up to `observed`; expected [K] sums to n."""
    n, k = x.shape[1] - 1, x.shape[0]
    columns = _COLUMNS_PER_BIN * k
    # rounding moves each bin's score by <= 1/2, so Σ round(x/grid) >= observed/grid - K/2
    # whenever X >= observed; the relative margin absorbs float rounding in the observed sum
    t = math.ceil(columns * (1 - 1e-12) - k / 2) if observed > 0 else 0
    if t <= 0:
        return 1.0
    g = np.floor(x * (columns / observed) + 0.5).astype(np.int64)  # [K, n+1]
    return _conditioned(_joint_tail(_poisson_weights(expected, n), g, t, identical), n)


def multinomial_tail(counts: ArrayLike, expected: ArrayLike, statistic: Statistic = "pearson") -> Tail:
    """P(statistic >= its observed value) for integer `counts` [K] under multinomial(n, expected / n),
    `expected` [K] > 0 with Σ expected = n = Σ counts up to rounding.

    Exact for Pearson on equal bins, else an upper bound (`_grid_tail`); beyond the statistic whose
    χ² tail is `_FINE_TAIL`, the tail at that statistic, an upper bound too."""
    obs = np.asarray(counts, dtype=np.int64)  # [K]
    exp = np.asarray(expected, dtype=np.float64)  # [K]
    n, k = int(obs.sum()), len(obs)
    exp = exp * (n / exp.sum())  # exactly n in total, whatever the caller's rounding
    identical = bool(np.allclose(exp, exp[0], rtol=1e-12, atol=0.0))
    if statistic == "pearson" and identical:
        u = int(((obs - round(n / k)) ** 2).sum())
        fine = _fine_u(n, k)
        return _tail(equal_bins_tail(n, k, min(u, fine)), exact=u <= fine)
    x = _contributions(exp, n, statistic)  # [K, n+1]
    observed = min(float(x[np.arange(k), obs].sum()), _fine_limit(k))
    return _tail(_grid_tail(x, exp, observed, identical), exact=False)


def _fine_limit(k: int) -> float:
    """The statistic (χ² units) up to which the DP resolves."""
    return float(stats.chi2.isf(_FINE_TAIL, k - 1))


def _fine_u(n: int, k: int) -> int:
    """`_fine_limit` as U = Σ (O_i - c)² of equal bins: X² = (U - k·(c - e)²) / e, e = n/k."""
    e = n / k
    return math.ceil(_fine_limit(k) * e + k * (round(e) - e) ** 2)


def _tail(p: float, exact: bool) -> Tail:
    # below the smallest double the tail underflows; 10^-300 still bounds it
    return Tail(p, math.log10(p) if p > 0 else -300.0, exact)


def dp_cost(expected: ArrayLike, statistic: Statistic = "pearson") -> float:
    """Cell updates `multinomial_tail` makes at most, over all counts, for expected counts [K]:
    (n + 1) values so far × columns × (passes × live counts per pass + 25 to meet, whose
    gathers and cumulative sums cost about 25 shifted adds)."""
    exp = np.asarray(expected, dtype=np.float64)  # [K]
    n, k = round(float(exp.sum())), len(exp)
    identical = bool(np.allclose(exp, exp[0], rtol=1e-12, atol=0.0))
    passes = k // 2 - 1 + k % 2 if identical else k - 2
    equal_pearson = statistic == "pearson" and identical
    u = _fine_u(n, k)
    columns = u / 2 if equal_pearson else _COLUMNS_PER_BIN * k  # H < U/2
    cells = (n + 1) * columns
    if passes == 0 or cells * (passes + 25) > DP_BUDGET:  # over budget whatever a pass costs
        return cells * (passes + 25)
    # counts of non-negligible weight in the widest bin, the one of largest E; with equal bins
    # only |o - c| <= sqrt(U) stay live
    reach = float((_poisson_weights(exp.max(keepdims=True), n) >= _NEGLIGIBLE).sum())
    live = min(reach, 2 * math.isqrt(u) + 2) if equal_pearson else reach
    return cells * (passes * live + 25)


def exact_law_applies(counts: np.ndarray, expected: np.ndarray, statistic: Statistic = "pearson") -> bool:
    """Whether `multinomial_tail` gives the p-value of `counts` [K] against `expected` [K]: two or
    more bins, whole counts, some values, positive expectations and a worst case within
    `DP_BUDGET`."""
    return (
        len(counts) >= 2
        and bool(np.all(counts == np.round(counts)))
        and counts.sum() > 0
        and bool(np.all(expected > 0))
        and dp_cost(expected, statistic) <= DP_BUDGET
    )


def false_alarm_rate(n: int, k: int, alpha: float, law: Literal["asymptotic", "exact"]) -> float:
    """P(p <= alpha) under H0, computed exactly, for Pearson's test of n values in k equiprobable
    bins whose p-value comes from `law`: the χ²_{k-1} tail or `equal_bins_tail`."""
    c, e = round(n / k), n / k

    def asymptotic_p(u: int) -> float:  # X² = (k/n)·Σ (O - e)² = (U - k·(c - e)²) / e
        return float(stats.chi2.sf((u - k * (c - e) ** 2) / e, k - 1))

    def exact_p(u: int) -> float:  # as `multinomial_tail` reports it
        return equal_bins_tail(n, k, min(u, _fine_u(n, k)))

    p_of = asymptotic_p if law == "asymptotic" else exact_p
    lo, hi = 0, (n - c) ** 2 + (k - 1) * c**2  # p(hi) <= alpha unless no outcome rejects
    if p_of(hi) > alpha:
        return 0.0
    while hi - lo > 1:  # smallest u with p(u) <= alpha: p falls as u grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if p_of(mid) <= alpha else (mid, hi)
    return equal_bins_tail(n, k, hi)


# `asymptotic_level` reads the χ² law's excess at levels on this grid of log α (1% steps), so that
# the tests of a run, whose levels repeat, share a handful of exact computations.
_LEVEL_GRID_STEPS = 100


def asymptotic_level(k: int, smallest_expected: float, alpha: float) -> float:
    """The level a <= `alpha` at which Pearson's test of k bins past the exact law's cut, its
    p-value from the χ²_{k-1} law, rejects at most about `alpha` of the time under H0 (module
    docstring): a = α / r, r = 1 + (r_ref(a) - 1)·min(1, E_ref / E), r_ref the exact ratio of
    false alarms to level on k equal bins of E_ref expected values each, E the smallest bin's."""
    n_ref = min(_affordable_n(k), max(2 * k, math.floor(k * smallest_expected)))
    shrink = min(1.0, n_ref / k / smallest_expected)
    level = alpha
    for _ in range(4):  # the excess grows as the level falls: a few steps of a = α / r(a) settle it
        grid = math.exp(round(math.log(level) * _LEVEL_GRID_STEPS) / _LEVEL_GRID_STEPS)
        level = alpha / (1.0 + (_excess_ratio(n_ref, k, grid) - 1.0) * shrink)
    return level


@functools.lru_cache(maxsize=1024)
def _excess_ratio(n: int, k: int, level: float) -> float:
    """max(1, P(χ²-law p <= level) / level), exact, for n values in k equal bins."""
    return max(1.0, false_alarm_rate(n, k, level, "asymptotic") / level)


@functools.lru_cache(maxsize=64)
def _affordable_n(k: int) -> int:
    """The largest n whose k equal bins' exact law is within `DP_BUDGET` (179 for 10 bins)."""
    low, high = k, 1000 * k
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if dp_cost(np.full(k, mid / k)) <= DP_BUDGET else (low, mid)
    return low
