"""Teacher-forced PIT: exact tiling of [0, 1], uniformity under H0, detection of distortions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from losscheck.errors import UnderpoweredError
from losscheck.stats.pit import pit_required_values, pit_tests, randomized_pit
from losscheck.stats.power import predicted_power
from losscheck.stats.registry import ROW_STREAMS, SLOTS

EOS = 0


def _random_target(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked random distributions [n, length, vocab] (softmax of scaled normal logits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(n, length, vocab, generator=g, dtype=torch.float64), -1)


def _sample(probs: torch.Tensor, seed: int) -> torch.Tensor:
    """One token per row of `probs` [n, length, vocab] -> [n, length]."""
    g = torch.Generator().manual_seed(seed)
    n, length, vocab = probs.shape
    return torch.multinomial(probs.reshape(-1, vocab), 1, generator=g).view(n, length)


def _uniforms(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _before_eos(tokens: torch.Tensor) -> torch.Tensor:
    """Mask [n, length]: positions at or before the first EOS (predictable: depends on earlier tokens)."""
    eos_before = (tokens == EOS).long().cumsum(1) - (tokens == EOS).long()  # EOS strictly before l
    return eos_before == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8).filter(lambda w: sum(w) > 0))
def test_pit_intervals_tile_unit_interval_in_descending_probability_then_id_order(weights):
    vocab = len(weights)
    p = torch.tensor(weights, dtype=torch.float64) / sum(weights)  # [V], with ties and zeros
    probs = p.expand(1, vocab, vocab)  # [1, V, V]: position l scores token l
    tokens = torch.arange(vocab)[None]  # [1, V]
    low = randomized_pit(probs, tokens, torch.zeros(1, vocab, dtype=torch.float64))[0].tolist()  # [V]
    high = randomized_pit(probs, tokens, torch.ones(1, vocab, dtype=torch.float64))[0].tolist()  # [V]
    possible = [x for x in range(vocab) if weights[x] > 0]
    assert all(math.isnan(low[x]) for x in range(vocab) if weights[x] == 0)
    order = sorted(possible, key=lambda x: (-weights[x], x))
    assert low[order[0]] == 0.0
    for before, after in zip(order, order[1:]):
        assert high[before] == pytest.approx(low[after], abs=1e-12)
    assert high[order[-1]] == pytest.approx(1.0, abs=1e-12)


def test_ties_are_ranked_by_token_id():
    probs = torch.tensor([0.1, 0.4, 0.1, 0.4], dtype=torch.float64).expand(1, 4, 4)
    tokens = torch.tensor([[1, 3, 0, 2]])
    u = randomized_pit(probs, tokens, torch.zeros(1, 4, dtype=torch.float64))
    # order: id 1 (0.4), id 3 (0.4), id 0 (0.1), id 2 (0.1)
    assert u[0].tolist() == pytest.approx([0.0, 0.4, 0.8, 0.9])


N, L, V = 400, 16, 50


def test_exact_samples_give_uniform_pits_and_pass():
    probs = _random_target(N, L, V, seed=10)
    tokens = _sample(probs, seed=11)
    mask = _before_eos(tokens)
    u = randomized_pit(probs, tokens, _uniforms((N, L), seed=12))
    results = pit_tests(u, mask, alpha=0.01, power=0.99, target_tv=0.06)
    # no slots: the slot test has nothing to test, so it is not run and the others share alpha
    assert [r.name for r in results] == [
        "pit.support",
        "pit.pooled_chisquare",
        "pit.pooled_ks",
        "pit.position_chisquare",
        "pit.pair_chisquare",
    ]
    assert sum(r.alpha for r in results) == pytest.approx(0.01) and results[1].alpha == pytest.approx(0.01 / 4)
    with_slots = pit_tests(u, mask, alpha=0.01, power=0.99, target_tv=0.06, slots=torch.zeros(N, L, dtype=torch.long))
    assert [r.name for r in with_slots][4] == "pit.slot_chisquare" and with_slots[1].alpha == pytest.approx(0.01 / 5)
    assert all(r.passed for r in results), (
        "exact samples failed; false-failure probability <= alpha = 0.01 (Bonferroni over the tests):\n"
        + "\n".join(r.message() for r in results)
    )
    ks = stats.kstest(u[mask].numpy(), "uniform").pvalue
    assert ks > 1e-3, f"KS p = {ks:.3g} <= 1e-3: PIT values not U(0, 1); false-failure probability 1e-3"


def _binned_pit_law(p: torch.Tensor, q: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Exact law [n_bins] of the PIT under p of tokens drawn from q (both [n, length, V]),
    pooled over rows and positions: density q(x)/p(x) on the interval of x."""
    p_sorted, order = torch.sort(p, dim=-1, descending=True, stable=True)  # ties keep id order
    high = p_sorted.cumsum(-1)  # [n, length, V]
    low = high - p_sorted
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)  # [B + 1]
    overlap = (torch.minimum(high[..., None], edges[1:]) - torch.maximum(low[..., None], edges[:-1])).clamp(min=0)
    density = q.gather(-1, order) / p_sorted  # [n, length, V]
    return (density[..., None] * overlap).sum(-2).reshape(-1, n_bins).mean(0)


def test_sharpened_sampling_distribution_is_detected_as_predicted():
    probs = _random_target(N, L, V, seed=10)
    sharpened = probs**1.1 / (probs**1.1).sum(-1, keepdim=True)  # a temperature of 1/1.1 applied to q only
    tokens = _sample(sharpened, seed=11)
    u = randomized_pit(probs, tokens, _uniforms((N, L), seed=12))
    results = {
        r.name: r for r in pit_tests(u, torch.ones(N, L, dtype=torch.bool), alpha=0.01, power=0.99, target_tv=0.06)
    }
    chisquare = results["pit.pooled_chisquare"]
    law = _binned_pit_law(probs, sharpened, 10)  # [10]
    assert 0.5 * (law - 0.1).abs().sum() > chisquare.detectable["tv"]  # binned TV the test guarantees to catch
    assert predicted_power(torch.full((10,), 0.1), law, N * L, chisquare.alpha) > 0.999
    missed = "the sharpened q was missed; false-failure probability"
    assert not chisquare.passed, f"{missed} < 1e-3 (1 - predicted power)\n{chisquare.message()}"
    ks = results["pit.pooled_ks"]
    ks_distance = float((law.cumsum(0) - torch.linspace(0.1, 1, 10, dtype=torch.float64)).abs().max())  # a lower bound
    assert not ks.passed, (
        f"{missed} <= 1 - 0.99 if the law's Kolmogorov distance (>= {ks_distance:.3g}) is at least the "
        f"detectable {ks.detectable['ks']:.3g}\n{ks.message()}"
    )


def test_distortion_at_one_position_fails_the_position_test():
    probs = _random_target(N, L, V, seed=20)
    sampling = probs.clone()
    sampling[:, 5] = 1.0 / V  # position 5 sampled uniformly instead of from the target
    tokens = _sample(sampling, seed=21)
    u = randomized_pit(probs, tokens, _uniforms((N, L), seed=22))
    mask = torch.ones(N, L, dtype=torch.bool)
    results = {r.name: r for r in pit_tests(u, mask, alpha=0.01, power=0.99, target_tv=0.06)}
    position = results["pit.position_chisquare"]
    tv = 0.5 * float((_binned_pit_law(probs[:, 5:6], sampling[:, 5:6], 10) - 0.1).abs().sum())
    assert not position.passed, (
        f"position 5 was missed; false-failure probability <= 1 - 0.99 if its binned TV ({tv:.3g}) is at "
        f"least the detectable {position.detectable['tv_one_position']:.3g}\n{position.message()}"
    )
    assert "position 5" in position.observed


def test_token_of_probability_zero_fails_the_support_check():
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64).expand(2000, 3, 3)
    tokens = _sample(probs, seed=30)
    tokens[7, 1] = 2
    u = randomized_pit(probs, tokens, _uniforms((2000, 3), seed=31))
    results = pit_tests(u, torch.ones(2000, 3, dtype=torch.bool), alpha=0.01, power=0.99, target_tv=0.1)
    support = results[0]
    assert not support.passed and support.statistic == 1.0, support.message()
    assert all(r.passed for r in results[1:]), (  # one bad token among 6000 does not move the rest
        "the other 5999 tokens follow the law; false-failure probability <= alpha = 0.01:\n"
        + "\n".join(r.message() for r in results[1:] if not r.passed)
    )


def test_too_few_pit_values_raise_underpowered_with_the_needed_n():
    u = _uniforms((50, 4), seed=40)
    with pytest.raises(UnderpoweredError, match=r"n = 200 PIT values.*needs n >= \d+ PIT values"):
        pit_tests(u, torch.ones(50, 4, dtype=torch.bool), alpha=0.01, power=0.99, target_tv=0.05)


def test_a_token_of_probability_zero_fails_even_a_sample_too_small_for_the_pooled_tests():
    """An impossible token is a failure at any sample size: too few values for the pooled TV
    would raise UnderpoweredError, but a sample with a token outside the support fails instead —
    and with no other value at all, pit.support is the one result."""
    u = _uniforms((50, 4), seed=42)
    u[3, 2] = float("nan")  # randomized_pit's mark of a token of probability 0
    mask = torch.ones(50, 4, dtype=torch.bool)
    results = pit_tests(u, mask, alpha=0.01, power=0.99, target_tv=0.05)
    assert results[0].name == "pit.support" and not results[0].passed, results[0].message()
    (only,) = pit_tests(torch.full((2, 2), float("nan")), torch.ones(2, 2, dtype=torch.bool), 0.01, 0.99, 0.05)
    assert only.name == "pit.support" and not only.passed


def test_pit_required_values_is_the_smallest_sample_the_pooled_tests_accept():
    needed = pit_required_values(alpha=0.01, power=0.99, target_tv=0.05, missing=frozenset({SLOTS, ROW_STREAMS}))
    assert needed < pit_required_values(alpha=0.01, power=0.99, target_tv=0.05)  # a slot test shares alpha
    u = _uniforms((needed, 1), seed=41)
    pit_tests(u, torch.ones(needed, 1, dtype=torch.bool), alpha=0.01, power=0.99, target_tv=0.05)
    with pytest.raises(UnderpoweredError, match=f"needs n >= {needed} PIT values"):
        pit_tests(u[1:], torch.ones(needed - 1, 1, dtype=torch.bool), alpha=0.01, power=0.99, target_tv=0.05)


def test_eos_mask_keeps_the_level():
    """Under H0 with an EOS token on the first bin of [0, 1] (the worst case for pooling a
    predictable mask), each test's rejection rate at level 0.05 stays binomially near 0.05."""
    reps, n, length, level = 300, 100, 20, 0.05
    u = _uniforms((reps, n, length), seed=50)
    eos = u < 0.1  # EOS is the most probable token, p = 0.1: its PIT interval is [0, 0.1)
    mask = (eos.long().cumsum(2) - eos.long()) == 0  # [reps, n, length]
    spare = _uniforms((reps, n, length), seed=51)
    slots = torch.arange(length).remainder(4).expand(n, -1)  # slots fixed in advance, as in rounds of 4
    p_values = torch.tensor(
        [
            [
                r.p_value
                for r in pit_tests(
                    u[i], mask[i], alpha=5 * level, power=0.9, target_tv=1.0, slots=slots, spare=spare[i]
                )[1:]
            ]
            for i in range(reps)
        ]
    )  # [reps, 5]
    rates = (p_values <= level).double().mean(0)
    bound = level + 3 * math.sqrt(level * (1 - level) / reps)  # 26 rejections of 300 at most
    assert (rates <= bound).all(), (
        f"rejection rates {rates.tolist()} above {bound:.3f} (level {level}, {reps} reps); false-failure "
        "probability 2.6e-3 per test at level exactly 0.05 (P(Binomial(300, 0.05) >= 27)), <= 0.013 for the 5"
    )


def test_a_distortion_at_one_slot_fails_the_slot_test():
    """Rounds of 4: the token at slot 3 of every round is drawn uniformly instead of from p."""
    probs = _random_target(N, L, V, seed=60)
    slots = torch.arange(L).remainder(4).expand(N, -1)
    sampling = torch.where((slots == 3)[..., None], torch.full_like(probs, 1.0 / V), probs)
    tokens = _sample(sampling, seed=61)
    u = randomized_pit(probs, tokens, _uniforms((N, L), seed=62))
    results = {r.name: r for r in pit_tests(u, torch.ones(N, L, dtype=torch.bool), 0.01, 0.99, 0.06, slots=slots)}
    slot = results["pit.slot_chisquare"]
    assert not slot.passed and "slot 3" in slot.observed, (
        f"slot 3 missed; false-failure probability <= 1 - 0.99 when its binned TV exceeds the detectable "
        f"{slot.detectable['tv_one_slot']:.3g}\n{slot.message()}"
    )


def test_randomness_reused_across_steps_fails_the_pair_test_only():
    """u_{2m+1} = 1 - u_{2m}: every value uniform (pooled tests pass), every pair on the anti-diagonal."""
    first = _uniforms((4000, 8), seed=70)
    u = torch.stack([first, 1 - first], dim=-1).reshape(4000, 16)
    results = {r.name: r for r in pit_tests(u, torch.ones(4000, 16, dtype=torch.bool), 0.01, 0.99, 0.05)}
    assert results["pit.pooled_chisquare"].passed and results["pit.pooled_ks"].passed, (
        "the marginal is exactly uniform; false-failure probability <= alpha"
    )
    assert not results["pit.pair_chisquare"].passed, results["pit.pair_chisquare"].message()
    pair = results["pit.pair_chisquare"]
    assert pair.p_value == 0.0 and pair.log10_p < -1000, "the p-value underflows; its log10 is kept"
    assert f"p = <= 10^{pair.log10_p:.1f}" in pair.message() and pair.to_dict()["log10_p"] == pair.log10_p
