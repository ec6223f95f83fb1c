"""Bug-class families (`losscheck.stats.sequential`): the mixture members (1 - ρ)·p + ρ·p' of
each class, their power (`_Sums.mixed` against the explicit mixture law), their rule-out
e-values, Ville's bound for each member under its own law, for a bug between members, and for
bugs acting on a fraction of rounds, rows and slots — on the Markov chains of
`losscheck.selftest.bugtable`, where every law is exact."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from scipy import stats

from losscheck.errors import LosscheckError
from losscheck.selftest import bugtable
from losscheck.stats import sequential
from losscheck.stats.bugclass import PowerAccumulator, design_tests
from losscheck.stats.buglaws import BY_NAME, CATALOGUE, BugClass, Step, chunk_steps
from losscheck.stats.bugsums import log_mixture_ratio

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, SEED, REPLICATES = 150, 11, 400
MISREPORTED = 5
BETA = 0.05
# a correct bound is exceeded by the share over REPLICATES runs with probability <= 0.001
BOUND = stats.binom.ppf(0.999, REPLICATES, BETA) / REPLICATES


def test_a_family_runs_from_its_floor_to_the_catalogue_point():
    assert sequential.family(1.0) == (1.0,)
    members = sequential.family(0.1)
    assert members[0] == 1.0 and members[-1] == pytest.approx(0.1)
    ratios = [a / b for a, b in zip(members[1:-1], members[2:])]
    assert ratios == pytest.approx([sequential.GRID_RATIO] * len(ratios))
    assert sequential.required(members, 0.1) == members
    assert sequential.required(members, 0.15) == members[:-1]  # down to 0.141, the member below 0.15
    assert sequential.required((1.0, 0.5, 0.25), 0.4) == (1.0, 0.5, 0.25)  # the member below 0.4 too
    assert sequential.required((1.0, 0.5, 0.25), 0.5) == (1.0, 0.5)
    assert sequential.member_key("stale_q", 1.0) == "stale_q"
    assert sequential.member_key("stale_q", 0.25) == "stale_q@0.25"
    with pytest.raises(LosscheckError, match="rho_min"):
        sequential.family(0.0)


@functools.cache
def _run() -> tuple[bugtable.Chain, bugtable.Steps]:
    chain = bugtable.make_chain(0.88, seed=SEED)
    return chain, bugtable.simulate(chain, rows=ROWS, seed=SEED + 1)


def _mixture(bug: BugClass, rho: float) -> BugClass:
    """`bug`'s member ρ as a class of its own, by its explicit law."""

    def law(step: Step) -> torch.Tensor:
        return (1 - rho) * step.p + rho * bug.law(step)

    return dataclasses.replace(bug, name=f"{bug.name} mixed", law=law, per_id=False)


@pytest.mark.parametrize(
    "name", ["residual_is_p", "stale_q", "bonus_from_previous_slot", "top_p_one_side", "target_temperature_1.1"]
)
def test_a_members_power_is_that_of_its_explicit_law(name):
    """Every test's tokens at member ρ = 0.3 (`tokens_needed(rho=...)`, from the catalogue law's
    sums) equal those of an accumulator shown the mixture law itself, the LR bound (a local form
    at ρ < 1) aside."""
    chain, steps = _run()
    rho = 0.3
    mixed = _mixture(BY_NAME[name], rho)
    acc = PowerAccumulator(classes=(*CATALOGUE, mixed), misreported=MISREPORTED)
    drafted = (steps.slots < bugtable.K)[..., None]
    p = chain.p[steps.before]
    q = torch.where(drafted, chain.q[steps.before], 0.0)
    q_prev = torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0)
    acc.update(
        p, q, steps.tokens, steps.slots, bugtable.K, torch.ones(steps.tokens.shape, dtype=torch.bool), q_prev=q_prev
    )
    as_member = acc.tokens_needed(1e-4, 0.9, rho=rho)[name]
    explicit = acc.tokens_needed(1e-4, 0.9)[mixed.name]
    for test in design_tests():
        assert as_member[test] == pytest.approx(explicit[test], rel=1e-6), test
    assert acc.tv()[mixed.name] == pytest.approx(rho * acc.tv()[name], rel=1e-9)


def test_the_per_id_members_sums_are_those_of_its_explicit_law():
    """drafter_misreports_one_id at its aimed id, member ρ = 0.4: the mixed sums of the per-id
    view equal the explicit mixture law's at that id (bins, counts, surprisal, class scores)."""
    chain, steps = _run()
    rho = 0.4
    bug = BY_NAME["drafter_misreports_one_id"]
    mixed = _mixture(bug, rho)
    acc = PowerAccumulator(classes=(*CATALOGUE, mixed), misreported=MISREPORTED)
    drafted = (steps.slots < bugtable.K)[..., None]
    p, q = chain.p[steps.before], torch.where(drafted, chain.q[steps.before], 0.0)
    acc.update(p, q, steps.tokens, steps.slots, bugtable.K, torch.ones(steps.tokens.shape, dtype=torch.bool))
    view = acc.class_view(bug, rho).sums
    explicit = acc.sums[mixed.name]
    v = MISREPORTED
    for field in ("pooled", "residual", "surprisal_drift", "surprisal_var", "class_drift", "class_var"):
        torch.testing.assert_close(getattr(view, field), getattr(explicit, field), rtol=1e-6, atol=1e-9, msg=field)
    assert float(view.count_drift[v]) == pytest.approx(float(explicit.count_drift[v]), rel=1e-9)
    assert float(view.count_var[v]) == pytest.approx(float(explicit.count_var[v]), rel=1e-9)
    assert acc.count_power(v, 20_000, 1e-4, 0.2) < acc.count_power(v, 20_000, 1e-4, 0.6)


def _steps() -> tuple[Step, Step]:
    """The run's steps with the previous round's exact q (the bugs' laws), and as a cell sees them."""
    chain, steps = _run()
    drafted = (steps.slots < bugtable.K)[..., None]
    p = chain.p[steps.before]
    q = torch.where(drafted, chain.q[steps.before], 0.0)
    q_prev = torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0)
    every = torch.ones(steps.slots.shape, dtype=torch.bool)
    exact = chunk_steps(p, q, steps.slots, bugtable.K, every, "exact", q_prev=q_prev, misreported=MISREPORTED)
    seen = chunk_steps(p, q, steps.slots, bugtable.K, every, "seen", misreported=MISREPORTED)
    return exact, seen


def _draw(name: str, fraction: float, placement: str, seed: int) -> torch.Tensor:
    """[m, REPLICATES] tokens at the run's steps (row-major), class `name` acting with the
    honest law elsewhere: on each token with probability `fraction` ("token": the mixture
    member's own law), on each round with that probability ("round"), on the first `fraction`
    of the rows ("row": a batch position), or on slot 2 only ("slot")."""
    _, steps = _run()
    exact, _ = _steps()
    g = torch.Generator().manual_seed(seed)
    law = BY_NAME[name].law(exact)
    if placement == "token":
        return torch.multinomial((1 - fraction) * exact.p + fraction * law, REPLICATES, True, generator=g)
    honest = torch.multinomial(exact.p, REPLICATES, True, generator=g)
    buggy = torch.multinomial(law, REPLICATES, True, generator=g)
    rows, length = steps.slots.shape
    if placement == "round":
        rounds = (steps.slots == 0).long().cumsum(1) + torch.arange(rows)[:, None] * length  # [N, L] unique ids
        hit = torch.rand(rows * (length + 1), REPLICATES, generator=g) < fraction
        acts = hit[rounds.reshape(-1)]
    elif placement == "row":
        acts = (torch.arange(rows)[:, None] < fraction * rows).expand(-1, length).reshape(-1, 1)
    else:
        acts = (steps.slots == 2).reshape(-1, 1)
    return torch.where(acts, buggy, honest)


def _share_ruled_out(name: str, rho: float, tokens: torch.Tensor) -> float:
    """Share of replicates whose member-ρ rule-out e-value, as the accumulator keeps it, ever
    reaches 1/β."""
    _, seen = _steps()
    bug = BY_NAME[name]
    law = bug.law(seen)
    p_x, law_x = seen.p.gather(-1, tokens), law.gather(-1, tokens)  # [m, R]
    ratio = log_mixture_ratio(p_x[..., None], law_x[..., None], torch.tensor([rho], dtype=torch.float64))[..., 0]
    if bug.reads_q_prev:
        assert seen.q_prev_known is not None
        ratio = torch.where(seen.q_prev_known[:, None], ratio, 0.0)
    assert float(ratio.max()) <= -math.log(1 - rho) + 1e-12  # bounded per step, whatever p' is
    return float((ratio.cumsum(0).amax(0) >= math.log(1 / BETA)).double().mean())


CLASSES = ("residual_is_p", "stale_q", "target_temperature_1.1", "drafter_misreports_one_id", "top_p_one_side")


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("rho", [0.5, 0.2])
def test_a_member_present_is_ruled_out_at_most_beta_of_the_time(name, rho):
    """Ville, exactly: tokens from member ρ's own law, its e-value Π p / p_ρ ever reaches 1/β
    in at most β of the runs (within Binomial(REPLICATES, β)'s 0.999 quantile)."""
    share = _share_ruled_out(name, rho, _draw(name, rho, "token", seed=1))
    assert share <= BOUND, f"{name} at ρ = {rho}: ruled out in {share:.3f} of runs; Ville: {BETA} (0.999: {BOUND:.3f})"


@pytest.mark.parametrize("name", CLASSES)
def test_a_bug_between_members_is_held_by_the_member_below_it(name):
    """The bug at ρ* = 0.3 between members 0.25 and 0.35: the member below it is ruled out at
    most β of the time (in the local limit at most β^(2ρ*/ρ - 1))."""
    share = _share_ruled_out(name, 0.25, _draw(name, 0.3, "token", seed=2))
    assert share <= BOUND, f"{name} at 0.3: member 0.25 ruled out in {share:.3f} of runs"


def test_the_check_fails_with_the_member_above_the_bug():
    """The companion: the bug at ρ* = 0.2 and the member ρ = 0.6 — not the bug's law, and above
    it — is ruled out in most runs; so the family must reach down to the bugs it claims."""
    for name in ("residual_is_p", "stale_q", "top_p_one_side"):
        share = _share_ruled_out(name, 0.6, _draw(name, 0.2, "token", seed=3))
        assert share > 0.5, f"{name}: member 0.6 under the bug at 0.2 ruled out in only {share:.3f} of runs"


@pytest.mark.parametrize("placement", ["round", "row", "slot"])
@pytest.mark.parametrize("name", ["stale_q", "top_p_one_side", "drafter_misreports_one_id"])
def test_a_bug_on_a_fraction_of_rounds_rows_or_slots_is_held_by_its_share(name, placement):
    """Measured, not proven: a bug acting on 30% of the rounds (each independently), on the
    first 30% of the rows (a batch position) or on slot 2 only, against the member at its share
    of the tokens. Its per-token law is not the member's, but the log e-value's drift per token
    is the member's to second order; over REPLICATES runs it is ruled out within Ville's bound."""
    _, steps = _run()
    fraction = 0.3 if placement != "slot" else float((steps.slots == 2).double().mean())
    share = _share_ruled_out(name, round(fraction, 3), _draw(name, 0.3, placement, seed=4))
    assert share <= BOUND, f"{name} on {placement}s ({fraction:.2f}): ruled out in {share:.3f} of runs"


def test_the_accumulator_keeps_every_members_log_evalue():
    """PowerAccumulator with a grid: its per-member sums equal Σ log(p / p_ρ) at the run's own
    tokens, for explicit-law classes and the per-id class at every id; ρ = 1 keeps the plain key."""
    chain, steps = _run()
    grid = {"stale_q": (1.0, 0.5, 0.1), "drafter_misreports_one_id": (1.0, 0.3), "top_p_one_side": (0.25,)}
    acc = bugtable.accumulate(chain, steps, chunk=40, misreported=MISREPORTED)
    gridded = PowerAccumulator(misreported=MISREPORTED, grid=grid)
    drafted = (steps.slots < bugtable.K)[..., None]
    p, q = chain.p[steps.before], torch.where(drafted, chain.q[steps.before], 0.0)
    q_prev = torch.where(drafted & (steps.stale >= 0)[..., None], chain.q[steps.stale.clamp_min(0)], 0.0)
    for start in range(0, ROWS, 40):
        part = slice(start, start + 40)
        gridded.update(
            p[part], q[part], steps.tokens[part], steps.slots[part], bugtable.K,
            torch.ones(steps.tokens[part].shape, dtype=torch.bool), q_prev=q_prev[part],
        )  # fmt: skip
    _, seen = _steps()
    tokens = steps.tokens.reshape(-1, 1)
    log_e = gridded.rule_out_log_e([0, 3])
    assert log_e["stale_q"] == pytest.approx(acc.rule_out_log_e()["stale_q"], rel=1e-9)
    for name, members in grid.items():
        bug = BY_NAME[name]
        for v in (None, 0, 3) if bug.per_id else (None,):
            at = (
                seen
                if v is None
                else chunk_steps(
                    p, q, steps.slots, bugtable.K, torch.ones(steps.slots.shape, dtype=torch.bool), "v", misreported=v
                )
            )
            p_x, law_x = at.p.gather(-1, tokens), bug.law(at).gather(-1, tokens)
            for rho in members:
                ratio = (p_x.log() - ((1 - rho) * p_x + rho * law_x).clamp_min(1e-300).log()).squeeze(-1)
                if bug.reads_q_prev:
                    assert at.q_prev_known is not None
                    ratio = torch.where(at.q_prev_known, ratio, 0.0)
                key = name if v is None else sequential.id_key(name, v)
                assert log_e[sequential.member_key(key, rho)] == pytest.approx(float(ratio.sum()), rel=1e-9, abs=1e-9)
    assert "residual_is_p" in log_e and "top_p_one_side" not in log_e  # its only member is 0.25


def _fed(chain: bugtable.Chain, steps: bugtable.Steps, misreported: int | None, grid: dict) -> PowerAccumulator:
    """A cell's tested-sample accumulator (the family members of `grid`) over `steps`."""
    acc = PowerAccumulator(misreported=misreported, grid=grid)
    drafted = (steps.slots < bugtable.K)[..., None]
    p, q = chain.p[steps.before], torch.where(drafted, chain.q[steps.before], 0.0)
    acc.update(p, q, steps.tokens, steps.slots, bugtable.K, torch.ones(steps.tokens.shape, dtype=torch.bool))
    return acc


def test_an_early_stop_whose_tested_sample_falls_short_of_its_design_errors():
    """A design sized on a pilot from a 0.88-acceptance drafter: a tested sample of the same loop
    keeps every promise (each member's power at the design's tokens, from its own p and q), and
    its curve runs down to the members the design promised; a tested sample from a 0.97-acceptance
    drafter (fewer rejections, weaker verifier bugs) does not, and `confirmed_coverage` withdraws
    those classes by name (NOT COVERED) instead of claiming them."""
    from types import SimpleNamespace

    from losscheck.cells.record import bug_class_records
    from losscheck.cells.sampled import confirmed_coverage
    from losscheck.stats import sample_size
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.design import bug_class_coverage, design_looks

    alpha, power, limit = bugtable.CELL_ALPHA / 14, 0.99, 7
    chain = bugtable.make_chain(0.88, seed=3)
    pilot = bugtable.accumulate(chain, bugtable.simulate(chain, 300, seed=4))
    needed = pilot.tokens_needed(alpha, sequential.design_power(power), limit)
    design = sample_size.ClassDesign.of(needed, LR_BOUND, 2000, 60_000)
    looks, ids, grid = design_looks(pilot, design, alpha, power, limit)
    assert len(grid["stale_q"]) > 1 and any("@" in key for key in looks.partial)
    cell = SimpleNamespace(id="bugtable")

    same = _fed(chain, bugtable.simulate(chain, 300, seed=5), pilot.misreported_id, grid)
    kept = bug_class_records(bug_class_coverage(design, pilot, same, alpha, power, looks, True, ids))
    assert confirmed_coverage(cell, kept, power) == kept  # nothing withdrawn
    uncovered = {name for name, c in kept.items() if not c.covered}
    assert uncovered == {"draft_noise_reused"}  # ~100k tokens at this acceptance, beyond the design's 60k cap
    for name, c in kept.items():
        if name in uncovered:
            continue
        assert not c.short, name
        assert c.family is not None and c.family.required_down_to is not None, name
        rho = c.curve["0.8"]
        assert rho is not None and rho <= 1.25 * c.family.required_down_to, name

    weaker = bugtable.make_chain(0.97, seed=3)
    other = _fed(weaker, bugtable.simulate(weaker, 300, seed=5), pilot.misreported_id, grid)
    short = bug_class_records(bug_class_coverage(design, pilot, other, alpha, power, looks, True, ids))
    assert short["residual_is_p"].short and short["stale_q"].short
    confirmed = confirmed_coverage(cell, short, power)
    withdrawn = {name for name, c in confirmed.items() if c.withdrawn is not None}
    assert {"residual_is_p", "stale_q"} <= withdrawn
    assert all(not confirmed[name].covered for name in withdrawn)
    assert all(confirmed[name] == short[name] for name in set(short) - withdrawn)
    residual = confirmed["residual_is_p"].withdrawn
    assert residual is not None and "at ρ = 1 power" in residual and "profile to thorough" in residual
