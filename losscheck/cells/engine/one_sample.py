"""The one-sample phase of a black-box engine cell: its speculative samples scored by losscheck's
copy of its target (teacher-forced PIT, the exact-conditional tests and, with its draft model, the
verifier's bug classes), sized by a pilot; a rejection goes on to the attribution phase
(`losscheck.cells.engine.attribution.attribute`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from losscheck.cells.engine.attribution import attribute, both_stages, plan_second_stage
from losscheck.cells.engine.deal import Dealer
from losscheck.cells.engine.handle import (
    CONFIRM_TOKENS,
    NO_SLOTS,
    draft_model_of,
    engine_of,
    first_token,
    generation,
    min_horizon,
    pilot_request,
    request,
    with_engine_facts,
)
from losscheck.cells.logprob_check import LogprobCheck, logprob_problems
from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import BoundRecord, BugClassRecord, LooksRecord, SecondStageRecord
from losscheck.core.sampling import SamplingParams, derive_seed
from losscheck.engines import BlackBoxEngine, DraftModel, ReportsLogprobs, ReportsTopLogprobs
from losscheck.engines.pool import one_at_a_time
from losscheck.run.context import CellContext
from losscheck.stats import registry, sample_size, sequential
from losscheck.stats.result import combine
from losscheck.stats.second_stage import stage_one_power

if TYPE_CHECKING:
    from losscheck.cells.engine.phases import EngineDraws
    from losscheck.cells.engine.rounds import RoundsScoring
    from losscheck.cells.record import DraftLawRecord
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.hidden_rounds import Acceptance, RoundsPower, RoundsSample

# the top ids a one-sample cell asks of an engine that reports them (`ReportsTopLogprobs`), checked
# at every tested position beside the sampled token's logprob: 5, OpenAI's and vLLM's usual ask
TOP_LOGPROBS = 5


def one_sample(ctx: CellContext) -> EngineDraws:
    """The engine's speculative samples, scored by losscheck's copy of its target in the engine's
    precision (the *reference*): randomized PIT uniform (`losscheck.stats.pit`), the
    exact-conditional tests and, when the engine gives its draft model (`RunsDraftModel`), the
    verifier's bug classes through a filter over the hidden slots (`losscheck.stats.hidden_rounds`).
    At a top-k / top-p cut-off another implementation may draw elsewhere within that precision's
    logit tolerance, the law is conditioned on the tokens every implementation keeps
    (`losscheck.cells.scoring.cutoff_law`).

    Sized by bug classes, as a PIT cell is: a pilot of its own (one row per prompt, at least the
    profile's `engine_pilot_sequences`), never tested, says what each class the cell can judge
    needs — those whose law reads the target's p alone (`buglaws.TARGET_SIDE`) and, with the
    draft model, the verifier's (`hidden_rounds.CLASSES`) — within the profile's cap
    (`_design`); the engine's own p and q, over the pilot's and the tested sample's rows together
    (`confirming`), confirm it (`confirmed_coverage`). The pooled
    tests report the TV they detect; only a profile's `pooled_tv` sizes the cell for one.

    Looks (`losscheck.cells.engine.looks`): the tested sample is drawn in at most `LOOKS` looks up
    to the design (`REBUILT_LOOKS` where each later look builds the engine again); the cell stops
    drawing at the first look where the data rule out every class the design reaches (and its own
    p and q keep the promise), or where a rounds test crosses its level (an e-value: valid at any
    stopping time). The fixed-sample tests are judged at α over the looks allowed. Where the pilot
    predicts an early stop cannot happen (`EngineLooks.late`), one look: the design drawn at once.

    Attribution (`losscheck.cells.engine.attribution`): planned from the first stage's sums,
    whatever its tests found (`plan_second_stage`: the first stage has a share of the power,
    `stage_one_power`, the second the rest, and each claim is their product); only when this
    first stage rejects, fresh rows of both sides are compared on the planned and the failing
    tests' row scores. Both reject: a FAIL blamed on speculation. The second does not: the
    reference differs from the engine, reported as such, and the cell's verdict and claims are
    the second stage's.

    Rounds: the pilot; each look of the sample; the attribution's two sides only after a
    rejection. The reference target is read only between and after them."""
    from losscheck.cells.engine.looks import EngineLooks, looks_allowed
    from losscheck.cells.engine.rounds import RoundsScoring, not_judged
    from losscheck.cells.sampled import confirmed_coverage
    from losscheck.cells.scoring import PitScores
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.hidden_rounds import CLASSES

    cell, engine, profile = ctx.cell, engine_of(ctx), ctx.profile
    horizon = max(profile.horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    drafter = draft_model_of(ctx)
    families = (registry.PIT, registry.CONDITIONAL) + ((registry.ROUNDS,) if drafter is not None else ())
    missing = missing_inputs(drafter, cell.params)
    budget = registry.split(ctx.alpha, *families, missing=missing)
    asked, pilot_per_prompt = pilot_request(ctx, prompts, horizon, speculative=True)
    (pilot,) = yield (asked,)
    # fixed before the tested draw: the fixed-sample tests' divisor
    limit = looks_allowed(one_at_a_time(engine), profile.early_stop)
    first = stage_one_power(profile.power)  # the first stage's part of the power; the rest is the second's
    sums = _measure(ctx, prompts, pilot, drafter)
    unjudged = not_judged(None if drafter is None else drafter.law, cell.params)  # named in the record, with why
    judged = tuple(c.name for c in CLASSES if c.name not in unjudged)

    def planned(looks: int) -> tuple[EngineDesign, EngineLooks]:
        """The design, and its looks, with `looks` looks allowed."""
        design = _design(ctx, prompts, sums, budget.per_test, first, looks)
        plan = EngineLooks.plan(
            design.classes, design.pilot, design.pilot_rounds, design.rounds_rate, judged, budget.per_test,
            first, looks, design.per_sequence,
        )  # fmt: skip
        return design, plan

    design, plan = planned(limit)
    late = plan.late
    if late:  # the pilot predicts no early stop: one look, its tests at α and at the first stage's power
        limit = 1
        design, plan = planned(limit)
    # an engine that reports logprobs reports them for the tested sample: checked beside it
    logprobs = _checks_logprobs(engine, cell.params)
    top = TOP_LOGPROBS if logprobs and isinstance(engine, ReportsTopLogprobs) else 0
    power = PowerAccumulator(classes=TARGET_SIDE, grid=plan.grid)
    rounds = None if drafter is None else RoundsScoring(drafter.model, engine.k, drafter.law, first_token(engine))
    scores: PitScores | None = None
    # the rounds power sums read the first rows of every prompt, up to `CONFIRM_TOKENS` (chosen before the draw)
    confirm_rows = max(1, math.ceil(CONFIRM_TOKENS / (horizon * len(prompts))))
    dealer = Dealer.seeded(len(prompts), derive_seed(ctx.seed, cell.id, "deal"))
    last = len(plan.looks.tokens)
    stopped, unconfirmed, rejected = last, [], False
    ask = partial(request, ctx, horizon=horizon, speculative=True, logprobs=logprobs, top_logprobs=top)
    for look, tokens in enumerate(plan.looks.tokens, 1):
        # a look's tokens are whole rows' rounded down (`on_rows`): its rows, rounded up
        hands = dealer.deal(math.ceil(tokens / max(design.per_sequence, 1e-9) - 1e-9))
        # each look's rows from a seed of their own, the rows of a part of the prompts from another
        purposes = [
            ("" if look == 1 else f"look{look}") + ("part" if len(h.prompts) < len(prompts) else "") for h in hands
        ]
        requests = tuple(
            ask(n=h.n, purpose=p, prompts=[prompts[i] for i in h.prompts]) for h, p in zip(hands, purposes)
        )
        answers = yield requests
        target = ctx.engine_target()  # loaded (its draft model placed beside it) only between draws
        if scores is None:
            scores = PitScores(ctx, cell.id, target, cell.precision.tolerance, power, rounds=rounds)
            if logprobs:
                tolerance = _logprob_tolerance(engine, cell.precision.tolerance)
                scores.logprobs = LogprobCheck(tolerance, cell.params.temperature)
        scores.target = target
        each = len(answers) // len(requests)  # a request's answer: its ids, then any reported logprobs
        for j, (hand, purpose) in enumerate(zip(hands, purposes)):
            drawn, *reported = answers[j * each : (j + 1) * each]
            scores.power_rows = hand.first_rows(confirm_rows)
            rows = [prompts[i] for i in hand.prompts for _ in range(hand.n)]
            scores.add(rows, generation(ctx, drawn, target, *reported), part=purpose)
        if look == last:
            break
        sample = None if rounds is None else rounds.sample
        if sample is not None and _rounds_reject(sample, budget.share(registry.ROUNDS), profile.power, missing):
            stopped, rejected = look, True  # an e-value crossed: valid at any stopping time, no more draws
            break
        if all(plan.ruled_out(power, sample).values()):
            if not plan.short(*confirming(power, sample, sums)):
                stopped = look
                break
            unconfirmed.append(look)  # the data rule every member out, the rows' own power does not confirm
    early = stopped < last
    assert scores is not None  # the first look always runs
    results, facts = scores.tests(budget.share(registry.PIT, registry.CONDITIONAL), profile.pooled_tv, limit)
    tested = scores.read_by_every_test
    # after a stop that ruled every class out, the tests' power at the design's tokens (the last look's)
    at = plan.design.tokens if early and not rejected else tested
    sample = None if rounds is None else rounds.sample
    ruled = plan.ruled_out(power, sample)
    judging = Judging(budget.per_test, ctx.alpha, profile.power, first, limit, ruled, plan.partly, plan.looks.betas)
    moments, rounds_moments = confirming(power, sample, sums)
    coverage = target_side_coverage(design.classes, moments, tested, judging, at)
    if rounds is not None:
        assert rounds_moments is not None  # a draft model scores the pilot's rounds too (`_measure`)
        alpha_rounds = budget.share(registry.ROUNDS)
        results += registry.run_family(registry.ROUNDS, rounds.sample, alpha_rounds, profile.power, missing=missing)
        scored = rounds.sample.tokens
        at_scored = at * scored / max(tested, 1)  # in scored tokens, at the tested sample's own rate
        judged_rounds = rounds_coverage(design, rounds_moments, scored, judging, at_scored)
        coverage |= {name: c for name, c in judged_rounds.items() if name not in unjudged}
    # the second stage, planned from the first's sums (not its verdict): its rows and each class's power there
    designed = math.ceil(plan.looks.tokens[-1] / max(design.per_sequence, 1e-9) / len(prompts))
    second = plan_second_stage(
        ctx,
        power,
        sample,
        tuple(n for n in judged if n in coverage),
        {n for n, c in coverage.items() if c.reach in ("covered", "partial")},
        design.per_sequence,
        max(math.ceil(dealer.dealt / len(prompts)), designed),
        horizon,
    )
    coverage = confirmed_coverage(cell, both_stages(coverage, second.power), profile.power)
    facts = dataclasses.replace(
        facts,
        sequences=dealer.dealt,
        prompts=len(prompts),
        horizon=horizon,
        pilot_sequences=pilot_per_prompt * len(prompts),
        pilot_tokens=design.pilot_tokens,
        pilot_tested_tokens=design.pilot_tested,
        design_tokens=design.classes.tokens,
        looks=LooksRecord(
            tokens=plan.looks.tokens,
            allowed=limit,
            stopped_at=stopped,
            tested_tokens=tested,
            early=early,
            unconfirmed=tuple(unconfirmed),
            rejected=rejected,
            rule_out_betas=dict(plan.looks.betas),
            late=late,
            rule_out_share=None if sample is None else sample.power.rule_out_share(),
        ),
        bug_classes=coverage,
        classes_not_judged=unjudged,
        draft_law=_draft_law(design, rounds),
        bound=bound(
            design.classes,
            coverage,
            tested,
            None if rounds is None else rounds.sample.tokens,
            plan.family_bound(moments, rounds_moments),
        ),
        second_stage=SecondStageRecord(second.per_prompt * len(prompts), second.scores, second.alpha),
    )
    failed = [r for r in results if not r.passed]
    if not failed:
        verdict = combine(cell.id, results, ctx.alpha)
        return CellOutcome(cell, verdict=verdict, problems=logprob_problems(facts), facts=with_engine_facts(ctx, facts))
    return (yield from attribute(ctx, prompts, second, horizon, failed, facts, drafter))


def _rounds_reject(sample: RoundsSample, alpha: float, power: float, missing: frozenset[str]) -> bool:
    """Whether a rounds test rejects at a look: their e-values hold at any stopping time, so a
    cell may stop drawing at the first crossing (the tests are run again, alongside every other,
    where it stopped)."""
    return any(not r.passed for r in registry.run_family(registry.ROUNDS, sample, alpha, power, missing=missing))


def missing_inputs(drafter: DraftModel | None, params: SamplingParams) -> frozenset[str]:
    """The inputs a one-sample cell lacks (a test that cannot reject spends no α): slots always;
    sampled drafts where the engine drafts its draft model's argmax; another q where the draft
    model's raw law is the q it draws from at `params`."""
    from losscheck.cells.engine.rounds import has_other_q

    missing = set(NO_SLOTS)
    if drafter is not None and drafter.law == "greedy":
        missing.add(registry.SAMPLED_DRAFTS)
    if drafter is not None and not has_other_q(params, drafter.law):
        missing.add(registry.OTHER_Q)
    return frozenset(missing)


def _checks_logprobs(engine: BlackBoxEngine, params: SamplingParams) -> bool:
    """Whether a one-sample cell checks `engine`'s reported logprobs: it reports them, the cell
    samples, and the reference draws the cut-off the engine draws. An engine computing in another
    precision than its reference (`logprob_precision`) keeps, near a top-k / top-p / min-p edge,
    tokens the reference cuts (log p = -inf there): those cells' tokens are judged by the PIT
    stage and its attribution alone."""
    if not isinstance(engine, ReportsLogprobs) or params.greedy:
        return False
    cuts = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0
    return getattr(engine, "logprob_precision", None) is None or not cuts


def _logprob_tolerance(engine: BlackBoxEngine, tolerance: float) -> float:
    """The logit round-off bound of an engine's reported logprobs: the cell's, or that of the
    precision the engine computes them in when it declares another (`ReportsLogprobs`)."""
    from losscheck.core.precision import LOGIT_TOLERANCE

    own = getattr(engine, "logprob_precision", None)
    return max(tolerance, LOGIT_TOLERANCE[own]) if own is not None else tolerance


@dataclass(frozen=True)
class EngineDesign:
    """What a one-sample engine cell's pilot fixes: the class design (in PIT-tested tokens), the
    pilot's PIT-tested tokens per sequence, its generated and tested tokens, and its rounds
    classes' power with their scored tokens per PIT-tested token."""

    classes: sample_size.ClassDesign
    per_sequence: float
    pilot_tokens: int
    pilot_tested: int
    pilot: PowerAccumulator  # the pilot's target-side sums (`EngineLooks.plan` reads them)
    rounds_rate: float = 1.0
    acceptance: Acceptance | None = None  # the pilot's: what the engine's counters should count of it
    pilot_rounds: RoundsPower | None = None  # the pilot's rounds power sums, with a draft model


@dataclass(frozen=True)
class PilotSums:
    """A pilot's scored sums, which `_design` sizes the cell from (at any number of looks): the
    target-side power sums, the rounds sample (None without a draft model), the tokens generated
    and the rows drawn."""

    measured: PowerAccumulator
    rounds: RoundsSample | None
    generated: int
    rows: int


def _measure(ctx: CellContext, prompts: list[list[int]], pilot: torch.Tensor, drafter: DraftModel | None) -> PilotSums:
    """Score a pilot of the engine's speculative samples `pilot` [P, m, L] (a seed of its own, never
    tested) with the reference target and, with a draft model, the round filter."""
    from losscheck.cells.engine.rounds import RoundsScoring
    from losscheck.cells.scoring import measure_power
    from losscheck.stats.buglaws import TARGET_SIDE

    cell, engine = ctx.cell, engine_of(ctx)
    target = ctx.engine_target()
    gen = generation(ctx, pilot, target)
    rows = [p for p in prompts for _ in range(pilot.shape[1])]
    rounds = None if drafter is None else RoundsScoring(drafter.model, engine.k, drafter.law, first_token(engine))
    measured = measure_power(ctx, target, rows, gen, cell.precision.tolerance, rounds, TARGET_SIDE)
    return PilotSums(measured, None if rounds is None else rounds.sample, int(gen.mask().sum()), len(rows))


def _design(
    ctx: CellContext,
    prompts: list[list[int]],
    pilot: PilotSums,
    alpha_test: float,
    power: float,
    looks: int = 1,
) -> EngineDesign:
    """From a pilot's sums (`_measure`): the tokens each class the cell judges needs at `power`, the
    first stage's (for a cell of
    `looks` > 1 looks, at `sequential.design_power` with its fixed-sample tests at α / looks:
    `EngineLooks`), with the design's margin, in the tokens every test reads (a cut-off's
    ambiguous positions left out), within the
    profile's engine floor (`engine_min_tokens`, and at least one row) and cap, which
    bound the tokens *generated*: scaled by the pilot's share of generated tokens that every test
    reads, so an ambiguous cut-off leaves classes uncovered rather than multiplying the rows. With
    looks, a class the cap leaves uncovered but reaches at `sequential.PARTIAL_POWER` takes the
    design to the cap (`ClassDesign.of`): the early stop waits for its rule-out."""
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.pit import pit_required_values

    profile, measured, sample = ctx.profile, pilot.measured, pilot.rounds
    level = power if looks == 1 else sequential.design_power(power)
    # at the design's power, and (with looks to stop at) at the partial power that takes a class beyond the cap into it
    levels = (level, sequential.PARTIAL_POWER) if looks > 1 else (level,)
    wanted = [
        {bug.name: at[bug.name] for bug in TARGET_SIDE} for at in measured.tokens_needed_at(alpha_test, levels, looks)
    ]
    read_share = measured.steps / max(pilot.generated, 1)  # of the generated tokens, those every test reads
    rate = 1.0
    if sample is not None:
        rate = sample.tokens / max(measured.steps, 1)
        for name in sample.power.classes:
            for at, want in zip(levels, wanted):
                tokens = sample.power.tokens_needed(name, alpha_test, at)
                want[name] = {f"rounds.{name}": tokens / max(rate, 1e-9)}
    pooled = 0
    if profile.pooled_tv is not None:  # a profile that asks the pooled tests for a TV sizes for it too
        alpha_pit = alpha_test * registry.budget_count(registry.PIT, missing=NO_SLOTS)  # the PIT family's share
        pooled = pit_required_values(alpha_pit / looks, profile.power, profile.pooled_tv, profile.pit_bins, NO_SLOTS)
    per_sequence = measured.steps / pilot.rows
    floor, cap = (max(1, math.ceil(t * read_share)) for t in (profile.engine_min_tokens, profile.max_pit_tokens))
    # a look draws at least one row; rounded down, so that a first look at the floor asks for whole rows
    floor = max(floor, int(per_sequence), 1)
    partly = wanted[-1] if looks > 1 else None
    design = sample_size.ClassDesign.of(wanted[0], LR_BOUND, floor, cap, pooled, partly)
    acceptance, pilot_rounds = (None, None) if sample is None else (sample.acceptance, sample.power)
    return EngineDesign(design, per_sequence, pilot.generated, measured.steps, measured, rate, acceptance, pilot_rounds)


def _draft_law(design: EngineDesign, rounds: RoundsScoring | None) -> DraftLawRecord | None:
    """What the engine's counters should count of the cell's speculative rows, pilot and tested
    sample (`losscheck.cells.engine.draft_law`); None without a draft model."""
    from losscheck.cells.engine.draft_law import predicted

    if rounds is None or design.acceptance is None:
        return None
    return predicted(design.acceptance.plus(rounds.sample.acceptance))


@dataclass(frozen=True)
class Judging:
    """How a one-sample cell's coverage is judged: one test's share of its α and the cell's α,
    the profile's power and the first stage's part of it (`second_stage.stage_one_power`), the
    looks it allows (`EngineLooks`: its fixed-sample tests at α / looks, a covered class's power
    less β_r, the chance it was ruled out first), per class whether every member its early stop
    needed was ruled out, and the classes the looks reach only partly (`EngineLooks.partly`:
    beyond the cap at the design's power, their power less β_p)."""

    alpha_test: float
    alpha_cell: float
    level: float
    stage_one: float
    looks: int = 1
    ruled: dict[str, bool] = dataclasses.field(default_factory=dict)
    partly: frozenset[str] = frozenset()
    betas: Mapping[str, float] = dataclasses.field(default_factory=dict)  # covered keys' β_r the pilot fixed

    def reach(self, name: str, covered: bool) -> str:
        """A class's reach in its record: covered by the design, reached partly, or not at all."""
        return "covered" if covered else "partial" if name in self.partly else "none"

    def claimed(self, name: str, have: float, reach: str) -> float:
        """The power class `name`'s record states from its tests' power `have`: less β_r where the
        design covers it and β_p where it reaches it partly, the chance it was ruled out first."""
        if reach == "none" or self.looks == 1:
            return have
        return max(0.0, have - (self.beta(name) if reach == "covered" else sequential.PARTIAL_BETA))

    @property
    def design_level(self) -> float:
        """The power a design sizes its tests for: the first stage's with one look, else
        `sequential.design_power` of it (the rest of its β spent on the early stops' rule-outs)."""
        return self.stage_one if self.looks == 1 else sequential.design_power(self.stage_one)

    def beta(self, name: str) -> float:
        """β_r of covered class `name`'s catalogue point, the chance it is ruled out before the
        last look: the default, or the one the pilot fixed (`sequential.rule_out_beta`); 0 with one look."""
        if self.looks == 1:
            return 0.0
        return self.betas.get(name, (1.0 - self.stage_one) * sequential.RULE_OUT_SHARE)


def confirming(
    power: PowerAccumulator, sample: RoundsSample | None, pilot: PilotSums
) -> tuple[PowerAccumulator, RoundsPower | None]:
    """The power sums a cell's claims are confirmed from: the tested sample's (`power`, `sample`)
    and its pilot's, one estimate of the per-token moments over every row the engine drew for the
    cell. The pilot is never tested, but it is the engine's own sample of the same prompts: a look
    of few rows confirms from more, the rows of each still clusters (`RoundsPower.drift`)."""
    from losscheck.stats.bugclass import PowerAccumulator

    pooled = PowerAccumulator.merge([power, pilot.measured], moments_only=True)
    if sample is None or pilot.rounds is None:
        return pooled, None
    return pooled, sample.power.plus(pilot.rounds.power)


def target_side_coverage(
    design: sample_size.ClassDesign, power: PowerAccumulator, tested: int, judging: Judging, at: int | None = None
) -> dict[str, BugClassRecord]:
    """Per target-side bug class, from the engine's own p (`power`, its per-token effects, `confirming`):
    its best test and the tokens that test needs, the cell's power against the catalogue point at
    `at` tokens (the design's after an early stop; None: the `tested` ones), whether the pilot's
    design covered it, its curve (the smallest member ρ of its family (1 - ρ)·p + ρ·p' caught at
    the profile's power and 0.8 at the tested tokens) and Wald's SPRT against it at the cell's α."""
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.sequential import PARTIAL_POWER

    alpha_test, level, looks = judging.alpha_test, judging.level, judging.looks
    tested = max(tested, 1)
    at = tested if at is None else max(at, 1)
    needed = power.tokens_needed(alpha_test, judging.design_level, looks)
    coverage: dict[str, BugClassRecord] = {}
    for bug in TARGET_SIDE:
        name = bug.name
        test, tokens = min(((t, n) for t, n in needed[name].items() if t != LR_BOUND), key=lambda tn: tn[1])
        covered = name in design.covered
        reach = judging.reach(name, covered)
        wald = power.wald(name, judging.alpha_cell, level)
        have = power.best_power(name, at, alpha_test, looks)
        coverage[name] = BugClassRecord(
            test=test,
            tokens_needed=tokens,
            pilot_tokens_needed=design.best[name][1],
            power=judging.claimed(name, have, reach),
            covered=covered,
            reach=reach,
            ruled_out=judging.ruled.get(name, False),
            curve={f"{p:g}": power.smallest_rho(name, tested, alpha_test, p, looks) for p in (level, PARTIAL_POWER)},
            wald_tokens=_finite(wald.under_bug),
            wald_h0_tokens=_finite(wald.under_h0),
        )
    return coverage


def rounds_coverage(
    design: EngineDesign, power: RoundsPower, scored: int, judging: Judging, at_scored: float | None = None
) -> dict[str, BugClassRecord]:
    """Per verifier class judged through the draft model, from the engine's own p and q (`power`,
    `confirming`), as `target_side_coverage`: the rounds test's tokens needed (scored tokens), its
    power at `at_scored` scored tokens (None: the `scored` ones), whether the design covered it,
    its curve at the tokens it scored and Wald's SPRT against it. The rounds tests hold at any
    stopping time: the looks set only the design's level and β_r."""
    from losscheck.stats.sequential import PARTIAL_POWER

    alpha_test, level = judging.alpha_test, judging.level
    records = {}
    for name in power.classes:
        covered = name in design.classes.covered
        reach = judging.reach(name, covered)
        needed = power.tokens_needed(name, alpha_test, judging.design_level)
        pilot = design.classes.best[name][1] * design.rounds_rate
        wald = power.wald(name, judging.alpha_cell, level)
        have = power.power(name, 1.0, scored if at_scored is None else at_scored, alpha_test)
        records[name] = BugClassRecord(
            test=f"rounds.{name}",
            tokens_needed=needed if math.isfinite(needed) else None,
            pilot_tokens_needed=pilot if math.isfinite(pilot) else None,
            power=judging.claimed(name, have, reach),
            covered=covered,
            reach=reach,
            ruled_out=judging.ruled.get(name, False),
            curve={f"{p:g}": power.smallest_rho(name, scored, alpha_test, p) for p in (level, PARTIAL_POWER)},
            wald_tokens=_finite(wald.under_bug),
            wald_h0_tokens=_finite(wald.under_h0),
        )
    return records


def bound(
    design: sample_size.ClassDesign,
    coverage: dict[str, BugClassRecord],
    tested: int,
    scored: int | None,
    family: tuple[str, float] | None = None,
) -> BoundRecord | None:
    """The cell's tokens against Wald's bound at its binding class: of the classes the design
    covered and the cell judges, the one the pilot said needs the most tokens (the one that sized
    the sample); its test read `scored` rounds-scored tokens when it is a verifier class judged
    through the draft model (`rounds.*`), else the `tested` tokens every test reads. With it, the
    `tested` tokens against the early stop's promise (`family`: `EngineLooks.family_bound`). None
    when no class was covered or its bound is infinite."""
    judged = [name for name in design.covered if name in coverage]
    if not judged:
        return None
    name = max(judged, key=lambda c: design.best[c][1])
    record = coverage[name]
    tokens = scored if record.test.startswith("rounds.") and scored is not None else tested
    if record.wald_tokens is None or record.wald_h0_tokens is None:
        return None
    family_key, family_tokens = family if family is not None else (None, None)
    return BoundRecord(
        binding_class=name,
        test=record.test,
        tested_tokens=tokens,
        wald_tokens=record.wald_tokens,
        wald_h0_tokens=record.wald_h0_tokens,
        ratio=tokens / record.wald_tokens,
        ratio_h0=tokens / record.wald_h0_tokens,
        at_floor=design.tokens <= design.floor,
        family_key=family_key,
        family_tokens=family_tokens,
        ratio_family=None if family_tokens is None else tested / family_tokens,
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
