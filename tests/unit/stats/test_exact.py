"""Exact mode on a Markov-table target: enumeration, data-independent bins, the tests."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from losscheck.errors import LosscheckError, UnderpoweredError
from losscheck.stats.exact import enumerate_continuations, exact_required_n, exact_tests, locate, probability_bins
from losscheck.stats.power import predicted_power
from tests.support import markov_chain

V, EOS, PROMPT, HORIZON = 5, 4, [1, 2], 4
IMPOSSIBLE = 0.2  # share of the chains' transitions at probability 0


def _next_probs(table: torch.Tensor, seen: list[torch.Tensor] | None = None):
    def next_probs(context: torch.Tensor) -> torch.Tensor:  # [M, t] -> [M, V]
        if seen is not None:
            seen.append(context)
        return table[context[:, -1]]

    return next_probs


def _brute_force(table: torch.Tensor, horizon: int, eos: int | None) -> dict[tuple[int, ...], float]:
    """Probability of every sequence in V^horizon by a product along it, EOS absorbing."""
    law = {}
    for seq in itertools.product(range(V), repeat=horizon):
        p, last, ended = 1.0, PROMPT[-1], False
        for token in seq:
            p *= float(token == eos) if ended else table[last, token].item()
            ended = ended or token == eos
            last = token
        if p > 0:
            law[seq] = p
    return law


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eos", [EOS, None])
def test_enumeration_is_the_brute_force_product_and_sums_to_one(seed, eos):
    table = markov_chain(V, seed, impossible=IMPOSSIBLE)
    seen: list[torch.Tensor] = []
    seqs, probs = enumerate_continuations(_next_probs(table, seen), PROMPT, HORIZON, eos)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-12)
    enumerated = {tuple(s): p for s, p in zip(seqs.tolist(), probs.tolist())}
    assert len(enumerated) == len(seqs)  # no sequence twice
    expected = _brute_force(table, HORIZON, eos)
    assert enumerated.keys() == expected.keys()
    for seq, p in expected.items():
        assert enumerated[seq] == pytest.approx(p, rel=1e-12)
    assert len(seen) <= HORIZON  # one batched call per level
    if eos is not None:  # ended rows are never scored again
        assert all((c[:, len(PROMPT) :] != eos).all() for c in seen)


def test_enumeration_refuses_a_space_too_large():
    uniform = torch.full((V, V), 1.0 / V, dtype=torch.float64)
    with pytest.raises(LosscheckError, match="max_sequences"):
        enumerate_continuations(_next_probs(uniform), PROMPT, 6, None, max_sequences=1000)


def test_enumeration_rejects_rows_that_are_not_distributions():
    bad = torch.full((V, V), 0.3, dtype=torch.float64)
    with pytest.raises(LosscheckError, match="rows must be probability distributions"):
        enumerate_continuations(_next_probs(bad), PROMPT, 2, EOS)


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=300).filter(
        lambda w: sum(w) > 0
    ),
    n=st.integers(1, 100_000),
    min_expected=st.sampled_from([1.0, 5.0, 10.0]),
    max_bins=st.integers(2, 80),
)
def test_probability_bins_respect_min_expected_and_probability_order(weights, n, min_expected, max_bins):
    probs = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    bin_of, expected = probability_bins(probs, n, min_expected, max_bins)
    assert len(expected) <= max_bins
    assert expected.sum().item() == pytest.approx(n)
    torch.testing.assert_close(expected, torch.bincount(bin_of, weights=n * probs, minlength=len(expected)))
    per_bin = max(min_expected, n / max_bins)
    if len(expected) > 1:
        assert (expected >= min_expected * (1 - 1e-9)).all(), expected
    else:  # one bin only when what follows the first full bin cannot fill a second one
        cumulative = (n * probs.sort(descending=True).values).cumsum(0)
        first_full = cumulative[cumulative >= per_bin * (1 - 1e-9)]
        assert len(first_full) == 0 or n - first_full[0] < per_bin * (1 + 1e-9)
    for k in range(len(expected) - 1):  # bins follow descending probability
        assert probs[bin_of == k].min() >= probs[bin_of == k + 1].max()
    again, _ = probability_bins(probs, n, min_expected, max_bins)
    assert torch.equal(bin_of, again)


def test_locate_finds_rows_and_marks_absent_ones():
    seqs = torch.tensor([[0, 1], [1, 1], [2, 0]])
    samples = torch.tensor([[2, 0], [0, 1], [0, 0], [2, 0]])
    assert locate(samples, seqs).tolist() == [2, 0, -1, 2]


def _draw(seqs: torch.Tensor, probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return seqs[torch.multinomial(probs, n, replacement=True, generator=g)]


N_SAMPLES, ALPHA, POWER, TARGET_TV = 20_000, 0.01, 0.99, 0.05
CHAIN = markov_chain(V, 3, impossible=IMPOSSIBLE)  # the target chain of the sampling tests


def test_exact_samples_pass():
    seqs, probs = enumerate_continuations(_next_probs(CHAIN), PROMPT, HORIZON, EOS)
    results = exact_tests(_draw(seqs, probs, N_SAMPLES, seed=4), seqs, probs, ALPHA, POWER, TARGET_TV)
    names = [r.name for r in results]
    assert names[:3] == ["exact.support", "exact.joint_chisquare", "exact.joint_gtest"]
    assert any(name.startswith("exact.position[") for name in names)
    assert sum(r.alpha for r in results) == pytest.approx(ALPHA)
    assert all(r.passed for r in results), (
        f"exact samples failed; false-failure probability <= alpha = {ALPHA} (Bonferroni over the tests):\n"
        + "\n".join(r.message() for r in results if not r.passed)
    )


def test_distortion_with_high_predicted_power_is_caught():
    next_probs = _next_probs(CHAIN)
    seqs, probs = enumerate_continuations(next_probs, PROMPT, HORIZON, EOS)
    sharper = markov_chain(V, 3, sharpen=1.1, impossible=IMPOSSIBLE)
    alt_seqs, alt_probs = enumerate_continuations(_next_probs(sharper), PROMPT, HORIZON, EOS)
    results = {
        r.name: r
        for r in exact_tests(_draw(alt_seqs, alt_probs, N_SAMPLES, seed=5), seqs, probs, ALPHA, POWER, TARGET_TV)
    }
    joint = results["exact.joint_chisquare"]
    # predicted power from the exact distortion on the test's own bins
    bin_of, expected = probability_bins(probs, N_SAMPLES)
    alt_binned = torch.bincount(bin_of[locate(alt_seqs, seqs)], weights=alt_probs, minlength=len(expected))
    assert predicted_power(expected / N_SAMPLES, alt_binned, N_SAMPLES, joint.alpha) > 0.99
    missed = "the distortion was missed; false-failure probability < 0.01 (1 - its predicted χ² power, > 0.99)"
    assert not joint.passed, f"{missed}\n{joint.message()}"
    gtest = results["exact.joint_gtest"]  # asymptotically the same noncentral-χ² power as Pearson's
    assert not gtest.passed, f"{missed}, which the G-test shares asymptotically\n{gtest.message()}"


def test_impossible_samples_fail_the_support_check_without_crashing():
    seqs, probs = enumerate_continuations(_next_probs(CHAIN), PROMPT, HORIZON, EOS)
    samples = _draw(seqs, probs, N_SAMPLES, seed=6)
    samples[:3] = torch.tensor([EOS, 0, 0, 0])  # a token after EOS: probability 0
    results = exact_tests(samples, seqs, probs, ALPHA, POWER, TARGET_TV)
    assert not results[0].passed and results[0].statistic == 3 and results[0].p_value == 0.0
    assert "3 of 20000" in results[0].message()
    only_impossible = exact_tests(samples[:3].repeat(N_SAMPLES // 3, 1), seqs, probs, ALPHA, POWER, TARGET_TV)
    assert [r.name for r in only_impossible] == ["exact.support"] and not only_impossible[0].passed


@pytest.mark.parametrize("n", [3, 300])
def test_too_few_samples_raise_underpowered_with_the_needed_n(n):
    seqs, probs = enumerate_continuations(_next_probs(CHAIN), PROMPT, HORIZON, EOS)
    with pytest.raises(UnderpoweredError, match=rf"{n} samples.*needs n >= \d+ samples"):
        exact_tests(_draw(seqs, probs, n, seed=7), seqs, probs, ALPHA, POWER, TARGET_TV)


def test_exact_required_n_is_enough_samples():
    seqs, probs = enumerate_continuations(_next_probs(CHAIN), PROMPT, HORIZON, EOS)
    needed = exact_required_n(len(seqs), HORIZON, ALPHA, POWER, TARGET_TV)
    samples = _draw(seqs, probs, needed, seed=8)
    results = {r.name: r for r in exact_tests(samples, seqs, probs, ALPHA, POWER, TARGET_TV)}  # no UnderpoweredError
    for name in ("exact.joint_chisquare", "exact.joint_gtest"):  # each detects TARGET_TV at POWER
        assert results[name].n == needed and results[name].detectable["tv"] <= TARGET_TV, results[name].message()
