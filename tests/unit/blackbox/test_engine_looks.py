"""An engine cell's looks (`losscheck.cells.engine.looks.look_tokens`): at most `LOOKS`, from the
floor (or the design over `GROWTH` to the `LOOKS` - 1, where that is larger) to the design's
tokens, geometric, as few as keep each within `GROWTH` times the one before, each at least
`MIN_GROWTH` times it."""

from __future__ import annotations

import pytest

from losscheck.cells.engine.looks import GROWTH, LOOKS, MIN_GROWTH, REBUILT_LOOKS, look_tokens, looks_allowed


@pytest.mark.parametrize(
    ("floor", "tokens", "expected"),
    [
        (2000, 9683, (2000, 3383, 5724, 9683)),  # the bundled T1 cell's design: 4.8 times the floor
        (768, 10067, (768, 1461, 2781, 5291, 10067)),  # the text target's T 0.3 cell: 13 times, five looks
        (753, 13249, (828, 1656, 3312, 6624, 13249)),  # top-k 8's: 17.6 times, the first at the design / 2⁴
        (200, 1570, (200, 397, 790, 1570)),  # the engine floor at T 1: four looks, each within GROWTH
        (200, 9693, (605, 1210, 2422, 4845, 9693)),  # far below the design: the first at the design / 2⁴
        (2000, 4000, (2000, 4000)),  # one doubling: two looks
        (2000, 4001, (2000, 2829, 4001)),
        (2000, 2000, (2000,)),  # at the floor: one look
        (2000, 2100, (2100,)),  # within one growth step of the floor: one look at the design
        (2000, 3200, (2000, 3200)),
        (2000, 2600, (2000, 2600)),
    ],
)
def test_looks_run_from_the_floor_to_the_design(floor, tokens, expected):
    looks = look_tokens(floor, tokens)
    assert looks == expected
    assert len(looks) <= LOOKS and looks[-1] == tokens
    assert all(b >= a * MIN_GROWTH * (1 - 1e-3) for a, b in zip(looks, looks[1:]))
    if len(looks) < LOOKS:  # room for another look: each step within GROWTH
        assert all(b <= a * GROWTH * (1 + 1e-3) for a, b in zip(looks, looks[1:]))


def test_one_look_allowed_is_the_design_alone():
    assert look_tokens(2000, 9683, limit=1) == (9683,)
    assert look_tokens(768, 10067, limit=3) == (768, 2781, 10067)  # the limit caps what GROWTH asks


def test_an_engine_rebuilt_for_each_look_allows_fewer():
    """A later look of an engine kept one instance at a time is a build (a GPU engine's minute):
    three looks there, five where both sides stay alive, one without early stopping."""
    assert (looks_allowed(rebuilt=True), looks_allowed(rebuilt=False)) == (REBUILT_LOOKS, LOOKS) == (3, 5)
    assert looks_allowed(rebuilt=False, early_stop=False) == looks_allowed(rebuilt=True, early_stop=False) == 1


def test_a_covered_classs_claim_is_its_power_less_the_beta_r_its_pilot_fixed():
    """A class's stated power after looks: its tests' power less β_r, the chance its rule-out fired
    under it — the default β / 2 of the first stage's β, or the smaller one the pilot fixed."""
    from losscheck.cells.engine.one_sample import Judging

    judging = Judging(1e-4, 2e-3, 0.99, 0.991, looks=5, betas={"a": 1e-5})
    default = (1 - 0.991) / 2
    assert judging.beta("a") == 1e-5 and judging.beta("b") == pytest.approx(default)
    assert judging.claimed("a", 0.9925, "covered") == pytest.approx(0.9925 - 1e-5)
    assert judging.claimed("b", 0.9925, "covered") == pytest.approx(0.9925 - default)
    assert judging.claimed("a", 0.9, "partial") == pytest.approx(0.8)  # β_p = 0.1
    assert judging.claimed("a", 0.5, "none") == 0.5
    one = Judging(1e-4, 2e-3, 0.99, 0.991, looks=1, betas={"a": 1e-5})
    assert one.beta("a") == 0.0 and one.claimed("a", 0.9925, "covered") == 0.9925


@pytest.mark.parametrize(
    ("tokens", "per_row", "rows"),
    [
        ((203, 397, 790, 1570), 15.9, (13, 25, 50, 99)),  # T 1 from the floor: each at the rows that reach it
        ((768, 1471, 2818, 5397, 10337), 768.0, (1, 2, 4, 8, 14)),  # rows of 768 tokens: whole rows
        ((755, 1529, 3097, 6272, 12703), 753.6, (2, 3, 5, 9, 17)),  # 1,529 tokens take 3 rows
        ((753, 1529, 3097), 753.6, (1, 3, 5)),
        ((750, 800, 1307), 750.7, (1, 2, 3)),  # a look within its neighbour's row still draws one more
        ((9000,), 768.0, (12,)),
    ],
)
def test_looks_are_recorded_at_the_whole_rows_they_draw(tokens, per_row, rows):
    """A look draws whole rows (`per_row` tested tokens each), at least one more than the look
    before: the plan records each look at the rows it draws, and the rows a look asks for (tokens
    / per_row rounded up, as `one_sample` asks) are those rows."""
    import math

    from losscheck.cells.engine.looks import on_rows

    looks = on_rows(tokens, per_row)
    assert tuple(math.ceil(t / per_row - 1e-9) for t in looks) == rows
    assert all(drawn >= planned - 1 for drawn, planned in zip(looks, tokens))  # never below the plan
    assert on_rows(tokens, 0.0) == tokens


def _markov_plan(no_sure=None):
    """`EngineLooks.plan` from a Markov loop's pilot (200 rows, k 4) judging `residual_is_p` with
    the target-side classes; `no_sure(tokens)`: the positions with no sure token (None: none).
    Returns the plan, the pilot's target-side sums and its rounds power sums."""
    import torch

    from losscheck.cells.engine.looks import EngineLooks
    from losscheck.selftest import bugtable
    from losscheck.stats import sample_size, sequential
    from losscheck.stats.bugclass import LR_BOUND, PowerAccumulator
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.hidden_rounds import RoundsSample

    chain = bugtable.make_chain(0.88, seed=3)
    steps = bugtable.simulate(chain, 200, seed=4)
    p, q, tokens = chain.p[steps.before], chain.q[steps.before], steps.tokens
    everywhere = torch.ones(tokens.shape, dtype=torch.bool)
    target = PowerAccumulator(classes=TARGET_SIDE)
    target.update(p, None, tokens, None, bugtable.K, everywhere)
    alpha, power = bugtable.CELL_ALPHA, 0.991
    level = sequential.design_power(power)
    sample = RoundsSample(bugtable.K)
    cut = None if no_sure is None else no_sure(tokens)
    sample.update(p, q, tokens, everywhere, everywhere, wide=None if cut is None else p, no_sure=cut)
    needed = target.tokens_needed(alpha, level, LOOKS)
    needed["residual_is_p"] = {"rounds.residual_is_p": sample.power.tokens_needed("residual_is_p", alpha, level)}
    design = sample_size.ClassDesign.of(needed, LR_BOUND, 500, 200_000)
    plan = EngineLooks.plan(design, target, sample.power, 1.0, ("residual_is_p",), alpha, power, LOOKS)
    return plan, target, sample.power


def test_members_a_pilot_predicts_no_early_look_rules_out_are_named_late():
    """`EngineLooks.plan` names the member keys whose rule-out e-value the pilot predicts falls
    short of its threshold at the look before the last (`sequential.may_rule_out`): none of
    `residual_is_p`'s where its rule-outs read every position of a Markov loop's pilot; every
    one where they read the first position of one row in four (1/64 of them, as where top-p
    cut-offs leave no token sure early in most rows: `hidden_rounds.bounded_positions`).
    `one_sample` then draws such a cell's design in one look."""
    import torch

    full = _markov_plan(None)[0]
    rows = 200  # the loop's pilot (`_markov_plan`)
    quarter = (torch.arange(rows) % 4 == 0)[:, None]  # [n, 1] the rows read at their first position
    first_only = _markov_plan(lambda tokens: torch.arange(tokens.shape[1]) == torch.where(quarter, 1, 0))[0]
    residual = [k for k in first_only.looks.covered + first_only.looks.partial if k.startswith("residual_is_p")]
    assert len(full.looks.tokens) > 1 and residual
    assert not [k for k in full.late if k.startswith("residual_is_p")], full.late
    assert set(residual) <= set(first_only.late), (residual, first_only.late)


def test_the_promise_s_bound_is_its_slowest_rule_out_under_h0():
    """`EngineLooks.family_bound`: of the member keys an early stop must rule out (catalogue points
    and members of smaller ρ, whose rule-outs grow at about ρ² the rate), the one whose threshold
    over its growth under H0 is largest (the Markov loop's pilot); none with one look (no early
    stop)."""
    import dataclasses

    from losscheck.cells.engine.looks import _member

    plan, target, rounds = _markov_plan()
    found = plan.family_bound(target, rounds)
    assert found is not None and len(plan.looks.tokens) > 1
    key, bound = found
    thresholds = plan.looks.thresholds()
    waits = {}  # each key's threshold over its growth under H0
    for k, t in thresholds.items():
        n, rho = _member(k)
        growth = target.rule_out_rate(n, rho) if n != "residual_is_p" else rounds.rule_out_rate(n, rho)
        assert growth is not None and growth > 0
        waits[k] = t / growth
    assert bound == pytest.approx(waits[key]) and bound == pytest.approx(max(waits.values()))
    assert len({_member(k)[1] for k in waits}) > 1  # members below the catalogue points count too
    one = dataclasses.replace(plan, looks=dataclasses.replace(plan.looks, tokens=(plan.looks.tokens[-1],)))
    assert one.family_bound(target, rounds) is None
