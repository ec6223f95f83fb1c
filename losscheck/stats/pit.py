"""Teacher-forced PIT mode: uniformity tests of randomized probability integral transforms.

At each generated position the target's distribution p (after the request's logits processing)
is known from one teacher-forced pass. Order the vocabulary by descending p, ties by token id;
F(x⁻) is the mass of the tokens ranked before x. With v ~ U(0,1) independent of everything,

    u = F(x⁻) + v·p(x)

is exactly U(0,1) when x ~ p, and, conditioning position by position (Rosenblatt), the u's of
one sequence are iid U(0,1) under H0. A distortion of total variation δ at one prefix moves the
law of u by exactly δ in total variation (u has density q(x)/p(x) on the interval of x), so
uniformity tests of u are tests of the token distribution.

Masking positions after EOS keeps the tests valid as long as the mask is predictable — whether
position l counts depends only on tokens before l. The per-position counts are then exactly
multinomial given the past, and the pooled counts are martingale sums whose covariance is the
multinomial one (Wald), so the pooled χ² and KS tests keep their asymptotic level.

Two stratifications keep that property. By *slot*: the slot of token l in the round that emitted
it (0 = the round's first token) is fixed before x_l is drawn (by where the round started and by
the acceptance of the drafts before slot l), and speculative sampling emits p's token at every
slot given all that — so u is uniform within each slot. Never stratify by whether the token was
an accepted draft: that depends on x_l itself. By *pairs*: (u_{2m}, u_{2m+1}) of one sequence are
independent uniforms under H0, so a pair's law is uniform on the unit square; randomness reused
from one step to the next (the same uniform deciding consecutive rounds) leaves each u uniform but
makes the pair dependent. A pair cut by EOS is completed with an independent uniform, so whether a
pair counts depends only on tokens before it.

What the tests guarantee: they detect a distortion of the *PIT law pooled over positions* (binned
TV for χ², Kolmogorov distance for KS), not the per-prefix TV of a bug — distortions of opposite
sign at different prefixes cancel in the pooled law (the stress cells exist for that). The power
formulas treat the N·L values as independent, which they are under H0; under a bug the tokens of a
sequence are dependent, and in the worst case a sequence counts as one observation, not L.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.stats import powermodels
from losscheck.stats._checks import check_open_unit, check_tv, normalized_rows
from losscheck.stats.budget import per_test_alpha
from losscheck.stats.gof import chi2_log10_sf, describe_worst_bin, goodness_of_fit, support_check
from losscheck.stats.power import (
    chisquare_detectable_w,
    chisquare_required_n,
    dkwm_detectable,
    dkwm_required_n,
    require_power,
)
from losscheck.stats.registry import (
    PIT,
    ROW_STREAMS,
    SLOTS,
    Scope,
    StatTest,
    budget_count,
    deprecated_count,
    register,
    run_family,
)
from losscheck.stats.result import TestResult
from losscheck.stats.streams import StreamValues, greedy_fallback, repeats, serial, stop_hazard

PAIR_BINS = 5  # per axis of the pair test's grid: 25 cells


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Randomized PIT u = F(x⁻) + v·p(x) of every generated token, computed in float64.

    probs  [N, L, V]  target distribution at each generated position (teacher-forced)
    tokens [N, L]     generated token ids; pad positions after EOS with any valid id
    v      [N, L]     independent U(0,1) draws from the run's generator
    returns u [N, L]  float64 in [0, 1]; NaN where the token has probability 0 under the target
                      (impossible under H0: `pit_tests` fails such samples through its support
                      check).

    Rows are independent, so a caller short of memory may call this per batch of rows: it builds
    a few [N, L, V] temporaries.
    """
    if probs.dim() != 3 or tokens.shape != probs.shape[:2] or v.shape != tokens.shape:
        raise LosscheckError(
            f"randomized_pit needs probs [N, L, V], tokens [N, L], v [N, L]; got "
            f"{tuple(probs.shape)}, {tuple(tokens.shape)}, {tuple(v.shape)}"
        )
    vocab = probs.shape[-1]
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise LosscheckError(f"token ids must lie in [0, {vocab}), got range [{tokens.min()}, {tokens.max()}]")
    p = normalized_rows(probs, "randomized_pit probs")  # [N, L, V]
    x = tokens.long().unsqueeze(-1)  # [N, L, 1]
    p_x = p.gather(-1, x)  # [N, L, 1]
    ids = torch.arange(vocab, device=p.device)  # [V]
    ranked_before = (p > p_x) | ((p == p_x) & (ids < x))  # [N, L, V]
    f_before = torch.where(ranked_before, p, 0.0).sum(-1)  # [N, L]
    p_x = p_x.squeeze(-1)  # [N, L]
    u = (f_before + v.to(torch.float64) * p_x).clamp(0.0, 1.0)  # [N, L]
    return u.masked_fill(p_x == 0, math.nan)


def pit_tests(
    u: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    power: float,
    target_tv: float | None,
    n_bins: int = 10,
    min_expected: float = 5.0,
    slots: torch.Tensor | None = None,
    spare: torch.Tensor | None = None,
    streams: StreamValues | None = None,
) -> list[TestResult]:
    """Uniformity tests of the randomized PITs `u` [N, L] at the positions where `mask` [N, L]
    (bool, predictable: e.g. "not after EOS") is true, under the budget `alpha`.

    slots [N, L] long: each token's slot in its round (speculative runs; None: no slot test).
    spare [N, L] float: independent U(0,1) draws completing pairs cut by the mask (None: pairs
        need both positions, which is exact only when the mask is fixed in advance).
    streams: what the rows say about their random streams (`losscheck.stats.streams`; None: the
        stream tests are not run and take no share of `alpha`).

    Returns, in order:
      pit.support           NaN u's (tokens of probability 0), alpha 0;
      pit.pooled_chisquare  Pearson χ² of all u's on `n_bins` equal bins of [0, 1];
      pit.pooled_ks         KS of all u's against U(0,1), DKWM detectable Kolmogorov distance;
      pit.position_chisquare  χ² of the position × bin table, uniform within each position
                            (df = positions × (n_bins - 1)); positions with fewer than
                            `min_expected` expected per bin are left out (decided by their
                            count, which depends only on earlier tokens);
      pit.slot_chisquare    the same over the slot × bin table (slot of the token in its round;
                            without `slots` it is not run and takes no share of `alpha`);
      pit.pair_chisquare    χ² of the pairs (u_{2m}, u_{2m+1}) on a `PAIR_BINS`² grid of the unit
                            square: serial dependence;
      pit.greedy_fallback   the count of tokens at their top token (an argmax at T > 0), one-sided;
      pit.row_repeats       the count of rows repeating an earlier output of their prompt (a
                            shared random stream), one-sided;
      pit.row_serial        the correlation of consecutive rows' first-token PITs;
      pit.stop_hazard       the count of rows' ends against the target's hazard (the stopping
                            times' law), two-sided.
    The tests run split `alpha` by Bonferroni. With a `target_tv`, the pooled tests first raise
    `UnderpoweredError` when they cannot detect binned TV (χ²) or Kolmogorov distance (KS)
    `target_tv` at `power` (`pit_required_values` says how many values suffice) — unless a token
    of probability 0 was seen, which fails `pit.support` at any size (then, with no other value,
    it is the only result); without one
    (a cell sized by its bug classes' power, `losscheck.stats.bugclass`) they report what they
    detect, as the stratified tests always do.
    """
    u = torch.as_tensor(u, dtype=torch.float64)  # [N, L]
    mask = torch.as_tensor(mask, dtype=torch.bool)  # [N, L]
    if u.dim() != 2 or mask.shape != u.shape:
        raise LosscheckError(f"pit_tests needs u [N, L] and mask [N, L]; got {tuple(u.shape)}, {tuple(mask.shape)}")
    check_open_unit("power", power)
    if target_tv is not None:
        check_tv("target TV", target_tv)
    # no slots: no slot test, no share; no stream values: no stream tests
    missing = frozenset({SLOTS} if slots is None else ()) | frozenset({ROW_STREAMS} if streams is None else ())
    a = per_test_alpha(alpha, budget_count(PIT, missing=missing))

    impossible = mask & torch.isnan(u)  # [N, L]
    valid = mask & ~impossible  # [N, L]
    values = u[valid]  # [n], row-major like valid.nonzero()
    n = len(values)
    if n == 0 and impossible.any():  # a token the target gives probability 0: a failure at any size
        return [_support(int(impossible.sum()), int(mask.sum()), power)]
    if n == 0:
        raise UnderpoweredError(
            "pit_tests: no PIT value to test (the mask selects no position of positive probability)"
        )
    if ((values < 0) | (values > 1)).any():
        raise LosscheckError(
            "pit_tests: PIT values under the mask must lie in [0, 1] (or be NaN for impossible tokens)"
        )
    if target_tv is not None and not impossible.any():  # an impossible token fails whatever the power
        required = pit_required_values(alpha, power, target_tv, n_bins, missing)
        _require_pooled_power(n, n_bins, a, power, target_tv, required)

    bins = (values * n_bins).long().clamp(max=n_bins - 1)  # [n]
    position = valid.nonzero()[:, 1]  # [n]
    cell = position * n_bins + bins  # [n]
    counts = torch.bincount(cell, minlength=u.shape[1] * n_bins).view(-1, n_bins).numpy()  # [L, B]
    slot_counts = None
    if slots is not None:
        slot_of = torch.as_tensor(slots, dtype=torch.long)[valid]  # [n]
        width = int(slot_of.max()) + 1
        slot_counts = torch.bincount(slot_of * n_bins + bins, minlength=width * n_bins).view(-1, n_bins).numpy()
    pit = PitValues(u, mask, valid, values, counts, slot_counts, spare, int(impossible.sum()), min_expected, streams)
    return run_family(PIT, pit, alpha, power, missing=missing)


@dataclass(frozen=True)
class PitValues:
    """What the `pit` family's tests read, counted once per cell by `pit_tests`."""

    u: torch.Tensor  # [N, L] float64 PITs
    mask: torch.Tensor  # [N, L] bool: the positions tested
    valid: torch.Tensor  # [N, L] bool: tested and of positive probability under the target
    values: torch.Tensor  # [n] the u's at the valid positions, row-major
    counts: np.ndarray  # [L, B] position × bin counts
    slot_counts: np.ndarray | None  # [S, B] slot × bin counts; None: the run records no slots
    spare: torch.Tensor | None  # [N, L] uniforms completing pairs cut by the mask
    impossible: int  # tested tokens of probability 0
    min_expected: float  # per bin, for a position or slot to be tested
    streams: StreamValues | None = None  # None: the run scores no rows (the stream tests are not run)

    @property
    def n_bins(self) -> int:
        return self.counts.shape[1]


def _support(impossible: int, tested: int, power: float) -> TestResult:
    return support_check("pit.support", impossible, tested, power, "token")


def _support_of(pit: PitValues, power: float) -> TestResult:
    return _support(pit.impossible, int(pit.mask.sum()), power)


def _pooled_chisquare(pit: PitValues, alpha: float, power: float) -> TestResult:
    n, bins = len(pit.values), pit.n_bins
    expected = f"PIT values uniform over {bins} equal bins of [0, 1]"
    return goodness_of_fit("pit.pooled_chisquare", expected, pit.counts.sum(0), np.full(bins, n / bins), alpha, power)


def pit_required_values(
    alpha: float, power: float, target_tv: float, n_bins: int = 10, missing: frozenset[str] = frozenset()
) -> int:
    """PIT values (unmasked tokens) `pit_tests`' pooled χ² and KS need, under the cell budget
    `alpha`, to detect `target_tv` at `power`; `missing`: inputs the cell lacks (`SLOTS`: no
    slot test shares the budget)."""
    a = per_test_alpha(alpha, budget_count(PIT, missing=missing))
    return max(
        chisquare_required_n(2 * check_tv("target TV", target_tv), n_bins, a, power),
        dkwm_required_n(target_tv, a, power),
    )


def _require_pooled_power(n: int, n_bins: int, alpha: float, power: float, target_tv: float, required_n: int) -> None:
    w = chisquare_detectable_w(n, n_bins, alpha, power)
    levels = f"alpha = {alpha:.3g}, power = {power:g}"
    unit = "PIT values"
    require_power(w / 2, target_tv, f"pooled PIT χ² ({n_bins} bins, {levels})", n=n, required_n=required_n, unit=unit)
    require_power(
        dkwm_detectable(n, alpha, power), target_tv, f"pooled PIT KS ({levels})", n=n, required_n=required_n, unit=unit
    )


def _pooled_ks(pit: PitValues, alpha: float, power: float) -> TestResult:
    """KS of the tested PITs against U(0,1)."""
    values = pit.values.numpy()  # [n]
    ks = stats.kstest(values, "uniform")
    return TestResult(
        name="pit.pooled_ks",
        expected="PIT values with CDF of U(0, 1)",
        observed=(f"empirical CDF {ks.statistic:.4g} away from the uniform CDF at u = {ks.statistic_location:.4g}"),
        statistic=float(ks.statistic),
        p_value=float(ks.pvalue),
        alpha=alpha,
        n=len(values),
        power=power,
        detectable={"ks": dkwm_detectable(len(values), alpha, power)},
    )


def _stratified_chisquare(
    name: str, stratum: str, counts: np.ndarray | None, alpha: float, power: float, min_expected: float
) -> TestResult:
    """Sum over strata (positions, slots) of the per-stratum Pearson χ² of `counts` [S, B] against
    uniform; `counts` None: the run has no such strata (an engine that does not expose its slots).

    Detectable effects: "w" over the stratum × bin cells (noncentrality n·w², df = K(B-1));
    "tv" = w/2 bounds the n_s-weighted average of the per-stratum binned TVs (w_s >= 2δ_s and
    Jensen); "tv_one_<stratum>" is the binned TV detected when the whole distortion sits in the
    least-populated tested stratum (its noncentrality is n_s·w_s²).
    """
    if counts is None:
        return TestResult.untestable(
            name,
            f"PIT values uniform within each {stratum}",
            f"not tested: the run records no {stratum} of its tokens",
            alpha,
            power,
            effects=("w", "tv", f"tv_one_{stratum}"),
        )
    n_bins = counts.shape[1]
    per_position_n = counts.sum(1)  # [L]
    tested = np.flatnonzero(per_position_n >= min_expected * n_bins)  # [K]
    expected_desc = (
        f"PIT values uniform over {n_bins} equal bins in each {stratum} with >= {min_expected:g} expected per bin"
    )
    n = int(per_position_n[tested].sum())
    if len(tested) == 0:
        return TestResult.untestable(
            name,
            expected_desc,
            f"no {stratum} has enough PIT values to test",
            alpha,
            power,
            effects=("w", "tv", f"tv_one_{stratum}"),
        )
    per_position = stats.chisquare(counts[tested], axis=1)  # statistic, pvalue: [K]
    df = len(tested) * (n_bins - 1)
    statistic = float(per_position.statistic.sum())
    worst = int(np.argmin(per_position.pvalue))
    l_worst = int(tested[worst])
    w = chisquare_detectable_w(n, df + 1, alpha, power)
    return TestResult(
        name=name,
        expected=expected_desc,
        observed=(
            f"{len(tested)} {stratum}s tested; worst is {stratum} {l_worst} "
            f"(χ² = {per_position.statistic[worst]:.4g}, p = {per_position.pvalue[worst]:.3g}; "
            f"{describe_worst_bin(counts[l_worst], np.full(n_bins, per_position_n[l_worst] / n_bins))})"
        ),
        statistic=statistic,
        p_value=float(stats.chi2.sf(statistic, df)),
        log10_p=chi2_log10_sf(statistic, df),
        alpha=alpha,
        n=n,
        power=power,
        detectable={
            "w": w,
            "tv": w / 2,
            f"tv_one_{stratum}": w / 2 * math.sqrt(n / per_position_n[tested].min()),
        },
    )


def _pair_chisquare(pit: PitValues, alpha: float, power: float) -> TestResult:
    """χ² of the pairs (u_{2m}, u_{2m+1}) of each sequence on a `PAIR_BINS` x `PAIR_BINS` grid
    against the uniform square (df = PAIR_BINS² - 1). A pair counts when its first position is
    tested; a second position the mask cuts is filled from `spare`. Pairs touching an impossible
    token or a position left out of the tests are dropped (those fail the support check or are
    near-ties already)."""
    u, mask, valid, spare = pit.u, pit.mask, pit.valid, pit.spare
    length = u.shape[1] - u.shape[1] % 2
    first, second = u[:, 0:length:2], u[:, 1:length:2]  # [N, L/2]
    first_ok, second_ok = valid[:, 0:length:2], valid[:, 1:length:2]
    cut = ~mask[:, 1:length:2]  # the sequence ended before the second position
    if spare is not None:
        second = torch.where(cut, torch.as_tensor(spare, dtype=torch.float64)[:, 1:length:2], second)
        second_ok = second_ok | cut
    use = first_ok & second_ok  # [N, L/2]
    cells = PAIR_BINS * PAIR_BINS
    grid = (first[use] * PAIR_BINS).long().clamp(max=PAIR_BINS - 1) * PAIR_BINS + (
        second[use] * PAIR_BINS
    ).long().clamp(max=PAIR_BINS - 1)
    counts = torch.bincount(grid, minlength=cells).numpy()
    n = int(counts.sum())
    if n < 5 * cells:
        return TestResult.untestable(
            "pit.pair_chisquare",
            "consecutive PIT pairs uniform on the unit square",
            f"{n} pairs: too few to test (need {5 * cells})",
            alpha,
            power,
            n,
        )
    return goodness_of_fit(
        "pit.pair_chisquare",
        f"pairs (u_2m, u_2m+1) uniform over a {PAIR_BINS}x{PAIR_BINS} grid of the unit square",
        counts,
        np.full(cells, n / cells),
        alpha,
        power,
    )


def _position_chisquare(pit: PitValues, alpha: float, power: float) -> TestResult:
    return _stratified_chisquare("pit.position_chisquare", "position", pit.counts, alpha, power, pit.min_expected)


def _slot_chisquare(pit: PitValues, alpha: float, power: float) -> TestResult:
    return _stratified_chisquare("pit.slot_chisquare", "slot", pit.slot_counts, alpha, power, pit.min_expected)


register(StatTest("pit.support", PIT, "pooled", lambda pit, _alpha, power: _support_of(pit, power), spends_alpha=False))
register(StatTest("pit.pooled_chisquare", PIT, "pooled", _pooled_chisquare, power=powermodels.POOLED_CHISQUARE))
register(StatTest("pit.pooled_ks", PIT, "pooled", _pooled_ks))
register(StatTest("pit.position_chisquare", PIT, "stratified", _position_chisquare))
register(
    StatTest(
        "pit.slot_chisquare",
        PIT,
        "stratified",
        _slot_chisquare,
        power=powermodels.SLOT_CHISQUARE,
        needs=frozenset({SLOTS}),
    )
)
register(StatTest("pit.pair_chisquare", PIT, "stratified", _pair_chisquare))


def _streams(pit: PitValues) -> StreamValues:
    if pit.streams is None:  # never: the family's runner leaves a test out when its input is missing
        raise LosscheckError("the stream tests need the rows' stream values")
    return pit.streams


_NEEDS_STREAMS = frozenset({ROW_STREAMS})


def _stream_test(name: str, scope: Scope, run: Callable[[StreamValues, float, float], TestResult]) -> None:
    """Register one of the row-stream tests: `run(streams, alpha, power)` on the cell's streams."""
    register(
        StatTest(name, PIT, scope, lambda pit, alpha, power: run(_streams(pit), alpha, power), needs=_NEEDS_STREAMS)
    )


_stream_test("pit.greedy_fallback", "pooled", greedy_fallback)
_stream_test("pit.row_repeats", "pooled", repeats)
_stream_test("pit.row_serial", "stratified", serial)
_stream_test("pit.stop_hazard", "pooled", stop_hazard)


def __getattr__(name: str) -> int:
    if name == "PIT_TESTS":  # the removed hand-kept count (CHANGELOG.md, Deprecated)
        return deprecated_count("losscheck.stats.pit.PIT_TESTS", PIT)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
