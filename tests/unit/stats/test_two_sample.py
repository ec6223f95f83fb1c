"""Two-sample mode: level with pooled bins, detection of marginal and whole-sequence distortions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from losscheck.errors import UnderpoweredError
from losscheck.stats.two_sample import distinct_tokens, pooled_token_bins, two_sample_tests
from tests.support import markov_chain

V, EOS, L = 6, 5, 6
ALPHA, POWER, TARGET_TV = 0.01, 0.99, 0.1


def _sample_chain(table: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n sequences [n, L] of the chain started from token 0."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.zeros(n, dtype=torch.long)]
    for _ in range(L):
        tokens.append(torch.multinomial(table[tokens[-1]], 1, generator=g).squeeze(1))
    return torch.stack(tokens[1:], 1)


def _marginals(table: torch.Tensor) -> torch.Tensor:
    """Exact law [L, V] of each position of the chain started from token 0."""
    law = [table[0]]
    for _ in range(L - 1):
        law.append(law[-1] @ table)
    return torch.stack(law)


def test_same_distribution_passes():
    table = markov_chain(V, 0, absorbing=EOS)
    results = two_sample_tests(_sample_chain(table, 4000, 1), _sample_chain(table, 4000, 2), V, ALPHA, POWER, TARGET_TV)
    assert [r.name for r in results] == [f"two_sample.position[{pos}]" for pos in range(L)] + [
        "two_sample.distinct_tokens"
    ]
    assert sum(r.alpha for r in results) == pytest.approx(ALPHA)
    assert all(r.passed for r in results), (
        f"equal samples failed; false-failure probability <= alpha = {ALPHA} (Bonferroni over the tests):\n"
        + "\n".join(r.message() for r in results if not r.passed)
    )


def test_distorted_marginals_fail_where_their_tv_is_detectable():
    null, alt = markov_chain(V, 0, absorbing=EOS), markov_chain(V, 0, sharpen=1.3, absorbing=EOS)
    results = two_sample_tests(_sample_chain(alt, 4000, 3), _sample_chain(null, 4000, 4), V, ALPHA, POWER, TARGET_TV)
    tv = 0.5 * (_marginals(alt) - _marginals(null)).abs().sum(-1)  # [L]
    detectable = [pos for pos in range(L) if tv[pos] > results[pos].detectable["tv"]]
    assert detectable, f"the distortion is too weak for this test: TV per position {tv.tolist()}"
    for pos in detectable:
        assert not results[pos].passed, (
            f"position {pos} was missed; false-failure probability <= 1 - {POWER} per position if its binned TV "
            f"(TV {float(tv[pos]):.3g} before binning) is at least the detectable {results[pos].detectable['tv']:.3g}\n"
            + results[pos].message()
        )


def test_dependence_invisible_to_marginals_fails_the_sequence_test():
    """Half of sample b repeats one token: every position stays uniform, the sequences do not."""
    n, vocab = 3000, 20
    g = torch.Generator().manual_seed(5)
    a = torch.randint(vocab, (n, L), generator=g)
    b = torch.randint(vocab, (n, L), generator=g)
    b[: n // 2] = b[: n // 2, :1]
    results = two_sample_tests(a, b, vocab, ALPHA, POWER, target_tv=0.2)
    assert all(r.passed for r in results[:L]), (
        f"equal marginals failed; false-failure probability <= alpha = {ALPHA}:\n"
        + "\n".join(r.message() for r in results[:L] if not r.passed)
    )
    assert not results[L].passed, (  # the distinct-count CDFs differ by ~0.5 at 1: half of b has one token
        f"the repeats were missed; false-failure probability <= 1 - {POWER} if Kolmogorov distance 0.5 is at "
        f"least the detectable {results[L].detectable['ks']:.3g}\n{results[L].message()}"
    )


def test_pooled_bins_keep_the_level():
    """Under H0 with a long-tailed token law, the per-position test's rejection rate at level
    0.05 stays binomially near 0.05, although its bins are chosen from the pooled sample."""
    reps, n, vocab, level = 300, 300, 100, 0.05
    law = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)  # Zipf
    g = torch.Generator().manual_seed(6)
    draws = torch.multinomial(law, reps * 2 * n, replacement=True, generator=g).view(reps, 2, n, 1)
    p_values = torch.tensor(
        [two_sample_tests(d[0], d[1], vocab, 2 * level, 0.9, target_tv=1.0)[0].p_value for d in draws]
    )
    rate = (p_values <= level).double().mean().item()
    bound = level + 3 * math.sqrt(level * (1 - level) / reps)  # 26 rejections of 300 at most
    assert rate <= bound, (
        f"rejection rate {rate:.3f} above {bound:.3f} (level {level}, {reps} reps); false-failure probability "
        "2.6e-3 at level exactly 0.05 (P(Binomial(300, 0.05) >= 27))"
    )


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 29), min_size=1, max_size=400),
    min_count=st.floats(1.0, 40.0),
    max_bins=st.integers(2, 12),
)
def test_pooled_token_bins_each_hold_min_count(tokens, min_count, max_bins):
    pooled = torch.tensor(tokens)
    bin_of_token = pooled_token_bins(pooled, 30, min_count, max_bins)  # [30]
    counts = torch.bincount(bin_of_token[pooled])
    assert len(counts) <= max_bins
    if len(counts) > 1:
        assert (counts >= min_count).all(), counts


def test_distinct_tokens_counts_per_row():
    assert distinct_tokens(torch.tensor([[3, 3, 3], [1, 2, 1], [0, 1, 2]])).tolist() == [1, 2, 3]


def test_too_few_samples_raise_underpowered_with_the_needed_n():
    table = markov_chain(V, 0, absorbing=EOS)
    with pytest.raises(UnderpoweredError, match=r"needs n >= \d+ effective samples"):
        two_sample_tests(_sample_chain(table, 200, 7), _sample_chain(table, 200, 8), V, ALPHA, POWER, TARGET_TV)
