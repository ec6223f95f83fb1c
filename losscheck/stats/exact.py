"""Exact mode: enumerate every continuation of a small-vocabulary target and test samples
against the exact probabilities.

Bins are formed from the exact probabilities and the sample size alone (never from observed
counts), so the χ² tests keep their level however the samples fall.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from numpy.typing import ArrayLike

from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.stats._checks import check_open_unit, check_positive, check_tv, normalized_rows
from losscheck.stats.gof import goodness_of_fit, support_check
from losscheck.stats.power import chisquare_detectable_w, chisquare_required_n, require_power
from losscheck.stats.registry import EXACT, StatTest, register, run_family, split
from losscheck.stats.result import TestResult

NextProbs = Callable[[torch.Tensor], torch.Tensor]  # context LongTensor [M, t] -> probs [M, V]


def enumerate_continuations(
    next_probs: NextProbs,
    prompt: list[int],
    horizon: int,
    eos_id: int | None,
    max_sequences: int = 1_000_000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation of `prompt` of length `horizon` with positive probability, exactly.

    next_probs(context [M, len(prompt) + t]) -> [M, V]: the target's next-token distribution for
    each context row (processing included). It is called once per level with all live rows;
    batch inside it if a level does not fit in memory.
    EOS is absorbing: once `eos_id` is generated the sequence is padded with `eos_id` with
    probability 1, and `next_probs` is not asked about it again.

    returns seqs  LongTensor [S, horizon]  (continuations only, prompt not included)
            probs float64    [S]           (sums to 1)
    Raises `LosscheckError` beyond `max_sequences` continuations (the vocabulary or horizon is
    too large to enumerate; use the PIT mode).
    """
    if horizon < 0:
        raise LosscheckError(f"horizon must be >= 0, got {horizon}")
    context = torch.tensor([prompt], dtype=torch.long)  # [M, P + t]
    probs = torch.ones(1, dtype=torch.float64)  # [M]
    ended = torch.zeros(1, dtype=torch.bool)  # [M] EOS already generated
    for t in range(horizon):
        if eos_id is not None and ended.all():  # every row has ended, pad the rest at once
            context = torch.cat([context, context.new_full((len(context), horizon - t), eos_id)], dim=1)
            break
        live = ~ended
        step = _checked_step(next_probs(context[live]), int(live.sum()), t)  # [M_live, V]
        row, token = step.nonzero(as_tuple=True)  # [M_grown] each: branch on positive mass
        grown = torch.cat([context[live][row], token[:, None]], dim=1)  # [M_grown, P + t + 1]
        context = torch.cat([_append(context[ended], eos_id), grown])  # [M_ended + M_grown, P + t + 1]
        probs = torch.cat([probs[ended], probs[live][row] * step[row, token]])
        grown_ended = token == eos_id if eos_id is not None else torch.zeros_like(token, dtype=torch.bool)
        ended = torch.cat([ended[ended], grown_ended])
        if len(probs) > max_sequences:
            raise LosscheckError(
                f"enumerating continuations: {len(probs)} sequences of positive probability after "
                f"{t + 1} of {horizon} tokens, above max_sequences = {max_sequences}; use the PIT mode"
            )
    return context[:, len(prompt) :], probs


def _append(context: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """`context` [M, t] of ended rows with one more EOS column; rows end only if eos_id is set."""
    if eos_id is None:
        return context.new_empty((0, context.shape[1] + 1))
    return torch.cat([context, context.new_full((len(context), 1), eos_id)], dim=1)


def _checked_step(step: torch.Tensor, rows: int, t: int) -> torch.Tensor:
    """`step` [rows, V] as float64, renormalised, after checking it is a batch of distributions."""
    if step.dim() != 2 or step.shape[0] != rows:
        raise LosscheckError(
            f"next_probs returned shape {tuple(step.shape)} for {rows} contexts at step {t}; expected [{rows}, V]"
        )
    return normalized_rows(step, f"next_probs at step {t}")


def probability_bins(
    probs: ArrayLike,
    n_samples: int,
    min_expected: float = 5.0,
    max_bins: int = 50,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bins of outcomes with exact probabilities `probs` [S] for a χ² test of `n_samples` draws.

    Outcomes are taken in order of descending probability (ties by index) and cut greedily into
    consecutive bins of expected count >= max(min_expected, n_samples / max_bins); what is left
    at the end — the low-probability tail, too light for a bin of its own — joins the last bin,
    the rare bucket. Every bin therefore has expected count >= min_expected unless the total
    n_samples is below it (one bin). Uses only `probs` and `n_samples`, never observed counts.

    returns bin_of   LongTensor [S]            bin of each outcome
            expected float64    [n_bins]       n_samples · (mass of the bin)
    """
    check_positive("n_samples", n_samples)
    check_positive("min_expected", min_expected)
    if max_bins < 2:
        raise LosscheckError(f"max_bins must be >= 2, got {max_bins}")
    p = torch.as_tensor(probs, dtype=torch.float64).numpy()  # [S]
    order = np.argsort(-p, kind="stable")  # [S]
    cumulative = np.cumsum(n_samples * p[order])  # [S]
    per_bin = max(min_expected, n_samples / max_bins)
    ends: list[int] = []  # exclusive end of each bin, in sorted order
    filled = 0.0
    while (j := int(np.searchsorted(cumulative, filled + per_bin))) < len(p):
        ends.append(j + 1)
        filled = cumulative[j]
    if ends:
        ends[-1] = len(p)  # the tail joins the last bin: the rare bucket
    else:
        ends = [len(p)]
    bin_of = np.empty(len(p), dtype=np.int64)
    bin_of[order] = np.searchsorted(ends, np.arange(len(p)), side="right")
    expected = np.bincount(bin_of, weights=n_samples * p, minlength=len(ends))
    return torch.from_numpy(bin_of), torch.from_numpy(expected)


def locate(samples: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    """Index into `seqs` [S, L] of each row of `samples` [N, L]; -1 where it is not there."""
    _, inverse = torch.unique(torch.cat([seqs, samples]), dim=0, return_inverse=True)  # [S + N]
    index_of_unique = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.long)
    index_of_unique[inverse[: len(seqs)]] = torch.arange(len(seqs))
    return index_of_unique[inverse[len(seqs) :]]


def exact_tests(
    samples: torch.Tensor,
    seqs: torch.Tensor,
    probs: torch.Tensor,
    alpha: float,
    power: float,
    target_tv: float,
    min_expected: float = 5.0,
    max_bins: int = 50,
) -> list[TestResult]:
    """Test sampled continuations `samples` [N, L] against the exact law (`seqs` [S, L],
    `probs` [S], from `enumerate_continuations`) under the cell budget `alpha`.

    Returns, in order:
      exact.support          samples absent from the enumeration (probability 0), alpha 0;
      exact.joint_chisquare  Pearson χ² on `probability_bins` of the sequences;
      exact.joint_gtest      G-test on the same bins;
      exact.position[l]      Pearson χ² of the tokens at position l against their exact
                             marginal, binned the same way (positions with one bin, e.g.
                             certain tokens, are not testable and not counted).
    The tests split `alpha` by Bonferroni (the `exact` family of `losscheck.stats.registry`, the
    per-position test once per testable position); the number of tests follows from the
    probabilities and N only. The joint tests first raise `UnderpoweredError` when they cannot detect binned
    TV `target_tv` at `power` (`exact_required_n` says how many samples suffice); the
    per-position tests only report what they detect. Samples outside the support fail the
    support check and are left out of the other tests.
    """
    samples = torch.as_tensor(samples, dtype=torch.long)
    seqs = torch.as_tensor(seqs, dtype=torch.long)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    if samples.dim() != 2 or seqs.dim() != 2 or samples.shape[1] != seqs.shape[1] or probs.shape != seqs.shape[:1]:
        raise LosscheckError(
            f"exact_tests needs samples [N, L], seqs [S, L], probs [S]; got {tuple(samples.shape)}, "
            f"{tuple(seqs.shape)}, {tuple(probs.shape)}"
        )
    check_open_unit("power", power)
    check_tv("target TV", target_tv)
    n = len(samples)
    if n == 0:
        raise UnderpoweredError("exact_tests: no samples to test")

    joint_bin_of, joint_expected = probability_bins(probs, n, min_expected, max_bins)
    marginals = [_marginal_bins(seqs[:, pos], probs, n, min_expected, max_bins) for pos in range(seqs.shape[1])]
    testable = [pos for pos, (_, _, expected) in enumerate(marginals) if len(expected) >= 2]
    a = split(alpha, EXACT, positions=len(testable)).per_test
    _require_joint_power(
        n,
        len(joint_expected),
        a,
        power,
        target_tv,
        required_n=exact_required_n(len(probs), seqs.shape[1], alpha, power, target_tv, max_bins),
    )
    index = locate(samples, seqs)  # [N]
    values = ExactValues(n, index[index >= 0], joint_bin_of, joint_expected, marginals, testable)
    return run_family(EXACT, values, alpha, power, positions=len(testable))


@dataclass(frozen=True)
class ExactValues:
    """What the `exact` family's tests read, binned once per cell by `exact_tests`."""

    n: int  # samples
    inside: torch.Tensor  # [N_inside] index among the enumerated sequences of each sample inside the support
    joint_bin_of: torch.Tensor  # [S] bin of each enumerated sequence
    joint_expected: torch.Tensor  # [bins] n · (mass of each bin)
    # per position: token_of_seq [S], bin_of_token [T], expected [bins] (`_marginal_bins`)
    marginals: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    testable: list[int]  # positions with at least two bins

    def share_inside(self, expected: torch.Tensor) -> torch.Tensor:
        """`expected` counts of n samples scaled to the samples inside the support."""
        return expected * (len(self.inside) / self.n)


def _support(values: ExactValues, power: float) -> TestResult:
    return support_check("exact.support", values.n - len(values.inside), values.n, power, "sequence")


def _joint(
    values: ExactValues, name: str, alpha: float, power: float, statistic: Literal["pearson", "log-likelihood"]
) -> list[TestResult]:
    """A joint test of the sequences on the bins of exact probability; none when no sample lies
    inside the support (nothing is left to bin: the support check has failed the cell)."""
    if len(values.inside) == 0:
        return []
    expected = values.joint_expected
    observed = torch.bincount(values.joint_bin_of[values.inside], minlength=len(expected))
    desc = f"sampled sequences distributed over {len(expected)} bins of exact probability"
    return [goodness_of_fit(name, desc, observed, values.share_inside(expected), alpha, power, statistic)]


def _joint_chisquare(values: ExactValues, alpha: float, power: float) -> list[TestResult]:
    return _joint(values, "exact.joint_chisquare", alpha, power, "pearson")


def _joint_gtest(values: ExactValues, alpha: float, power: float) -> list[TestResult]:
    return _joint(values, "exact.joint_gtest", alpha, power, "log-likelihood")


def _positions(values: ExactValues, alpha: float, power: float) -> list[TestResult]:
    """Pearson χ² of the tokens at each testable position against their exact marginal."""
    if len(values.inside) == 0:
        return []
    results = []
    for pos in values.testable:
        token_of_seq, bin_of_token, marginal_expected = values.marginals[pos]
        observed = torch.bincount(bin_of_token[token_of_seq[values.inside]], minlength=len(marginal_expected))
        results.append(
            goodness_of_fit(
                f"exact.position[{pos}]",
                f"tokens at position {pos} distributed over {len(marginal_expected)} bins of their exact marginal",
                observed,
                values.share_inside(marginal_expected),
                alpha,
                power,
            )
        )
    return results


def _marginal_bins(
    tokens: torch.Tensor, probs: torch.Tensor, n: int, min_expected: float, max_bins: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bins of the exact marginal law of one position.

    tokens [S] the position's token in each enumerated sequence; probs [S] their probabilities.
    returns token_of_seq [S] (index of the sequence's token among the distinct ones),
            bin_of_token [T], expected [n_bins]
    """
    distinct, token_of_seq = torch.unique(tokens, return_inverse=True)  # [T], [S]
    marginal = torch.zeros(len(distinct), dtype=torch.float64).index_add_(0, token_of_seq, probs)  # [T]
    bin_of_token, expected = probability_bins(marginal, n, min_expected, max_bins)
    return token_of_seq, bin_of_token, expected


def exact_required_n(
    n_sequences: int, horizon: int, alpha: float, power: float, target_tv: float, max_bins: int = 50
) -> int:
    """Samples enough for `exact_tests`' joint tests to detect binned TV `target_tv`, however the
    bins fall: `alpha` split over the most tests a cell can have (2 + horizon) and the most bins
    (min(n_sequences, max_bins)); fewer tests or bins only need fewer samples."""
    n_bins = max(min(n_sequences, max_bins), 2)
    per_test = split(alpha, EXACT, positions=horizon).per_test
    return chisquare_required_n(2 * check_tv("target TV", target_tv), n_bins, per_test, power)


def _require_joint_power(n: int, n_bins: int, alpha: float, power: float, target_tv: float, required_n: int) -> None:
    """Raise unless the joint χ² on `n_bins` bins at level `alpha` detects binned TV `target_tv`."""
    what = f"exact joint χ² ({n_bins} bins, alpha = {alpha:.3g}, power = {power:g})"
    if n_bins < 2:
        raise UnderpoweredError(
            f"{what} is underpowered: {n} samples are too few to fill two bins of exact "
            f"probability; it needs n >= {required_n} samples to detect TV {target_tv:.4g}."
        )
    w = chisquare_detectable_w(n, n_bins, alpha, power)
    require_power(w / 2, target_tv, what, n=n, required_n=required_n, unit="samples")


register(
    StatTest(
        "exact.support", EXACT, "pooled", lambda values, _alpha, power: _support(values, power), spends_alpha=False
    )
)
register(StatTest("exact.joint_chisquare", EXACT, "pooled", _joint_chisquare))
register(StatTest("exact.joint_gtest", EXACT, "pooled", _joint_gtest))
register(StatTest("exact.position", EXACT, "stratified", _positions, per_position=True))
