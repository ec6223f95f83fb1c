"""The two-sample position tests' power against the target-side bug classes
(`losscheck.stats.two_sample_power`): the binned effect by hand, no effect where there is no bug,
and the rows it asks for checked by Monte Carlo against the real tests (`two_sample_tests`)."""

from __future__ import annotations

import math

import pytest
import torch

from losscheck.stats.buglaws import BY_NAME, tempered
from losscheck.stats.registry import TWO_SAMPLE, split
from losscheck.stats.two_sample import two_sample_tests
from losscheck.stats.two_sample_power import MarginalSums, target_side_law

HOT = BY_NAME["target_temperature_1.1"]
MAX_BINS = 20


def _kinds(vocab: int = 12, kinds: int = 3, seed: int = 0) -> torch.Tensor:
    """[kinds, L=2, V] laws: a row's prefix kind decides its law at both positions."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(kinds, 2, vocab, generator=generator, dtype=torch.float64)
    return logits.softmax(-1)


def test_the_binned_effect_is_the_chi_square_divergence_of_the_marginals():
    laws = _kinds()  # [3, 2, V]
    sums = MarginalSums(classes=(HOT,))
    sums.add(laws, torch.ones(3, 2, dtype=torch.bool))
    m = laws.mean(0)  # [2, V]
    bugged = tempered(laws, 1 / 1.1).mean(0)
    pooled = (m + bugged) / 2
    # with rows enough for every id to get a bin, w² is the χ² divergence on the ids themselves
    expected = ((bugged - m) ** 2 / pooled).sum(-1)
    assert torch.allclose(sums.w2(HOT.name, 1e9, MAX_BINS), expected)
    # with few rows the rare ids share one bucket: w² can only shrink
    assert bool((sums.w2(HOT.name, 50, MAX_BINS) <= expected + 1e-15).all())


def test_no_bug_no_power():
    uniform = torch.full((4, 2, 8), 1 / 8, dtype=torch.float64)  # tempering a uniform law changes nothing
    sums = MarginalSums(classes=(HOT,))
    sums.add(uniform, torch.ones(4, 2, dtype=torch.bool))
    assert sums.rows_needed(HOT.name, 1e-3, 0.9, MAX_BINS, cap=10**6) == math.inf


def test_a_class_that_reads_more_than_p_is_refused():
    from losscheck.errors import LosscheckError

    with pytest.raises(LosscheckError, match="reads more than p"):
        target_side_law(BY_NAME["residual_is_p"], torch.full((2, 4), 0.25, dtype=torch.float64))


def test_the_rows_it_asks_for_reach_the_power_in_the_real_tests():
    """Rows of three prefix kinds, tokens drawn from each kind's law (speculation off) or from it at
    1.1·T (the bug): at the rows the model asks for at power 0.9, the real per-position tests
    reject in at least 85% of 200 draws (binomial sd 2%); at a quarter of them, in fewer (the
    figure is not vacuous)."""
    laws, alpha, power = _kinds(), 0.01, 0.9
    alpha_test = split(alpha, TWO_SAMPLE, positions=2).per_test
    sums = MarginalSums(classes=(HOT,))
    sums.add(laws, torch.ones(3, 2, dtype=torch.bool))
    rows = int(sums.rows_needed(HOT.name, alpha_test, power, MAX_BINS, cap=10**6))
    assert sums.power_at(HOT.name, rows, alpha_test, MAX_BINS) >= power
    generator = torch.Generator().manual_seed(20261204)
    bugged = tempered(laws, 1 / 1.1)

    def rejected(n: int) -> float:
        caught = 0
        for _ in range(200):
            kinds = torch.randint(0, 3, (2, n), generator=generator)
            plain, spec = (
                torch.stack([torch.multinomial(law[row, at], 1, generator=generator)[:, 0] for at in (0, 1)], 1)
                for law, row in ((laws, kinds[0]), (bugged, kinds[1]))
            )
            results = two_sample_tests(spec, plain, 12, alpha, power, 0.5, max_bins=MAX_BINS)
            caught += any(not r.passed for r in results if r.name.startswith("two_sample.position"))
        return caught / 200

    assert rejected(rows) >= 0.85, rows
    assert rejected(rows // 4) < 0.85, rows


def _scored(laws: torch.Tensor, drawn_from: torch.Tensor, generator: torch.Generator):
    """SurprisalSums over rows whose tokens are drawn from `drawn_from` [n, L, V] and scored under `laws`."""
    from losscheck.stats.two_sample_power import SurprisalSums

    tokens = torch.multinomial(drawn_from.flatten(0, 1), 1, generator=generator).view(drawn_from.shape[:2])
    sums = SurprisalSums(classes=(HOT,))
    sums.add(laws, torch.ones(tokens.shape, dtype=torch.bool), tokens)
    return sums


def test_a_proxy_that_is_the_rows_law_centres_their_scores_and_another_checkpoint_does_not():
    """Rows of 16 positions over 12 ids, 400 rows a draw. Tokens drawn from the proxy's own law: the
    mean score's z exceeds `PROXY_Z` (two-sided 1e-3) in at most the binomial 0.999 bound of 300
    draws, and the measured variance is the model's within 15%. Tokens drawn from another law
    (logits + N(0, 1) noise, KL about 0.3 nats a token, as another checkpoint): |z| beyond it in
    every one of 20 draws; and the effect is read against the larger of the model's and the measured
    variance."""
    from scipy import stats

    from losscheck.cells.engine.proxy import PROXY_Z

    generator = torch.Generator().manual_seed(20261205)
    logits = 1.5 * torch.randn(400, 16, 12, generator=generator, dtype=torch.float64)
    laws = logits.softmax(-1)
    draws, beyond, ratios = 300, 0, []
    for _ in range(draws):
        sums = _scored(laws, laws, generator)
        z = sums.centre_z()
        assert z is not None
        beyond += abs(z) > PROXY_Z
        ratios.append(sums.measured_ratio())
    assert beyond <= stats.binom.ppf(0.999, draws, 2 * stats.norm.sf(PROXY_Z)), beyond
    assert abs(sum(ratios) / draws - 1) < 0.15, sum(ratios) / draws
    other = (logits + torch.randn(logits.shape, generator=generator, dtype=torch.float64)).softmax(-1)
    kl = float((other * (other.log() - laws.log())).sum(-1).mean())
    assert 0.1 < kl < 1.0, kl
    for _ in range(20):
        sums = _scored(laws, other, generator)
        z = sums.centre_z()
        assert z is not None and abs(z) > PROXY_Z, z
    from losscheck.stats.two_sample_power import SurprisalSums

    model = SurprisalSums(classes=(HOT,))
    model.add(laws, torch.ones(laws.shape[:2], dtype=torch.bool))  # no tokens: the model's variance alone
    assert model.measured_ratio() == 1.0
    expected = model.effect(HOT.name) / math.sqrt(max(1.0, sums.measured_ratio()))
    assert sums.effect(HOT.name) == pytest.approx(expected, rel=1e-12)
