"""Two-sample mode for black-box engines: spec samples against baseline samples.

Without target probabilities the bins cannot come from the null, so they come from the pooled
sample: the most frequent token ids of both samples together get a bin each, the rest share a
rare bucket. That keeps the level: under H0 the two samples are exchangeable, so given the
pooled multiset every split into sample a and sample b is equally likely, and bins that depend
only on the pooled multiset are fixed under that permutation law — the χ² homogeneity test is
then its usual (asymptotic) self. Bins that looked at either sample alone would not be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit, check_positive, check_tv
from losscheck.stats.power import (
    chisquare_detectable_w,
    chisquare_required_n,
    dkwm_two_sample_detectable,
    require_power,
)
from losscheck.stats.registry import TWO_SAMPLE, StatTest, register, run_family, split
from losscheck.stats.result import TestResult


def two_sample_tests(
    a: torch.Tensor,
    b: torch.Tensor,
    vocab_size: int,
    alpha: float,
    power: float,
    target_tv: float,
    min_expected: float = 5.0,
    max_bins: int = 50,
) -> list[TestResult]:
    """Test that generated ids `a` [Na, L] (e.g. spec) and `b` [Nb, L] (e.g. baseline, drawn
    with independent seeds) come from one distribution, under the cell budget `alpha`.

    Token ids must lie in [0, vocab_size); pad after EOS the same way in both (e.g. with EOS).
    Returns, in order:
      two_sample.position[l]     χ² homogeneity (2 × bins) of the tokens at position l, on
                                 pooled-frequency bins: at most `max_bins`, each with >=
                                 `min_expected` expected per sample;
      two_sample.distinct_tokens KS two-sample test of the number of distinct tokens per
                                 sequence — a statistic of the whole sequence, which sees
                                 dependence between positions (repetition) that marginals miss.
    The L + 1 tests split `alpha` by Bonferroni (the `two_sample` family of
    `losscheck.stats.registry`, the per-position test once per position). Power uses the effective sample size
    n = Na·Nb/(Na + Nb) (noncentrality n·w² with w² = Σ (p_a - p_b)² / p_pooled, so again
    w >= 2·binned TV). The per-position tests first raise `UnderpoweredError` when, with
    `max_bins` bins (the worst case: more bins, less power), they cannot detect binned TV
    `target_tv`; the sequence test only reports its DKWM-detectable Kolmogorov distance.
    """
    a = torch.as_tensor(a, dtype=torch.long)
    b = torch.as_tensor(b, dtype=torch.long)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] == 0:
        raise LosscheckError(
            f"two_sample_tests needs a [Na, L] and b [Nb, L], L >= 1; got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    for name, ids in (("a", a), ("b", b)):
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
            raise LosscheckError(f"two_sample_tests: sample {name} is empty or has ids outside [0, {vocab_size})")
    check_open_unit("power", power)
    check_tv("target TV", target_tv)
    check_positive("min_expected", min_expected)
    if max_bins < 2:
        raise LosscheckError(f"max_bins must be >= 2, got {max_bins}")
    n_a, n_b = len(a), len(b)
    n_eff = n_a * n_b / (n_a + n_b)
    alpha_each = split(alpha, TWO_SAMPLE, positions=a.shape[1]).per_test

    w = chisquare_detectable_w(n_eff, max_bins, alpha_each, power)
    require_power(
        w / 2,
        target_tv,
        f"per-position two-sample χ² ({n_a} vs {n_b} samples, up to {max_bins} bins, "
        f"alpha = {alpha_each:.3g}, power = {power:g})",
        n=math.floor(n_eff),
        required_n=chisquare_required_n(2 * target_tv, max_bins, alpha_each, power),
        unit="effective samples Na·Nb/(Na+Nb) (equal sizes need twice this each)",
    )
    # one count over the pooled sample decides every bin, at least this many pooled tokens each
    min_count = min_expected * (n_a + n_b) / min(n_a, n_b)
    values = TwoSampleValues(a, b, vocab_size, min_count, max_bins, n_eff)
    return run_family(TWO_SAMPLE, values, alpha, power, positions=a.shape[1])


@dataclass(frozen=True)
class TwoSampleValues:
    """What the `two_sample` family's tests read."""

    a: torch.Tensor  # [Na, L] ids of sample a
    b: torch.Tensor  # [Nb, L] ids of sample b
    vocab_size: int
    min_count: float  # pooled tokens a bin needs
    max_bins: int
    n_eff: float  # effective sample size Na·Nb/(Na + Nb)


def _positions(values: TwoSampleValues, alpha: float, power: float) -> list[TestResult]:
    a, b = values.a, values.b
    return [
        _position_homogeneity(
            pos, a[:, pos], b[:, pos], values.vocab_size, values.min_count, values.max_bins, values.n_eff, alpha, power
        )
        for pos in range(a.shape[1])
    ]


def pooled_token_bins(pooled: torch.Tensor, vocab_size: int, min_count: float, max_bins: int) -> torch.Tensor:
    """Bin of each token id [V] from the pooled tokens `pooled` [Na + Nb] of one position.

    Ids by descending pooled count (ties by id): each of the first ones with count >= `min_count`
    gets a bin, at most max_bins - 1 of them; all other ids share the rare bucket, which joins
    the last bin when its own count is below `min_count`.
    """
    counts = torch.bincount(pooled, minlength=vocab_size)  # [V]
    order = torch.sort(counts, descending=True, stable=True).indices  # [V]
    n_own = min(max_bins - 1, int((counts >= min_count).sum()))
    rare_count = int(counts.sum()) - int(counts[order[:n_own]].sum())
    bin_of_token = torch.full((vocab_size,), n_own, dtype=torch.long)  # [V] rare bucket by default
    bin_of_token[order[:n_own]] = torch.arange(n_own)
    if rare_count < min_count and n_own > 0:
        bin_of_token[bin_of_token == n_own] = n_own - 1
    return bin_of_token


def _position_homogeneity(
    pos: int,
    a: torch.Tensor,
    b: torch.Tensor,
    vocab_size: int,
    min_count: float,
    max_bins: int,
    n_eff: float,
    alpha: float,
    power: float,
) -> TestResult:
    """χ² homogeneity of the tokens `a` [Na] and `b` [Nb] at position `pos`."""
    bin_of_token = pooled_token_bins(torch.cat([a, b]), vocab_size, min_count, max_bins)  # [V]
    n_bins = int(bin_of_token.max()) + 1
    table = torch.stack(
        [torch.bincount(bin_of_token[a], minlength=n_bins), torch.bincount(bin_of_token[b], minlength=n_bins)]
    ).numpy()  # [2, n_bins]
    expected = f"the same token distribution at position {pos} in both samples"
    if n_bins < 2:
        return TestResult.untestable(
            f"two_sample.position[{pos}]",
            expected,
            "too few distinct tokens in the pooled sample for two bins: nothing to compare",
            alpha,
            power,
            len(a) + len(b),
        )
    test = stats.chi2_contingency(table, correction=False)
    share = table / table.sum(1, keepdims=True)  # [2, n_bins]
    k = int(np.argmax(np.abs(share[0] - share[1])))
    members = torch.nonzero(bin_of_token == k).flatten()
    what = f"token {int(members[0])}" if len(members) == 1 else f"the bucket of {len(members)} rarer token ids"
    w = chisquare_detectable_w(n_eff, n_bins, alpha, power)
    return TestResult(
        name=f"two_sample.position[{pos}]",
        expected=expected,
        observed=(
            f"{n_bins} pooled-frequency bins; {what} differs most: {share[0, k]:.4f} of sample a "
            f"vs {share[1, k]:.4f} of sample b"
        ),
        statistic=float(test.statistic),
        p_value=float(test.pvalue),
        alpha=alpha,
        n=len(a) + len(b),
        power=power,
        detectable={"w": w, "tv": w / 2},
    )


def distinct_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Number of distinct token ids in each row of `ids` [N, L] -> [N]."""
    ordered = ids.sort(dim=1).values  # [N, L]
    return 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(1)


def _distinct_tokens_ks(a: torch.Tensor, b: torch.Tensor, alpha: float, power: float) -> TestResult:
    """KS two-sample test of `distinct_tokens` of `a` [Na, L] and `b` [Nb, L]."""
    da, db = distinct_tokens(a).numpy(), distinct_tokens(b).numpy()
    ks = stats.ks_2samp(da, db)
    return TestResult(
        name="two_sample.distinct_tokens",
        expected="the same distribution of distinct tokens per sequence in both samples",
        observed=(
            f"mean {da.mean():.3f} in sample a vs {db.mean():.3f} in sample b; CDFs {ks.statistic:.4g} "
            f"apart at {ks.statistic_location}"
        ),
        statistic=float(ks.statistic),
        p_value=float(ks.pvalue),
        alpha=alpha,
        n=len(da) + len(db),
        power=power,
        detectable={"ks": dkwm_two_sample_detectable(len(da), len(db), alpha, power)},
    )


register(StatTest("two_sample.position", TWO_SAMPLE, "stratified", _positions, per_position=True))
register(
    StatTest(
        "two_sample.distinct_tokens",
        TWO_SAMPLE,
        "pooled",
        lambda v, alpha, power: _distinct_tokens_ks(v.a, v.b, alpha, power),
    )
)
