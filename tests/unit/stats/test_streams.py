"""The stream tests (`losscheck.stats.streams`): the Poisson-binomial count tests against scipy's
binomial where every probability is equal, the greedy-fallback test against a planted verifier
that returns the argmax at T > 0 (and not against the correct one), the repeat law by hand, and
the tests run by `pit_tests` only when the rows' stream values are given, and the stopping-time
test's level and power on rows whose hazard is known."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from scipy import stats

from losscheck.core.sampling import SamplingParams
from losscheck.core.verify import verify_block
from losscheck.errors import LosscheckError
from losscheck.selftest.verifiers import verify_greedy_at_any_temperature
from losscheck.stats import registry
from losscheck.stats.pit import pit_tests, randomized_pit
from losscheck.stats.streams import (
    EXACT_EVENTS,
    StreamValues,
    _tail,
    detectable_correlation,
    detectable_share,
    greedy_fallback,
    repeat_law,
    serial,
    stop_hazard,
    stop_hazard_p_value,
    top_tokens,
)

ALPHA, POWER = 1e-3, 0.9


@pytest.mark.parametrize("n", [50, EXACT_EVENTS + 1000])
def test_the_count_tail_is_the_binomial_one_when_every_probability_is_equal(n):
    """Exact (scipy's Poisson-binomial) up to EXACT_EVENTS, Hoeffding's binomial bound past it:
    both the binomial tail itself when every probability is equal."""
    p = np.full(n, 0.3)
    for count in (int(0.3 * n) + 1, int(0.3 * n + 2 * math.sqrt(0.21 * n))):
        assert _tail(count, p) == pytest.approx(stats.binom.sf(count - 1, n, 0.3), rel=1e-6)
    assert _tail(0, p) == 1.0 and _tail(n + 1, p) == 0.0


def test_past_the_exact_size_the_tail_of_rare_events_is_never_understated():
    """Rare repeats (each probability ~1e-4): the bound is at least the exact Poisson-binomial
    tail, where a normal law would put a single repeat at p ~ 1e-20."""
    gen = np.random.default_rng(0)
    p = gen.uniform(0, 2e-4, EXACT_EVENTS + 500)
    for count in (1, 2, 3):
        exact = float(stats.poisson_binom.sf(count - 1, p))
        assert exact <= _tail(count, p) <= 1.0
    assert _tail(2, p) < 0.05  # still a test: two repeats where 0.25 are expected


def test_the_detectable_share_is_where_the_power_is_reached():
    """At the stated share ρ the test rejects with probability `POWER` (scipy's binomial power at
    the critical count), and below it with less."""
    n, p0 = 400, 0.2
    probs = np.full(n, p0)
    rho = detectable_share(probs, ALPHA, POWER)
    critical = int(stats.binom.isf(ALPHA, n, p0)) + 1  # the smallest count with tail <= ALPHA
    assert stats.binom.sf(critical - 1, n, p0) <= ALPHA
    assert stats.binom.sf(critical - 1, n, rho + (1 - rho) * p0) == pytest.approx(POWER, abs=2e-3)
    assert stats.binom.sf(critical - 1, n, 0.8 * rho + (1 - 0.8 * rho) * p0) < POWER
    # tokens the target is sure of carry no evidence: nothing is detectable
    assert detectable_share(np.ones(n), ALPHA, POWER) == math.inf


def test_detectable_correlation_shrinks_with_pairs():
    assert detectable_correlation(3, ALPHA, POWER) == math.inf
    assert 0 < detectable_correlation(1000, ALPHA, POWER) < detectable_correlation(100, ALPHA, POWER) < 1


def _block_stream_values(verifier, blocks: int = 300, k: int = 4, vocab: int = 12, seed: int = 0) -> StreamValues:
    """One round of `verifier` per block at T = 1 on random p and q: the emitted tokens (slots up
    to the stopping one), each with its target law p at its slot."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(blocks, k + 1, vocab, generator=gen, dtype=torch.float64) * 1.5  # [B, k+1, V]
    q = torch.softmax(torch.randn(blocks, k, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)  # [B, k, V]
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(blocks, k)  # [B, k]
    params = SamplingParams(temperature=1.0)
    out = verifier(logits, drafts, q, params, gen)
    emitted = torch.arange(k + 1)[None, :] <= out.accepted[:, None]  # [B, k+1]
    p = torch.softmax(logits, -1)  # [B, k+1, V]
    top, at_top = top_tokens(p, out.tokens)
    u = randomized_pit(p[:, :1], out.tokens[:, :1], torch.rand(blocks, 1, generator=gen, dtype=torch.float64))
    return StreamValues(
        top=top,
        at_top=at_top,
        tested=emitted,
        repeats=torch.zeros(blocks, dtype=torch.bool),
        repeat_law=torch.zeros(blocks, dtype=torch.float64),
        first_u=u[:, 0],
    )


def test_greedy_fallback_catches_a_verifier_returning_the_argmax_at_T1():
    """The planted bug emits the greedy path: every token its top token, against ~30% expected
    (p = 0 in double precision); the correct verifier, same draws, passes. Power at T = 1 is near
    certain: the test detects a share of forced argmax tokens well under 1."""
    bug = greedy_fallback(_block_stream_values(verify_greedy_at_any_temperature), ALPHA, POWER)
    assert not bug.passed and bug.statistic == bug.n, bug.message()
    assert bug.p_value < 1e-12
    correct = greedy_fallback(_block_stream_values(verify_block), ALPHA, POWER)
    assert correct.passed, correct.message()
    assert correct.detectable["argmax_share"] < 0.2, correct.message()


def test_repeat_law_sums_the_distinct_earlier_outputs_of_each_prompt():
    keys = [("a", (1,)), ("a", (2,)), ("b", (1,)), ("a", (1,)), ("a", (2,)), ("a", (1,))]
    logp = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.2, 0.1]).log()
    hit, law = repeat_law(keys, logp)
    assert hit.tolist() == [False, False, False, True, True, True]
    assert law.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.3, 0.3, 0.3])
    with pytest.raises(LosscheckError, match="2 rows but 1 log probabilities"):
        repeat_law(keys[:2], logp[:1])


def test_serial_catches_consecutive_rows_sharing_their_uniform_and_passes_independent_ones():
    gen = torch.Generator().manual_seed(3)
    n = 400
    fresh = torch.rand(n, generator=gen, dtype=torch.float64)
    shared = fresh.clone()
    shared[1::2] = (fresh[0::2] + 0.02 * torch.rand(n // 2, generator=gen, dtype=torch.float64)).clamp(max=1 - 1e-9)

    def values(first_u: torch.Tensor) -> StreamValues:
        ones = torch.ones(n, 1, dtype=torch.bool)
        zeros = torch.zeros(n, dtype=torch.float64)
        return StreamValues(ones.double(), ones, ones, ones[:, 0] & False, zeros, first_u)

    assert serial(values(fresh), ALPHA, POWER).passed
    caught = serial(values(shared), ALPHA, POWER)
    assert not caught.passed and caught.statistic > 0.9, caught.message()


def test_pit_tests_run_the_stream_tests_only_with_stream_values():
    """Without stream values the PIT family's split is as before (no share for them); with them
    each takes one share."""
    values = _block_stream_values(verify_block, blocks=2000)
    u = torch.rand(values.top.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    without = pit_tests(u, values.tested, 0.01, POWER, None)
    with_streams = pit_tests(u, values.tested, 0.01, POWER, None, streams=values)
    names = {r.name for r in with_streams} - {r.name for r in without}
    assert names == {"pit.greedy_fallback", "pit.row_repeats", "pit.row_serial", "pit.stop_hazard"}
    assert registry.budget_count("pit", missing=frozenset({registry.SLOTS})) == len(
        [r for r in with_streams if r.alpha > 0]
    )
    assert without[1].alpha > with_streams[1].alpha  # the shares of four more tests


def test_stream_values_check_their_shapes():
    ones = torch.ones(3, 2)
    with pytest.raises(LosscheckError, match=r"StreamValues.repeats must have shape \(3,\)"):
        StreamValues(ones, ones.bool(), ones.bool(), torch.zeros(2, dtype=torch.bool), ones[:, 0], ones[:, 0])


def test_an_output_with_a_cut_off_uncertain_token_counts_it_at_probability_one():
    """A token one cut-off implementation keeps and another cuts has p = 0 under the conditioned
    law; read as 0 it would make a repeat of its output look impossible (a false alarm)."""
    from losscheck.stats.streams import output_logp

    p = torch.tensor([[[0.5, 0.5, 0.0], [0.25, 0.75, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)  # [1, 3, 3]
    tokens = torch.tensor([[1, 2, 0]])
    generated = torch.tensor([[True, True, False]])
    left_out = torch.tensor([[False, True, False]])
    assert output_logp(p, tokens, generated, left_out).exp().item() == pytest.approx(0.5)
    assert output_logp(p, tokens, generated, ~left_out & False).exp().item() == pytest.approx(0.0, abs=1e-200)


def _stopping_rows(hazard: torch.Tensor, reps: int, lost: float, seed: int) -> StreamValues:
    """`reps` independent samples of rows [reps, N, L] whose position t ends the row with
    probability hazard[n, t] · (1 - `lost`) (a share `lost` of end events lost), read against the
    target's `hazard`: the row runs to its first end, that position included."""
    gen = torch.Generator().manual_seed(seed)
    n, length = hazard.shape
    ended = torch.rand(reps, n, length, generator=gen, dtype=torch.float64) < hazard * (1 - lost)  # [R, N, L]
    first = torch.where(ended.any(-1), ended.float().argmax(-1), length)  # [R, N]: the end, or L (none)
    tested = torch.arange(length)[None, None, :] <= first[..., None]  # [R, N, L]
    at_end = torch.arange(length)[None, None, :] == first[..., None]
    flat = tested.reshape(reps * n, length)
    ones = torch.ones(reps * n, length)
    zeros = torch.zeros(reps * n, dtype=torch.float64)
    return StreamValues(
        ones.double(), ones.bool(), flat, zeros.bool(), zeros, zeros, 1.0,
        hazard.repeat(reps, 1).double(), at_end.reshape(reps * n, length),
    )  # fmt: skip


def _rejections(hazard: torch.Tensor, lost: float, alpha: float, seed: int, runs: int = 200) -> float:
    """The share of `runs` samples whose stopping-time test rejects at `alpha` (its p-value alone:
    `stop_hazard`'s search for its detectable share would cost 10x the draws)."""
    values = _stopping_rows(hazard, runs, lost, seed)
    rows = hazard.shape[0]
    rejected = 0
    for r in range(runs):
        part = slice(r * rows, (r + 1) * rows)
        one = StreamValues(
            values.top[part], values.at_top[part], values.tested[part], values.repeats[part],
            values.repeat_law[part], values.first_u[part], 1.0, values.end_p[part], values.at_end[part],
        )  # fmt: skip
        rejected += stop_hazard_p_value(one) <= alpha
    return rejected / runs


@pytest.mark.parametrize("rows", [60, 400])  # exact Poisson-binomial, and Hoeffding's bound past EXACT_EVENTS
def test_the_stopping_time_test_keeps_its_level_and_reaches_its_stated_power(rows):
    """200 samples of rows with a known hazard per position (0 under a min-tokens mask, then 2-20%):
    under H0 it rejects at most at its α (with 3 sd of binomial noise); with the share of end events
    lost it states as detectable at power 0.9, it rejects at least 0.9 of the time (3 sd below)."""
    alpha = 0.05
    gen = torch.Generator().manual_seed(rows)
    hazard = 0.02 + 0.18 * torch.rand(rows, 16, generator=gen, dtype=torch.float64)
    hazard[:, :4] = 0.0  # min tokens: no end before position 4
    level = _rejections(hazard, 0.0, alpha, seed=1)
    assert level <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / 200), level
    one = _stopping_rows(hazard, 1, 0.0, seed=2)
    result = stop_hazard(one, alpha, POWER)
    assert result.p_value == stop_hazard_p_value(one)  # the p-value the Monte Carlo draws
    rho = result.detectable["stop_loss_share"]
    assert 0 < rho < 1, rho
    caught = _rejections(hazard, rho, alpha, seed=3)
    assert caught >= POWER - 3 * math.sqrt(POWER * (1 - POWER) / 200), (rho, caught)


def test_the_stopping_time_test_catches_forced_stops_and_reads_the_slack_against_itself():
    gen = torch.Generator().manual_seed(5)
    hazard = 0.05 + 0.1 * torch.rand(300, 12, generator=gen, dtype=torch.float64)
    early = _stopping_rows(hazard * 1.6, 1, 0.0, seed=6)  # rows stopping 1.6x as often as the target says
    read = dataclasses.replace(early, end_p=hazard.double())
    assert not stop_hazard(read, ALPHA, POWER).passed
    # a reference off by a factor within the precision's slack cannot fail it
    assert stop_hazard(dataclasses.replace(read, slack=1.7), ALPHA, POWER).passed
    unscored = stop_hazard(dataclasses.replace(read, end_p=None, at_end=None), ALPHA, POWER)
    assert unscored.passed and unscored.detectable == {"stop_loss_share": math.inf}, unscored
    with pytest.raises(LosscheckError, match="give end_p and at_end together"):
        dataclasses.replace(read, at_end=None)
