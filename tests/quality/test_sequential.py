"""Sequential stopping (`losscheck.stats.sequential`): the looks, the rule-out e-values the
accumulator keeps, Ville's bound under each bug class, and what ruling out costs under H0 — on the
Markov chains of `losscheck.selftest.bugtable`, where every law is exact."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.selftest import bugtable
from losscheck.stats import sequential
from losscheck.stats.buglaws import BY_NAME, chunk_steps

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, SEED, REPLICATES = 150, 11, 400
MISREPORTED = 5


def test_looks_grow_from_the_floor_to_the_design():
    assert sequential.look_tokens(2000, 11560, limit=7) == (2000, 3000, 4500, 6750, 10125, 11560)
    assert sequential.look_tokens(2000, 2000, limit=7) == (2000,)
    assert sequential.look_tokens(2000, 1500, limit=7) == (1500,)
    assert sequential.look_tokens(1000, 20000, limit=3) == (11393, 17090, 20000)  # the earliest dropped
    assert sequential.max_looks(2000, 20000) == 7
    with pytest.raises(LosscheckError, match="floor, tokens and limit"):
        sequential.look_tokens(0, 10, 2)


def test_the_power_is_split_between_ruling_out_and_the_last_look():
    assert sequential.design_power(0.99) == pytest.approx(0.995)
    assert sequential.rule_out_threshold(0.99) == pytest.approx(math.log(200))
    looks = sequential.Looks((2000, 4000), 5, ("a", "b"), ("c",), 0.99)
    assert looks.thresholds() == {
        "a": pytest.approx(math.log(200)),
        "b": pytest.approx(math.log(200)),
        "c": pytest.approx(math.log(10)),
    }
    assert looks.may_stop({"a": 6.0, "b": 5.4, "c": 2.4})
    assert not looks.may_stop({"a": 6.0, "b": 5.2, "c": 2.4})
    assert not looks.may_stop({"a": 6.0, "b": 5.4, "c": 2.2})  # a partly reached class at β_p = 0.1
    assert not looks.may_stop({"a": 6.0, "b": None, "c": 2.4})  # a class the cell cannot evaluate never stops it
    assert looks.ruled_out({"a": 6.0, "b": None, "c": 0.0, "d": 9.0}) == {"a": True, "b": False, "c": False}


def test_a_pilot_may_fix_a_covered_members_beta_r_below_the_default():
    """β_r from what the pilot predicts of the member's log rule-out e-value at the first look, μ:
    the threshold μ - 2.5·√(2μ), between the default's log(200) and log(200 · 100)."""
    default = (1 - 0.99) * sequential.RULE_OUT_SHARE
    assert sequential.rule_out_beta(0.99, None) == pytest.approx(default)
    assert sequential.rule_out_beta(0.99, 14.0) == pytest.approx(default)  # 14 - 2.5·√28 = 0.8, below log 200
    assert sequential.rule_out_beta(0.99, 24.0) == pytest.approx(math.exp(-(24 - 2.5 * math.sqrt(48))))
    assert sequential.rule_out_beta(0.99, 500.0) == pytest.approx(default / sequential.RULE_OUT_SHRINK)
    assert sequential.rule_out_beta(0.99, math.inf) == pytest.approx(default / sequential.RULE_OUT_SHRINK)
    for unknown in (math.nan, -3.0):
        assert sequential.rule_out_beta(0.99, unknown) == pytest.approx(default)
    looks = sequential.Looks((500, 1000), 5, ("a", "b"), ("c",), 0.99, betas={"a": math.exp(-7.0)})
    assert looks.thresholds() == {
        "a": pytest.approx(7.0),
        "b": pytest.approx(math.log(200)),
        "c": pytest.approx(math.log(10)),
    }
    assert not looks.may_stop({"a": 6.0, "b": 5.4, "c": 2.4})  # a's β_r is e^-7 now
    # the last look's tests keep 1 - β + β_r: the profile's power after a wrong rule-out
    assert looks.promise("a") == pytest.approx(0.99 + math.exp(-7.0))
    assert looks.promise("b") == pytest.approx(sequential.design_power(0.99))


@functools.cache
def _run() -> tuple[bugtable.Chain, bugtable.Steps]:
    chain = bugtable.make_chain(0.88, seed=SEED)
    return chain, bugtable.simulate(chain, rows=ROWS, seed=SEED + 1)


def _tables(chain: bugtable.Chain, steps: bugtable.Steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, q and the previous round's exact q [N, L, V] of the run's steps."""
    drafted = (steps.slots < bugtable.K)[..., None]
    p = chain.p[steps.before]
    q = torch.where(drafted, chain.q[steps.before], 0.0)
    q_prev = torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0)
    return p, q, q_prev


def _log_ratios(name: str, drawn_from: str | None) -> torch.Tensor:
    """log(p / p'_name) at the run's steps [m, REPLICATES], row-major, the tokens of each
    replicate drawn from class `drawn_from`'s exact law (None: from p, H0) at those steps — the
    bug changes the token, not the steps. p'_name is evaluated as a cell does: the previous
    round's q approximated from the slots, the steps where that is a guess adding nothing."""
    chain, steps = _run()
    p, q, q_prev = _tables(chain, steps)
    every = torch.ones(steps.slots.shape, dtype=torch.bool)
    exact = chunk_steps(p, q, steps.slots, bugtable.K, every, "exact", q_prev=q_prev, misreported=MISREPORTED)
    seen = chunk_steps(p, q, steps.slots, bugtable.K, every, "seen", misreported=MISREPORTED)
    law = exact.p if drawn_from is None else BY_NAME[drawn_from].law(exact)  # [m, V]
    tokens = torch.multinomial(law, REPLICATES, replacement=True, generator=torch.Generator().manual_seed(SEED))
    bug = BY_NAME[name]
    ratio = seen.p.gather(-1, tokens).log() - bug.law(seen).gather(-1, tokens).clamp_min(1e-300).log()
    if bug.reads_q_prev:
        assert seen.q_prev_known is not None
        ratio = torch.where(seen.q_prev_known[:, None], ratio, 0.0)
    return ratio


def _ever_ruled_out(log_ratios: torch.Tensor, beta: float) -> float:
    """Share of replicates whose running log e-value ever reaches log(1/beta)."""
    return float((log_ratios.cumsum(0).amax(0) >= math.log(1 / beta)).double().mean())


VILLE_BETA = 0.05
CLASSES = ("residual_is_p", "stale_q", "target_temperature_1.1", "drafter_misreports_one_id", "top_p_one_side")


@pytest.mark.parametrize("name", CLASSES)
def test_a_class_present_is_ruled_out_at_most_beta_of_the_time(name):
    """Ville: under class `name`'s own law the rule-out e-value ever reaches 1/β with
    probability <= β. Over REPLICATES runs, fail only above Binomial(REPLICATES, β)'s 0.999
    quantile (a correct bound fails with probability <= 0.001)."""
    share = _ever_ruled_out(_log_ratios(name, name), VILLE_BETA)
    bound = stats.binom.ppf(0.999, REPLICATES, VILLE_BETA) / REPLICATES
    assert share <= bound, f"{name} present: ruled out in {share:.3f} of runs; Ville: {VILLE_BETA} (0.999: {bound})"


def test_the_check_fails_when_the_law_is_not_the_bugs():
    """The same check with the tokens from another law (the target at 1.1·T) and the class at
    T = 0.7: the e-value is not a supermartingale there, and it crosses almost always."""
    share = _ever_ruled_out(_log_ratios("per_request_params_mixed", "target_temperature_1.1"), VILLE_BETA)
    assert share > 0.5


def test_under_h0_the_classes_are_ruled_out_long_before_a_test_could_reject_them():
    """Under H0 every class is ruled out at the gate's β_r (power 0.99) in every replicate, at a
    median number of tokens below a third of what its best test needs at the gate's per-test α
    and the design's power: what makes the sequential cell cheaper under H0."""
    chain, steps = _run()
    acc = bugtable.accumulate(chain, steps, misreported=MISREPORTED)
    needed = acc.tokens_needed(bugtable.CELL_ALPHA / 14, sequential.design_power(0.99), looks=5)
    threshold = sequential.rule_out_threshold(0.99)
    for name in CLASSES:
        path = _log_ratios(name, None).cumsum(0)  # [m, R]
        crossed = path >= threshold
        assert bool(crossed.any(0).all()), f"{name}: not ruled out within {len(path)} H0 tokens in some replicate"
        first = crossed.double().argmax(0).double() + 1  # [R]
        best = min(n for test, n in needed[name].items() if test != "lr_bound")
        median = float(first.median())
        assert median < best / 3, f"{name}: ruled out after {median:.0f} H0 tokens (median); its test needs {best:.0f}"


def test_the_accumulator_keeps_the_log_evalue_of_the_emitted_tokens():
    """PowerAccumulator's rule-out sums equal Σ log(p / p') at the run's own tokens, the stale-q
    class counting only the steps whose previous-round q is known, chunk by chunk."""
    chain, steps = _run()
    acc = bugtable.accumulate(chain, steps, chunk=40, misreported=MISREPORTED)
    p, q, _ = _tables(chain, steps)
    every = torch.ones(steps.slots.shape, dtype=torch.bool)
    seen = chunk_steps(p, q, steps.slots, bugtable.K, every, "seen", misreported=MISREPORTED)
    tokens = steps.tokens.reshape(-1, 1)
    for name, log_e in acc.rule_out_log_e().items():
        bug = BY_NAME[name]
        ratio = (seen.p.gather(-1, tokens).log() - bug.law(seen).gather(-1, tokens).clamp_min(1e-300).log()).squeeze(-1)
        if bug.reads_q_prev:
            assert seen.q_prev_known is not None
            ratio = torch.where(seen.q_prev_known, ratio, 0.0)
        assert log_e == pytest.approx(float(ratio.sum()), rel=1e-9, abs=1e-9), name
    misreport = BY_NAME["drafter_misreports_one_id"]
    for v in (0, 3, MISREPORTED):  # the per-id sums at every id, against the explicit law there
        at_v = chunk_steps(p, q, steps.slots, bugtable.K, every, "seen", misreported=v)
        ratio = at_v.p.gather(-1, tokens).log() - misreport.law(at_v).gather(-1, tokens).clamp_min(1e-300).log()
        assert float(acc.rule_out_ids[v]) == pytest.approx(float(ratio.sum()), rel=1e-9, abs=1e-9), v
    evalues = acc.rule_out_log_e([0, 3])
    assert evalues[sequential.id_key("drafter_misreports_one_id", 3)] == pytest.approx(float(acc.rule_out_ids[3]))


def test_the_ids_a_design_covers_are_those_its_count_test_reaches():
    """covered_ids: the count test's tokens at every id it lists are within the design's, and at
    the next most detectable id beyond them; more tokens cover more ids."""
    chain, steps = _run()
    acc = bugtable.accumulate(chain, steps)
    alpha, power = 1e-4, 0.995
    few, many = acc.covered_ids(5_000, alpha, power), acc.covered_ids(20_000, alpha, power)
    assert set(few) < set(many) and len(few) >= 1
    assert acc.covered_ids(1, alpha, power) == []


def test_the_previous_round_is_known_only_where_it_reached_the_slot():
    """Rounds 0 1 2 | 0 | 0 1 2 3 at k = 3: at the third round's slots 1 and 2 the last drafted
    step of the slot is in round 1, two rounds back (round 2 stopped at slot 0): a guess. No
    round drafts the bonus slot, so none is known there (harmless: no law reads q_prev there)."""
    slots = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    p = torch.full((1, 8, 4), 0.25, dtype=torch.float64)
    q = torch.where((slots < 3)[..., None], p, 0.0)
    step = chunk_steps(p, q, slots, 3, torch.ones(1, 8, dtype=torch.bool), "t")
    assert step.q_prev_known is not None
    assert step.q_prev_known.tolist() == [True, True, True, True, True, False, False, False]


def _base_cell(session):
    return next(c for cells in session.plan.values() for c in cells if c.id == "A-k4-T1")


def test_the_real_cell_stops_early_under_h0_and_not_under_its_bug(session):
    """A-k4-T1 of the real loop: unmodified, it stops at an early look with every class it must
    rule out ruled out; with a wrong residual planted (the residual_is_p class itself) the class
    is never ruled out, so the cell draws its whole design and fails."""
    from losscheck.cells.sampled import run_pit
    from losscheck.run.context import CellContext

    cell = _base_cell(session)
    honest = run_pit(CellContext.of(session, cell)).facts
    looks, classes, fixed = honest.looks, honest.bug_classes, honest.fixed_design_tokens
    assert looks is not None and classes is not None and fixed is not None
    assert looks.early and looks.tested_tokens < fixed / 2
    assert all(c.ruled_out for c in classes.values() if c.reach != "none")
    assert all(c.power >= 0.99 for c in classes.values() if c.covered)

    planted = run_pit(CellContext.of(session.derive(mutant="residual_is_p"), cell))
    assert not planted.passed
    looks, classes = planted.facts.looks, planted.facts.bug_classes
    assert looks is not None and classes is not None
    assert not looks.early and not classes["residual_is_p"].ruled_out


@pytest.mark.parametrize(
    ("name", "exact"), [("residual_is_p", True), ("target_temperature_1.1", True), ("top_p_one_side", False)]
)
def test_the_rule_out_rate_a_pilot_predicts_is_the_log_e_values_growth_under_h0(name, exact):
    """`PowerAccumulator.rule_out_rate`, which fixes a member's β_r from a pilot
    (`sequential.rule_out_beta`): at ρ = 1, KL(p‖p') per token over the tokens both laws give
    mass — the mean growth of the log rule-out e-value under H0, over REPLICATES runs of the same
    steps, within 4 standard errors. A class whose law leaves some of p's tokens out
    (`top_p_one_side`) grows faster (each such token adds up to 690 nats): a lower bound there,
    which only keeps β_r nearer the default."""
    chain, steps = _run()
    acc = bugtable.accumulate(chain, steps, misreported=MISREPORTED)
    ratios = _log_ratios(name, None)  # [m, R]
    final = ratios.sum(0)  # [R] the log e-value after every step
    rate = acc.rule_out_rate(name)
    assert rate is not None and rate > 0
    predicted = rate * ratios.shape[0]
    mean, error = float(final.mean()), float(final.std()) / math.sqrt(REPLICATES)
    assert mean > predicted - 4 * error, (mean, predicted, error)
    if exact:
        assert mean < predicted + 4 * error, (mean, predicted, error)


def test_a_pilot_says_whether_a_member_may_be_ruled_out_at_a_look():
    """`may_rule_out`: the predicted log e-value μ, `RULE_OUT_Z` standard deviations up (√(2μ)
    each), against the look's threshold; no prediction, or none above 0, never reaches it."""
    z = sequential.RULE_OUT_Z
    assert not sequential.may_rule_out(None, 5.4)
    assert not sequential.may_rule_out(0.0, 5.4) and not sequential.may_rule_out(-3.0, 0.1)
    assert not sequential.may_rule_out(math.nan, 5.4)
    assert not sequential.may_rule_out(1.0, 5.4)  # 1 + 2.5·√2 = 4.5
    assert sequential.may_rule_out(2.0, 5.4)  # 2 + 2.5·2 = 7
    mu = 1.5
    assert sequential.may_rule_out(mu, mu + z * math.sqrt(2 * mu))
    assert not sequential.may_rule_out(mu, mu + z * math.sqrt(2 * mu) + 1e-9)
