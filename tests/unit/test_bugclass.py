"""Bug-class laws and their power: each law is a distribution equal to p where the bug cannot act,
residual_is_p matches a brute-force run of the planted buggy verifier, the per-id evaluation of
drafter_misreports_one_id matches its explicit law at every id, the power table says what it
should on the synthetic Markov chain of `losscheck.selftest.bugtable`, and its prediction for
pit.bug_classes matches a simulation of that test."""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import pytest
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.selftest import bugtable
from losscheck.selftest.verifiers import verify_recovery_reuses_draft_noise, verify_residual_is_p
from losscheck.stats.bugclass import LR_BOUND, PowerAccumulator
from losscheck.stats.buglaws import (
    BY_NAME,
    CATALOGUE,
    Step,
    _previous_same_slot,
    chunk_steps,
    reused_noise_recovery,
    targeted,
)
from losscheck.stats.bugperid import per_id_sums
from losscheck.stats.bugsums import Tiles
from losscheck.stats.conditional import ConditionalValues, bug_classes_test, surprisal_scores, targeted_scores

V, K = 7, 3
pytestmark = pytest.mark.usefixtures("one_thread")


def _steps(m: int, seed: int) -> Step:
    """m random steps: peaked p, a perturbed q (zero at every 4th step: the bonus slot k), p and q
    of the previous step / round, slots cycling 0..k."""
    g = torch.Generator().manual_seed(seed)

    def law() -> torch.Tensor:
        return torch.softmax(2 * torch.randn(m, V, generator=g, dtype=torch.float64), -1)

    p = law()
    q = torch.softmax(p.log() + torch.randn(m, V, generator=g, dtype=torch.float64), -1)
    slot = torch.arange(m) % (K + 1)
    q = torch.where((slot < K)[:, None], q, 0.0)
    return Step(p=p, q=q, slot=slot, k=K, p_prev=law(), q_prev=law())


def _law(bug, step: Step, misreported: int = 2) -> torch.Tensor:
    return bug.law(Step(**{**step.__dict__, "misreported": misreported}))


@pytest.mark.parametrize("bug", CATALOGUE, ids=lambda b: b.name)
def test_each_law_is_a_distribution_and_p_where_the_bug_cannot_act(bug):
    step = _steps(40, 0)
    law = _law(bug, step)
    assert (law >= 0).all() and torch.allclose(law.sum(-1), torch.ones(40, dtype=torch.float64))
    assert not torch.allclose(law, step.p), f"{bug.name} never acts on random steps"
    # where the bug cannot act: no draft for the draft-slot bugs, no bonus slot for the bonus bug,
    # no previous step / round
    quiet = Step(
        p=step.p,
        q=torch.zeros_like(step.q),
        slot=torch.zeros_like(step.slot),
        k=K,
        p_prev=torch.zeros_like(step.p),
        q_prev=torch.zeros_like(step.p),
    )
    if "temperature" not in bug.name and bug.name != "per_request_params_mixed":
        assert torch.allclose(_law(bug, quiet), step.p), bug.name
    # q equal to p (and to the previous round's q): no rejection, nothing to mis-verify
    if bug.name in ("residual_is_p", "stale_q"):
        same = Step(**{**step.__dict__, "q": step.p, "q_prev": step.p})
        assert torch.allclose(_law(bug, same), step.p), bug.name
    # a point-mass drafter: over-drawing its one id (or any other) leaves the point mass
    if bug.per_id:
        point = torch.nn.functional.one_hot(step.p.argmin(-1), V).double()
        for v in range(V):
            assert torch.allclose(_law(bug, Step(**{**step.__dict__, "q": point}), v), step.p), (bug.name, v)


def test_misreport_needs_the_id():
    with pytest.raises(LosscheckError, match="misreported"):
        BY_NAME["drafter_misreports_one_id"].law(_steps(3, 1))


@pytest.mark.parametrize(
    ("name", "verifier"),
    [("residual_is_p", verify_residual_is_p), ("draft_noise_reused", verify_recovery_reuses_draft_noise)],
)
def test_law_matches_the_planted_buggy_verifier(name, verifier):
    """500k one-draft rounds of the planted verifier at one (p, q): the emitted token's counts
    against the class's law, Pearson χ² at alpha = 1e-4 (a correct law fails with probability 1e-4);
    and against p, which they must reject (the bug acts at this (p, q))."""
    step = _steps(1, 2)
    p, q = step.p[0], step.q[0]
    rounds = 500_000
    g = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(q.expand(rounds, -1), 1, replacement=True, generator=g)  # [R, 1]
    probs = torch.stack([p, torch.softmax(torch.zeros(V, dtype=torch.float64), -1)])  # slot 0, bonus
    outcome = verifier(probs.expand(rounds, -1, -1), drafts, q.expand(rounds, 1, -1), g)
    counts = torch.bincount(outcome.tokens[:, 0], minlength=V).double()
    law = BY_NAME[name].law(Step(p[None], q[None], torch.zeros(1, dtype=torch.long), 1, p[None] * 0, q[None] * 0))
    chi2 = stats.chisquare(counts.numpy(), rounds * law[0].numpy())
    assert chi2.pvalue > 1e-4, (
        f"counts {counts.tolist()} vs expected {(rounds * law[0]).tolist()}: p = {chi2.pvalue:.3g}"
    )
    honest = stats.chisquare(counts.numpy(), rounds * p.numpy())
    assert honest.pvalue < 1e-10, "the buggy verifier's output should differ from p at this (p, q)"


def test_reused_noise_recovery_in_closed_form_matches_the_race():
    """The closed form against 400k draws of the race argmax r / (q·M + e) itself, at a (p, q)
    with rejections spread over several residual tokens: Pearson χ² at alpha = 1e-4."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    residual = (p - q).clamp_min(0.0)
    r = residual / residual.sum()
    draws = 400_000
    race_min = torch.empty(draws, 1, dtype=torch.float64).exponential_(generator=g)
    noise = q * race_min + torch.empty(draws, V, dtype=torch.float64).exponential_(generator=g)
    counts = torch.bincount((r / noise).argmax(-1), minlength=V).double()
    law = reused_noise_recovery(p, q)
    live = law > 0
    assert torch.equal(live, r > 0), "only tokens with residual mass can be recovered"
    assert stats.chisquare(counts[live].numpy(), draws * law[live].numpy()).pvalue > 1e-4
    assert stats.chisquare(counts[live].numpy(), draws * r[live].numpy()).pvalue < 1e-10, "the reused noise acts"


def test_per_id_evaluation_matches_the_explicit_law_at_every_id():
    step = _steps(60, 4)
    tiles_p, tiles_r = Tiles.of(step.p, step.p, 10), Tiles.of(step.p, step.p - step.q, 10)
    y, var, _ = surprisal_scores(step.p)
    sums = per_id_sums(step, tiles_p, tiles_r, y, 10, len(CATALOGUE))
    for v in range(V):
        law = _law(BY_NAME["drafter_misreports_one_id"], step, v)
        diff = law - step.p
        expected = {
            "pooled": tiles_p.masses(law).sum(0) - 60 / 10,
            "residual": tiles_r.masses(law).sum(0) - 60 / 10,
            "count_drift": diff[:, v].sum(),
            "count_var": (law[:, v] * (1 - law[:, v]) - step.p[:, v] * (1 - step.p[:, v])).sum(),
            "surprisal_drift": (law * y).sum(),
            "surprisal_var": ((law * y**2).sum(-1) - (law * y).sum(-1) ** 2 - var).sum(),
            "lr": (diff**2 / step.p).sum() * torch.tensor([0.5, 1.0, -0.5, 1.0], dtype=torch.float64),
            "tv": 0.5 * diff.abs().sum(),
        }
        for name, value in expected.items():
            got = getattr(sums, name)[v]
            assert torch.allclose(got, value, atol=1e-10), f"id {v}, {name}: {got} != {value}"


def test_previous_same_slot_q_is_the_last_drafted_step_of_that_slot():
    drafted = torch.tensor([[True, True, True, True, False, True]])  # step 4 had no draft
    slot = torch.tensor([[0, 1, 0, 1, 0, 0]])
    assert _previous_same_slot(drafted, slot).tolist() == [[-1, -1, 0, 1, 2, 2]]
    assert _previous_same_slot(drafted, torch.full((1, 6), -1)).tolist() == [[-1] * 6]
    q = torch.eye(6, dtype=torch.float64)[None].expand(1, 6, 6).clone()  # step t's q = e_t
    q[0, 4] = 0
    p = torch.full((1, 6, 6), 1 / 6, dtype=torch.float64)
    step = chunk_steps(p, q, slot, 1, torch.tensor([[True, True, True, True, False, True]]), "test")
    assert step.q_prev.argmax(-1).tolist() == [0, 0, 0, 1, 2] and step.q_prev[:2].sum() == 0
    assert (
        torch.equal(step.q, q[0, [0, 1, 2, 3, 5]])
        and step.p_prev[0].sum() == 0
        and torch.equal(step.p_prev[1], p[0, 0])
    )


@functools.cache
def _small_table() -> dict[float, tuple[PowerAccumulator, dict]]:
    """Per acceptance: the accumulator of 300 rows aimed at the id a 30-row pilot picked, and its
    tokens needed at the bug table's levels."""
    out = {}
    for acceptance in bugtable.ACCEPTANCES:
        chain = bugtable.make_chain(acceptance, seed=0)
        pilot = bugtable.accumulate(chain, bugtable.simulate(chain, rows=30, seed=2))
        acc = bugtable.accumulate(chain, bugtable.simulate(chain, rows=300, seed=1), misreported=pilot.misreported_id)
        out[acceptance] = (acc, acc.tokens_needed(6.6e-6, 0.99))
    return out


def test_the_tests_meant_for_each_class_have_power_and_beat_the_pooled_test_where_it_cancels():
    for acceptance, (_, needed) in _small_table().items():
        for bug in CATALOGUE:
            for test in (*bug.caught_by, LR_BOUND):
                assert math.isfinite(needed[bug.name][test]), f"{bug.name}: {test} has no power at acc {acceptance}"
        for name in ("residual_is_p", "stale_q", "drafter_misreports_one_id"):
            row = needed[name]
            best = min(row[t] for t in ("pit.residual_order", "pit.token_counts", "pit.surprisal"))
            assert best < row["pit.pooled_chisquare"], f"{name} at acc {acceptance}: {row}"
            assert row[LR_BOUND] <= best, f"{name}: the LR bound must be the smallest: {row}"


@pytest.mark.parametrize(
    ("name", "factor"),
    [("residual_is_p", 2), ("stale_q", 2), ("target_temperature_1.1", 5), ("drafter_misreports_one_id", 50)],
)
def test_the_class_test_needs_far_fewer_tokens_than_the_residual_order(name, factor):
    for acceptance, (_, needed) in _small_table().items():
        row = needed[name]
        assert row["pit.bug_classes"] * factor <= row["pit.residual_order"], f"{name} at acc {acceptance}: {row}"


def test_the_class_test_costs_a_bounded_factor_over_the_lr_bound():
    """Both are normal approximations, and the LR bound reads low for bugs on few steps (the bonus
    slot): the class test needs between 0.9 and 4 times its tokens for every class."""
    for acceptance, (_, needed) in _small_table().items():
        for bug in CATALOGUE:
            row = needed[bug.name]
            ratio = row["pit.bug_classes"] / row[LR_BOUND]
            assert 0.9 <= ratio <= 4, f"{bug.name} at acc {acceptance}: {ratio:.2f} x the LR bound, {row}"


def test_the_class_test_scores_only_the_classes_known_in_advance():
    chain = bugtable.make_chain(0.88, seed=5)
    steps = bugtable.simulate(chain, rows=20, seed=6)
    aimed = bugtable.accumulate(chain, steps, misreported=3)
    blind = bugtable.accumulate(chain, steps)
    assert aimed.misreported_id == 3
    assert "pit.bug_classes" in aimed.tokens_needed(1e-3, 0.9)["drafter_misreports_one_id"]
    assert "pit.bug_classes" not in blind.tokens_needed(1e-3, 0.9)["drafter_misreports_one_id"]
    # without slots the bonus slot is unknown: its class cannot be scored, and the bug has no power
    no_slots = PowerAccumulator()
    p = chain.p[steps.before]
    no_slots.update(p, None, steps.tokens, None, bugtable.K, torch.ones(steps.tokens.shape, dtype=torch.bool))
    assert no_slots.tokens_needed(1e-3, 0.9)["bonus_from_previous_slot"]["pit.bug_classes"] == math.inf
    assert math.isfinite(no_slots.tokens_needed(1e-3, 0.9)["target_temperature_1.1"]["pit.bug_classes"])
    with pytest.raises(LosscheckError, match="misreported"):
        PowerAccumulator.merge([aimed, blind])


def test_tokens_needed_at_several_powers_is_tokens_needed_at_each_and_grows_with_the_power():
    chain = bugtable.make_chain(0.88, seed=5)
    acc = bugtable.accumulate(chain, bugtable.simulate(chain, rows=20, seed=6), misreported=3)
    design, partial = acc.tokens_needed_at(1e-4, (0.995, 0.8), looks=3)
    assert design == acc.tokens_needed(1e-4, 0.995, 3) and partial == acc.tokens_needed(1e-4, 0.8, 3)
    finite = [(c, t) for c, tests in design.items() for t, n in tests.items() if math.isfinite(n)]
    assert finite and all(partial[c][t] < design[c][t] for c, t in finite)
    with pytest.raises(LosscheckError, match="power must lie strictly between 0 and 1, got 1.5"):
        acc.tokens_needed_at(1e-4, (0.995, 1.5))


SIM_ALPHA, SIM_POWER, SIM_REPLICATES = 0.01, 0.9, 200


@functools.cache
def _predicted() -> dict[str, float]:
    """pit.bug_classes' tokens needed per class, from 300 rows of the 0.88 chain."""
    chain = bugtable.make_chain(0.88, seed=0)
    acc = bugtable.accumulate(chain, bugtable.simulate(chain, rows=300, seed=1))
    needed = acc.tokens_needed(SIM_ALPHA, SIM_POWER).items()
    return {name: row["pit.bug_classes"] for name, row in needed if "pit.bug_classes" in row}


def _rejection_rate(name: str, n: int) -> float:
    """pit.bug_classes at SIM_ALPHA on SIM_REPLICATES samples of `n` steps of a fresh run of the
    0.88 chain (its p, q and slots; the previous round's q exact in the law), each token drawn
    from class `name`'s law at its step — the bug changes the token, not the steps (what the
    accumulator assumes). The first replicate goes through `ConditionalValues.from_chunk`; the
    others reuse its class scores, which do not depend on the tokens, at their own tokens."""
    chain = bugtable.make_chain(0.88, seed=0)
    length = bugtable.LENGTH
    rows = math.ceil(n / length)
    steps = bugtable.simulate(chain, rows=rows, seed=3)
    drafted = (steps.slots < bugtable.K)[..., None]
    p = chain.p[steps.before]
    q = torch.where(drafted, chain.q[steps.before], 0.0)
    q_prev = torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0)
    tested = (torch.arange(rows * length) < n).view(rows, length)
    law = BY_NAME[name].law(chunk_steps(p, q, steps.slots, bugtable.K, tested, "law", q_prev=q_prev))  # [n, V]
    draws = torch.multinomial(law, SIM_REPLICATES, replacement=True, generator=torch.Generator().manual_seed(4))
    tokens = torch.zeros(rows * length, dtype=torch.long)
    tokens[:n] = draws[:, 0]
    v = torch.zeros(rows, length, dtype=torch.float64)
    first = ConditionalValues.from_chunk(p, q, tokens.view(rows, length), v, tested, slots=steps.slots, k=bugtable.K)
    step = chunk_steps(p, q, steps.slots, bugtable.K, tested, "scores")  # the test's q_prev: from the slots
    scores = {c.name: targeted_scores(step.p, c.law(step)) for c in targeted(CATALOGUE, True, None)}
    rejected = 0
    for r in range(SIM_REPLICATES):
        class_y = {c: y.gather(-1, draws[:, r : r + 1]).squeeze(-1)[scored] for c, (y, _, scored) in scores.items()}
        class_var = {c: var[scored] for c, (_, var, scored) in scores.items()}
        if r == 0:
            for c in class_y:
                assert torch.allclose(class_y[c], first.class_y[c]) and torch.allclose(class_var[c], first.class_var[c])
        values = dataclasses.replace(first, class_y=class_y, class_var=class_var)
        rejected += not bug_classes_test(values, SIM_ALPHA, SIM_POWER).passed
    return rejected / SIM_REPLICATES


@pytest.mark.parametrize("name", ["residual_is_p", "stale_q", "target_temperature_1.1"])
def test_predicted_tokens_for_the_class_test_agree_with_a_simulation(name):
    """At the tokens the accumulator predicts for pit.bug_classes (α 0.01, power 0.9) the
    simulated test rejects at least power - 3 binomial sd's (0.836) of the time, and at a third
    of them less than the power: the prediction is right within a factor of 3. (A correct
    prediction fails the first check with probability about 0.001.)"""
    n = _predicted()[name]
    margin = 3 * math.sqrt(SIM_POWER * (1 - SIM_POWER) / SIM_REPLICATES)
    at_n = _rejection_rate(name, int(n))
    assert at_n >= SIM_POWER - margin, (
        f"{name}: predicted {n:.0f} tokens for power {SIM_POWER}; the simulated test rejected {at_n:.3f} of "
        f"{SIM_REPLICATES} replicates there (expected >= {SIM_POWER - margin:.3f})"
    )
    at_third = _rejection_rate(name, math.ceil(n / 3))
    assert at_third < SIM_POWER, (
        f"{name}: at a third of the predicted {n:.0f} tokens the test already rejects {at_third}"
    )


def test_power_at_the_tokens_needed_is_the_power():
    acc, needed = _small_table()[0.88]
    for bug in ("residual_is_p", "target_temperature_1.1"):
        for test, n in needed[bug].items():
            if math.isfinite(n) and n > 1:
                power = acc.power_at(n, 6.6e-6, 0.99)[bug][test]
                assert 0.985 <= power <= 0.9999, f"{bug} {test}: power {power} at its {n} tokens"


def test_merge_equals_one_accumulation():
    chain = bugtable.make_chain(0.88, seed=5)
    steps = bugtable.simulate(chain, rows=40, seed=6)
    whole = bugtable.accumulate(chain, steps, chunk=40)
    halves = [
        bugtable.accumulate(
            chain,
            dataclasses.replace(steps, **{f: getattr(steps, f)[rows] for f in ("tokens", "before", "slots", "stale")}),
        )
        for rows in (slice(0, 25), slice(25, 40))
    ]
    merged = PowerAccumulator.merge(halves)
    for bug, row in whole.tokens_needed(1e-3, 0.9).items():
        assert row == pytest.approx(merged.tokens_needed(1e-3, 0.9)[bug], rel=1e-6), bug
    # a pilot and a tested sample keep rule-outs for other members: their power sums still pool
    # (`moments_only`), and the pooled accumulator has no rule-out e-values to misread
    gridded = [halves[0], dataclasses.replace(halves[1], grid={"residual_is_p": (0.5, 1.0)})]
    with pytest.raises(LosscheckError, match="grid"):
        PowerAccumulator.merge(gridded)
    pooled = PowerAccumulator.merge(gridded, moments_only=True)
    assert pooled.steps == whole.steps
    for bug, row in whole.tokens_needed(1e-3, 0.9).items():
        assert row == pytest.approx(pooled.tokens_needed(1e-3, 0.9)[bug], rel=1e-6), bug
    with pytest.raises(KeyError):
        pooled.rule_out_log_e()
    with pytest.raises(LosscheckError, match="k = 4"):
        whole.update(
            torch.full((1, 2, bugtable.VOCAB), 1 / bugtable.VOCAB),
            None,
            torch.zeros(1, 2, dtype=torch.long),
            None,
            3,
            torch.ones(1, 2, dtype=torch.bool),
        )


def test_the_command_runs_fast_at_small_settings(capsys):
    began = time.perf_counter()
    assert bugtable.main(["--rows", "100"]) == 0
    elapsed = time.perf_counter() - began
    out = capsys.readouterr().out
    assert "residual_is_p" in out and "observed 0.8" in out and "observed 0.9" in out
    assert elapsed < 60, f"python -m losscheck.selftest.bugtable --rows 100 took {elapsed:.0f} s"


def test_a_class_that_changes_nothing_needs_infinitely_many_tokens_even_through_round_off():
    """A class whose p' equals p at every step (a top-p bug in a cell without top-p) sums its
    log-LR moments to zero up to round-off; a variance at -1e-20 once crashed a user's cell in
    `math.sqrt` (the own-drafter example, T 1). It needs no finite sample and has no power."""
    from losscheck.stats.effects import LikelihoodRatioEffect

    nothing = LikelihoodRatioEffect(h1_mean=-9.1e-21, h1_var=-1.8e-20, h0_mean=9.1e-21, h0_var=-1.8e-20, outside=0.0)
    assert nothing.tokens_needed(1.4e-4, 0.995) == math.inf
    assert nothing.power(10_000, 1.4e-4) == 0.0


def test_power_sums_read_the_moment_steps_and_the_rule_out_every_tested_step():
    """An engine cell's power sums read a subset of its rows (`moments`), its rule-out e-values
    every tested step: the sums equal an accumulation of the subset alone, the rule-out sums
    one of every step."""
    from losscheck.stats.buglaws import TARGET_SIDE

    gen = torch.Generator().manual_seed(11)
    n, length, vocab = 6, 5, 12
    p = torch.randn(n, length, vocab, generator=gen, dtype=torch.float64).mul(2).softmax(-1)
    tokens = torch.multinomial(p.reshape(-1, vocab).float(), 1, generator=gen).reshape(n, length)
    tested = torch.rand(n, length, generator=gen) < 0.8
    subset = torch.tensor([True, False, True, False, False, True])[:, None] & tested
    grid = {TARGET_SIDE[0].name: (1.0, 0.5, 0.25)}

    def fed(rows: torch.Tensor, moments: torch.Tensor | None) -> PowerAccumulator:
        acc = PowerAccumulator(classes=TARGET_SIDE, grid=grid)
        acc.update(p, None, tokens, None, 4, rows, moments=moments)
        return acc

    split, alone, whole = fed(tested, subset), fed(subset, None), fed(tested, None)
    assert split.steps == alone.steps == int(subset.sum()) < whole.steps
    for name, tokens_needed in alone.tokens_needed(1e-3, 0.9).items():
        assert split.tokens_needed(1e-3, 0.9)[name] == pytest.approx(tokens_needed, rel=1e-9), name
    for name, sums in whole.rule_out.items():
        assert torch.equal(split.rule_out[name], sums), name
    assert not torch.equal(alone.rule_out[TARGET_SIDE[0].name], whole.rule_out[TARGET_SIDE[0].name])
