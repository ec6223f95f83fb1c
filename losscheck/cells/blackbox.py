"""Running a black-box engine's cells: the engine with speculation on against itself with it off.

- greedy (`engine_greedy`): on == off token for token on every prompt of the prompt sets;
  a divergence is triaged by the target's float64 top-2 margin (`losscheck.core.divergence`) in the
  engine's precision;
- one-sample (`one_sample`, the engine declares the `precision` losscheck loads its target in):
  the speculative samples scored by teacher-forced PIT (`losscheck.cells.scoring.PitScores`) and,
  with the engine's draft model, the verifier's bug classes; speculation-off rows only after a
  rejection, to attribute it (`losscheck.cells.attribution`);
- two-sample (`two_sample`, `precision = None`): speculative samples against the same engine's
  samples with drafting off, independent seeds (`losscheck.stats.two_sample`).

Sampled horizons are at least 2k + 2 (k the engine's block length), so every row reaches a
second round and a bonus slot; rows cycle over the prompts of every tier.

Each cell is a generator of rounds of requests (`losscheck.cells.engine_phases`): the run decides
the order in which the engine answers them, and no cell holds the reference target across a
round (an engine that keeps one instance alive at a time never has it loaded beside one).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from losscheck.cells.logprob_check import LogprobCheck, logprob_problems
from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import AttributionRecord, BugClassRecord, SampleFacts
from losscheck.core.divergence import find_divergences
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, derive_seed
from losscheck.engines import (
    BlackBoxEngine,
    DraftModel,
    GenerationRequest,
    ReportsLogprobs,
    ReportsTopLogprobs,
    request_lengths,
)
from losscheck.errors import LosscheckError, flag
from losscheck.plan import profiles
from losscheck.plan.cell import OWN_TARGET
from losscheck.plan.modes import Mode
from losscheck.run.context import CellContext
from losscheck.stats import registry, sample_size
from losscheck.stats.result import combine

if TYPE_CHECKING:
    from losscheck.cells.engine_phases import EngineDraws
    from losscheck.cells.engine_rounds import RoundsScoring
    from losscheck.cells.proxy_design import Levels, ProxyDesign
    from losscheck.cells.record import DraftLawRecord
    from losscheck.core.target import HFTarget
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.hidden_rounds import Acceptance, FirstToken, RoundsSample
    from losscheck.stats.result import TestResult


NO_SLOTS = frozenset({registry.SLOTS})  # an engine reports no slots: no slot test and no α share for one
# A one-sample cell's power sums (what confirms its design) read this many tokens of its tested
# sample, the first rows of every prompt: per-token effects are estimated there, the tests read all.
CONFIRM_TOKENS = 4_096
# the top ids a one-sample cell asks of an engine that reports them (`ReportsTopLogprobs`), checked
# at every tested position beside the sampled token's logprob: 5, OpenAI's and vLLM's usual ask
TOP_LOGPROBS = 5


def run_engine_cell(ctx: CellContext) -> CellOutcome:
    """Certify a black-box engine's cell the way its mode asks. When the run draws its engine cells
    side by side (`CellContext.engine_batch`: an engine that keeps one instance alive at a time),
    the first of them draws them all (`losscheck.cells.engine_phases`) and each takes its own
    outcome; otherwise the cell is drawn alone, speculative side first."""
    from losscheck.cells.draft_law import checked
    from losscheck.cells.engine_phases import draw_side_by_side

    engine = _engine(ctx)
    batch = ctx.engine_batch()
    vocab_size, eos = ctx.engine_vocab()

    def drawn() -> dict[str, CellOutcome | Exception]:
        cells = {cell.id: engine_draws(ctx.of_cell(cell)) for cell in batch}
        try:
            return draw_side_by_side(engine, cells, vocab_size, eos, ctx.release_engine_target).results
        finally:
            ctx.release_engine()  # the last phase's instance: nothing of the batch needs it

    results = ctx.memo(("engine-cells", batch), drawn) if len(batch) > 1 else drawn()
    result = results[ctx.cell.id]
    if isinstance(result, Exception):
        raise result
    result.facts = checked(result.facts, not result.passed)  # the engine's counters are in: its draft law checked
    return result


def engine_draws(ctx: CellContext) -> EngineDraws:
    """The cell's rounds of draws, as its mode asks (`losscheck.plan.memory.rounds`), behind
    `_fail_closed`."""
    steps = {Mode.ENGINE_GREEDY: engine_greedy, Mode.ONE_SAMPLE: one_sample, Mode.TWO_SAMPLE: two_sample}
    return _fail_closed(ctx, steps[ctx.cell.mode])


def _fail_closed(ctx: CellContext, draws: Callable[[CellContext], EngineDraws]) -> EngineDraws:
    """`draws(ctx)`, unless the cell sets a sampling parameter its engine does not declare it
    serves: that is refused by name before any draw (`losscheck.engines.served`), raised where the
    cell is first resumed, so that the rest of a side-by-side batch still draws."""
    from losscheck.engines.served import declared, refuse

    engine = _engine(ctx)
    eos = ctx.engine_vocab()[1] if ctx.cell.params.stop_ids else None
    refuse(ctx.cell.params, engine.name, declared(engine), eos=eos)
    return (yield from draws(ctx))


def _engine(ctx: CellContext) -> BlackBoxEngine:
    if ctx.engine is None:
        raise LosscheckError(f"black-box cells need {flag('engine')}=pkg.mod:factory")
    return ctx.engine


def min_horizon(engine: BlackBoxEngine) -> int:
    """Two full rounds and the bonus slot of the second: 2k + 2 generated tokens."""
    return profiles.min_horizon(engine.k)


def request(
    ctx: CellContext,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    horizon: int,
    speculative: bool,
    purpose: str = "",
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> GenerationRequest:
    """A request for `n` continuations of each prompt, whose answer is a validated LongTensor
    [len(prompts), n, horizon] (EOS-padded; with `logprobs`, then their reported log-probabilities),
    seeded from the run seed, the cell, the side and the `purpose` ("pilot": a sample of its own,
    never tested)."""
    side = "speculative" if speculative else "baseline"
    seed = derive_seed(ctx.seed, ctx.cell.id, *((side, purpose) if purpose else (side,)))
    return GenerationRequest(
        prompts=tuple(map(tuple, prompts)),
        n=n,
        params=params,
        seed=seed,
        max_new_tokens=horizon,
        speculative=speculative,
        purpose=purpose or "sample",
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def as_generation(tokens: torch.Tensor, eos: int, k: int, params: SamplingParams, vocab: int) -> Generation:
    """EOS-padded engine rows `tokens` [N, L] as a `Generation`, each ending at its first EOS or stop
    id of `params`, or the token that completes a stop string (no loop counters: a black box
    reports none; `vocab` the target's vocabulary size)."""
    return Generation(tokens, request_lengths(tokens, eos, params, vocab), LoopStats.empty(k), params)


def _facts(ctx: CellContext, facts: SampleFacts) -> SampleFacts:
    """`facts` with the engine's name, block length and the cell's test mode."""
    engine = _engine(ctx)
    return dataclasses.replace(facts, engine=engine.name, engine_k=engine.k, mode=ctx.cell.mode)


# --- greedy ----------------------------------------------------------------------------------------
def engine_greedy(ctx: CellContext) -> EngineDraws:
    """Speculation on == off, token for token, on every prompt of every tier: one round, every
    tier's speculative and plain requests."""
    cell, engine = ctx.cell, _engine(ctx)
    max_new = max(ctx.profile.greedy_max_new, min_horizon(engine))
    # Margins need the engine's target: in fp32 every divergence fails, below it a margin within
    # the precision's round-off is a near-tie; without the target (two-sample mode) none is.
    scorable = cell.target != OWN_TARGET
    tolerance = cell.precision.tolerance if scorable and cell.precision.reduced else 0.0
    tiers = ctx.prompt_tiers
    asked = [request(ctx, ctx.prompts(tier), 1, GREEDY, max_new, side) for side in (True, False) for tier in tiers]
    drawn = yield tuple(asked)
    vocab, eos = ctx.engine_vocab()
    outcome = CellOutcome(cell, strict=ctx.strict)
    for t, tier in enumerate(tiers):
        on, off = (as_generation(drawn[s * len(tiers) + t][:, 0], eos, engine.k, GREEDY, vocab) for s in (0, 1))
        # the target is loaded only where on and off differ: a margin to read
        model = ctx.engine_target().model if scorable and not torch.equal(on.tokens, off.tokens) else None
        outcome.divergences += find_divergences(model, tier, ctx.prompts(tier), on, off, tolerance)
    prompts = sum(len(ctx.prompts(tier)) for tier in tiers)
    outcome.facts = _facts(ctx, SampleFacts(prompts=prompts, max_new_tokens=max_new, near_tie_margin=tolerance))
    return outcome


# --- sampling: one-sample (teacher-forced PIT) ---------------------------------------------------------
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
    (`_design`); the tested sample's own p and q confirm it (`confirmed_coverage`). The pooled
    tests report the TV they detect; only a profile's `pooled_tv` sizes the cell for one.

    Attribution (`losscheck.cells.attribution`): only when this first stage rejects, fresh rows
    of both sides are compared two-sample on the row scores of the failing tests. Both reject: a
    FAIL blamed on speculation. The second does not: the reference differs from the engine,
    reported as such, and the cell's verdict is the second stage's.

    Rounds: the pilot; the sample; the attribution's two sides only after a rejection. The
    reference target is read only between and after them."""
    from losscheck.cells.engine_rounds import RoundsScoring, not_judged
    from losscheck.cells.sampled import confirmed_coverage
    from losscheck.cells.scoring import PitScores
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.buglaws import TARGET_SIDE

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    horizon = max(profile.horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    drafter = _drafter(ctx)
    families = (registry.PIT, registry.CONDITIONAL) + ((registry.ROUNDS,) if drafter is not None else ())
    missing = _missing(drafter, cell.params)
    budget = registry.split(ctx.alpha, *families, missing=missing)
    pilot_per_prompt = max(1, math.ceil(profile.engine_pilot_sequences / len(prompts)))
    (pilot,) = yield (request(ctx, prompts, pilot_per_prompt, cell.params, horizon, True, purpose="pilot"),)
    design = _design(ctx, prompts, pilot, budget.per_test, drafter)
    per_prompt = math.ceil(design.classes.sequences(design.per_sequence) / len(prompts))
    rows = [p for p in prompts for _ in range(per_prompt)]  # prompt-major, as the engine returns them
    # an engine that reports logprobs reports them for the tested sample: checked beside it
    logprobs = _checks_logprobs(engine, cell.params)
    top = TOP_LOGPROBS if logprobs and isinstance(engine, ReportsTopLogprobs) else 0
    asked = request(ctx, prompts, per_prompt, cell.params, horizon, True, logprobs=logprobs, top_logprobs=top)
    drawn, *reported = yield (asked,)
    target = ctx.engine_target()
    power = PowerAccumulator(classes=TARGET_SIDE)
    rounds = None if drafter is None else RoundsScoring(drafter.model, engine.k, drafter.law, _first_token(engine))
    # the power sums read the first rows of every prompt, up to `CONFIRM_TOKENS` (chosen before the draw)
    first = max(1, min(per_prompt, math.ceil(CONFIRM_TOKENS / (horizon * len(prompts)))))
    power_rows = (torch.arange(per_prompt) < first).repeat(len(prompts))  # [P * m], prompt-major
    scores = PitScores(ctx, cell.id, target, cell.precision.tolerance, power, rounds=rounds, power_rows=power_rows)
    if logprobs:
        scores.logprobs = LogprobCheck(_logprob_tolerance(engine, cell.precision.tolerance), cell.params.temperature)
    scores.add(rows, _generation(ctx, drawn, target, *reported))
    results, facts = scores.tests(budget.share(registry.PIT, registry.CONDITIONAL), profile.pooled_tv)
    coverage = target_side_coverage(design.classes, power, budget.per_test, profile.power, scores.read_by_every_test)
    if rounds is not None:
        alpha_rounds = budget.share(registry.ROUNDS)
        results += registry.run_family(registry.ROUNDS, rounds.sample, alpha_rounds, profile.power, missing=missing)
        unjudged = not_judged(rounds.law, cell.params)  # named in the record instead, with the reason
        judged = rounds_coverage(design, rounds.sample, budget.per_test, profile.power)
        coverage |= {name: c for name, c in judged.items() if name not in unjudged}
    coverage = confirmed_coverage(cell, coverage, profile.power)
    facts = dataclasses.replace(
        facts,
        sequences=len(rows),
        prompts=len(prompts),
        horizon=horizon,
        pilot_sequences=pilot_per_prompt * len(prompts),
        pilot_tokens=design.pilot_tokens,
        pilot_tested_tokens=design.pilot_tested,
        design_tokens=design.classes.tokens,
        bug_classes=coverage,
        classes_not_judged=not_judged(None if drafter is None else drafter.law, cell.params),
        draft_law=_draft_law(design, rounds),
    )
    failed = [r for r in results if not r.passed]
    if not failed:
        verdict = combine(cell.id, results, ctx.alpha)
        return CellOutcome(cell, verdict=verdict, problems=logprob_problems(facts), facts=_facts(ctx, facts))
    return (yield from _attribute(ctx, prompts, per_prompt, horizon, failed, facts, drafter))


def _attribute(
    ctx: CellContext,
    prompts: list[list[int]],
    per_prompt: int,
    horizon: int,
    failed: list[TestResult],
    facts: SampleFacts,
    drafter: DraftModel | None,
) -> EngineDraws:
    """The second stage after the first rejected with `failed`: as many fresh rows per side as the
    first stage tested, compared on the failing tests' row scores."""
    from losscheck.cells.attribution import attribution_tests, row_scores, scores_for
    from losscheck.cells.engine_rounds import RoundsScoring

    cell, engine = ctx.cell, _engine(ctx)
    names = scores_for([r.name for r in failed])
    rows = [p for p in prompts for _ in range(per_prompt)]
    asked = tuple(
        request(ctx, prompts, per_prompt, cell.params, horizon, side, purpose="attribution") for side in (True, False)
    )
    drawn = yield asked
    target = ctx.engine_target()
    scorer = drafter if any(n.startswith("rounds.") for n in names) else None  # the drafter, if a score reads it
    sides = [
        row_scores(
            ctx,
            f"{cell.id}-attribution-{side}",
            target,
            rows,
            _generation(ctx, tokens, target),
            cell.precision.tolerance,
            None if scorer is None else RoundsScoring(scorer.model, engine.k, scorer.law, _first_token(engine)),
        )
        for tokens, side in zip(drawn, ("on", "off"), strict=True)
    ]
    second = attribution_tests(sides[0], sides[1], names, ctx.alpha, ctx.profile.power)
    blamed = any(not r.passed for r in second)
    first = tuple(f"{r.name} (p = {r.p_value:.3g}, alpha = {r.alpha:.3g})" for r in failed)
    record = AttributionRecord("speculation" if blamed else "reference", first, names, len(rows))
    problems = logprob_problems(facts)  # the first stage's sample's reported logprobs
    if blamed:
        problems.append(
            f"speculation changes the engine's output law: the first stage rejected {', '.join(first)} against "
            f"losscheck's copy of the target, and {len(rows)} fresh speculative rows differ from {len(rows)} "
            "speculation-off rows on the same row scores"
        )
    facts = dataclasses.replace(facts, attribution=record, bug_classes=facts.bug_classes if blamed else None)
    return CellOutcome(cell, verdict=combine(cell.id, second, ctx.alpha), problems=problems, facts=_facts(ctx, facts))


def _missing(drafter: DraftModel | None, params: SamplingParams) -> frozenset[str]:
    """The inputs a one-sample cell lacks (a test that cannot reject spends no α): slots always;
    sampled drafts where the engine drafts its draft model's argmax; another q where the draft
    model's raw law is the q it draws from at `params`."""
    from losscheck.cells.engine_rounds import has_other_q

    missing = set(NO_SLOTS)
    if drafter is not None and drafter.law == "greedy":
        missing.add(registry.SAMPLED_DRAFTS)
    if drafter is not None and not has_other_q(params, drafter.law):
        missing.add(registry.OTHER_Q)
    return frozenset(missing)


def _first_token(engine: BlackBoxEngine) -> FirstToken | None:
    """Where `engine` says its rows' first token comes from (`first_token`; None: not said, and
    the round filter mixes both)."""
    from losscheck.stats.hidden_rounds import FIRST_TOKEN

    first = getattr(engine, "first_token", None)
    if first is not None and first not in FIRST_TOKEN:
        raise LosscheckError(
            f"engine {engine.name!r}: first_token = {first!r}; declare one of {FIRST_TOKEN} or leave it out"
        )
    return first


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


def _generation(
    ctx: CellContext,
    tokens: torch.Tensor,
    target: HFTarget,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs: torch.Tensor | None = None,
) -> Generation:
    """Engine samples [P, m, L] as one `Generation` on the target's device, with the engine's
    reported `logprobs` [P, m, L] of them when it gave them, and its top ids and their
    log-probabilities [P, m, L, N] when asked."""
    vocab, eos = ctx.engine_vocab()
    gen = as_generation(tokens.flatten(0, 1), eos, _engine(ctx).k, ctx.cell.params, vocab)
    gen.tokens, gen.lengths = gen.tokens.to(target.device), gen.lengths.to(target.device)
    if logprobs is not None:
        gen.logprobs = logprobs.flatten(0, 1)
    if top_ids is not None and top_logprobs is not None:
        gen.top_ids, gen.top_logprobs = top_ids.flatten(0, 1), top_logprobs.flatten(0, 1)
    return gen


def _drafter(ctx: CellContext) -> DraftModel | None:
    """The engine's draft model, wrapped as a teacher-forceable target, once per run, on the CPU
    until a cell scores (then on the run's device beside the reference target,
    `CellContext.hold_draft`); None: it gives none."""
    from losscheck.cells.engine_rounds import as_target
    from losscheck.engines import draft_model

    engine = _engine(ctx)

    def load() -> DraftModel | None:
        given = draft_model(engine, ctx.engine_vocab()[0])
        if given is None:
            return None
        model = given.model
        if next(model.parameters()).device.type != "cpu":  # the engine's own module: losscheck moves a copy
            model = copy.deepcopy(model)
        held = ctx.hold_draft(as_target(model.to("cpu"), f"{engine.name} draft model"))
        return dataclasses.replace(given, model=held)

    return ctx.memo(("engine-drafter", engine.name), load)


@dataclass(frozen=True)
class EngineDesign:
    """What a one-sample engine cell's pilot fixes: the class design (in PIT-tested tokens), the
    pilot's PIT-tested tokens per sequence, its generated and tested tokens, and its rounds
    classes' power with their scored tokens per PIT-tested token."""

    classes: sample_size.ClassDesign
    per_sequence: float
    pilot_tokens: int
    pilot_tested: int
    rounds_rate: float = 1.0
    acceptance: Acceptance | None = None  # the pilot's: what the engine's counters should count of it


def _design(
    ctx: CellContext, prompts: list[list[int]], pilot: torch.Tensor, alpha_test: float, drafter: DraftModel | None
) -> EngineDesign:
    """From a pilot of the engine's speculative samples `pilot` [P, m, L] (a seed of its own, never
    tested): the tokens each class the cell judges needs at the profile's power, with the design's
    margin, in the tokens every test reads (a cut-off's ambiguous positions left out), within the
    profile's floor and cap, which bound the tokens *generated*: scaled by the pilot's share of
    generated tokens that every test reads, so an ambiguous cut-off leaves classes uncovered
    rather than multiplying the rows."""
    from losscheck.cells.engine_rounds import RoundsScoring
    from losscheck.cells.scoring import measure_power
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.pit import pit_required_values

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    target = ctx.engine_target()
    gen = _generation(ctx, pilot, target)
    rows = [p for p in prompts for _ in range(pilot.shape[1])]
    rounds = None if drafter is None else RoundsScoring(drafter.model, engine.k, drafter.law, _first_token(engine))
    measured = measure_power(ctx, target, rows, gen, cell.precision.tolerance, rounds, TARGET_SIDE)
    needed = measured.tokens_needed(alpha_test, profile.power)
    wanted: dict[str, dict[str, float]] = {bug.name: needed[bug.name] for bug in TARGET_SIDE}
    generated = int(gen.mask().sum())
    read_share = measured.steps / max(generated, 1)  # of the generated tokens, those every test reads
    rate = 1.0
    if rounds is not None:
        rate = rounds.sample.tokens / max(measured.steps, 1)
        for name in rounds.sample.power.classes:
            tokens = rounds.sample.power.tokens_needed(name, alpha_test, profile.power)
            wanted[name] = {f"rounds.{name}": tokens / max(rate, 1e-9)}
    pooled = 0
    if profile.pooled_tv is not None:  # a profile that asks the pooled tests for a TV sizes for it too
        alpha_pit = alpha_test * registry.budget_count(registry.PIT, missing=NO_SLOTS)  # the PIT family's share
        pooled = pit_required_values(alpha_pit, profile.power, profile.pooled_tv, profile.pit_bins, NO_SLOTS)
    floor, cap = (max(1, math.ceil(t * read_share)) for t in (profile.min_pit_tokens, profile.max_pit_tokens))
    design = sample_size.ClassDesign.of(wanted, LR_BOUND, floor, cap, pooled)
    acceptance = None if rounds is None else rounds.sample.acceptance
    return EngineDesign(design, measured.steps / len(rows), generated, measured.steps, rate, acceptance)


def _draft_law(design: EngineDesign, rounds: RoundsScoring | None) -> DraftLawRecord | None:
    """What the engine's counters should count of the cell's speculative rows, pilot and tested
    sample (`losscheck.cells.draft_law`); None without a draft model."""
    from losscheck.cells.draft_law import predicted

    if rounds is None or design.acceptance is None:
        return None
    return predicted(design.acceptance.plus(rounds.sample.acceptance))


def target_side_coverage(
    design: sample_size.ClassDesign, power: PowerAccumulator, alpha_test: float, level: float, tested: int
) -> dict[str, BugClassRecord]:
    """Per target-side bug class, from the tested sample's own p (`power`, its per-token effects):
    its best test and the tokens that test needs at `level`, the cell's power against the catalogue
    point at the `tested` tokens, whether the pilot's design covered it, and its curve (the smallest
    member ρ of its family (1 - ρ)·p + ρ·p' caught at power `level` and 0.8 at the tokens tested)."""
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.sequential import PARTIAL_POWER

    tested = max(tested, 1)
    needed = power.tokens_needed(alpha_test, level)
    coverage: dict[str, BugClassRecord] = {}
    for bug in TARGET_SIDE:
        name = bug.name
        test, tokens = min(((t, n) for t, n in needed[name].items() if t != LR_BOUND), key=lambda tn: tn[1])
        covered = name in design.covered
        coverage[name] = BugClassRecord(
            test=test,
            tokens_needed=tokens,
            pilot_tokens_needed=design.best[name][1],
            power=power.best_power(name, tested, alpha_test),
            covered=covered,
            reach="covered" if covered else "none",
            curve={f"{p:g}": power.smallest_rho(name, tested, alpha_test, p) for p in (level, PARTIAL_POWER)},
        )
    return coverage


def rounds_coverage(
    design: EngineDesign, sample: RoundsSample, alpha_test: float, level: float
) -> dict[str, BugClassRecord]:
    """Per verifier class judged through the draft model, from the tested sample's own p and q:
    the rounds test's tokens needed at `level` (scored tokens), its power at the tokens it scored,
    whether the design covered it, and its curve over the family's members."""
    from losscheck.stats.sequential import PARTIAL_POWER

    power, scored = sample.power, sample.tokens
    records = {}
    for name in power.classes:
        covered = name in design.classes.covered
        needed = power.tokens_needed(name, alpha_test, level)
        pilot = design.classes.best[name][1] * design.rounds_rate
        records[name] = BugClassRecord(
            test=f"rounds.{name}",
            tokens_needed=needed if math.isfinite(needed) else None,
            pilot_tokens_needed=pilot if math.isfinite(pilot) else None,
            power=power.power(name, 1.0, scored, alpha_test),
            covered=covered,
            reach="covered" if covered else "none",
            curve={f"{p:g}": power.smallest_rho(name, scored, alpha_test, p) for p in (level, PARTIAL_POWER)},
        )
    return records


# --- sampling: two-sample (on against off) ---------------------------------------------------------------
def two_sample(ctx: CellContext) -> EngineDraws:
    """The engine's speculative samples against its own samples with drafting off, independent seeds,
    the same number of rows from each prompt on both sides. No reference reproduces the engine's
    target (its weights or numerics are not ones losscheck loads), but losscheck's copy of it in
    fp32 is a *proxy* (`losscheck.cells.proxy_design`): a pilot of the plain side, scored by it,
    sizes the cell by the target-side bug classes; α is split in halves between the per-position
    χ² tests and a U test of the rows' surprisal under the proxy, whose level holds whatever the
    proxy is; the tested plain rows confirm the design."""
    from losscheck.stats.two_sample import two_sample_tests

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    horizon = max(profile.two_sample_horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    alpha_positions = ctx.alpha / 2
    design = yield from _proxy_design(ctx, prompts, horizon)
    n, target_tv = design.rows, design.detectable_tv
    per_prompt = math.ceil(n / len(prompts))
    drawn = yield tuple(request(ctx, prompts, per_prompt, cell.params, horizon, side) for side in (True, False))
    on, off = (tokens.flatten(0, 1) for tokens in drawn)  # [P*m, L] each
    vocab, bins = ctx.engine_vocab()[0], profile.two_sample_bins
    results = two_sample_tests(on, off, vocab, alpha_positions, profile.power, target_tv, max_bins=bins)
    results += _surprisal_test(ctx, prompts, drawn, ctx.alpha - alpha_positions)
    proxy = ctx.engine_target().identity.get("precision")
    facts = SampleFacts(sequences=len(on), prompts=len(prompts), horizon=horizon, proxy_precision=proxy)
    facts = _proxy_confirmed(ctx, facts, design, prompts, drawn[1], horizon)
    return CellOutcome(cell, verdict=combine(cell.id, results, ctx.alpha), facts=_facts(ctx, facts))


def _surprisal_test(
    ctx: CellContext, prompts: list[list[int]], drawn: tuple[torch.Tensor, ...], alpha: float
) -> list[TestResult]:
    """The U test of the rows' surprisal under the proxy, speculative rows against plain rows
    `drawn` ([P, m, L] each) at level `alpha` (`losscheck.cells.attribution`)."""
    from losscheck.cells.attribution import attribution_tests, row_scores

    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(drawn[0].shape[1])]
    sides = [
        row_scores(ctx, f"{ctx.cell.id}-proxy-{i}", target, rows, _generation(ctx, tokens, target), 0.0)
        for i, tokens in enumerate(drawn)
    ]
    return attribution_tests(sides[0], sides[1], ("surprisal",), alpha, ctx.profile.power)


@dataclass(frozen=True)
class TwoSampleDesign:
    """A proxy-sized two-sample cell's design: the rows a side, the TV per position they detect at
    the profile's power, the tests' levels and the classes' design."""

    rows: int
    detectable_tv: float
    levels: Levels
    classes: ProxyDesign
    pilot_sequences: int


def _proxy_design(
    ctx: CellContext, prompts: list[list[int]], horizon: int
) -> Generator[tuple[GenerationRequest, ...], tuple[torch.Tensor, ...], TwoSampleDesign]:
    """A pilot of the plain side (a seed of its own, never tested), scored by the proxy: the rows a
    side each target-side class needs, within the profile's floor and cap (its PIT tokens as rows of
    `horizon` tokens)."""
    from losscheck.cells.proxy_design import Levels, ProxyDesign, proxy_sums
    from losscheck.stats.power import chisquare_detectable_w

    cell, profile = ctx.cell, ctx.profile
    half = ctx.alpha / 2
    levels = Levels(registry.split(half, registry.TWO_SAMPLE, positions=horizon).per_test, half / 2)
    pilot_per_prompt = max(1, math.ceil(profile.engine_pilot_sequences / len(prompts)))
    (pilot,) = yield (request(ctx, prompts, pilot_per_prompt, cell.params, horizon, False, purpose="pilot"),)
    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(pilot_per_prompt)]
    sums = proxy_sums(ctx, target, rows, _generation(ctx, pilot, target))
    floor, cap = (math.ceil(t / horizon) for t in (profile.min_pit_tokens, profile.max_pit_tokens))
    classes = ProxyDesign.of(sums, levels, profile.power, profile.two_sample_bins, floor, cap)
    n = math.ceil(classes.rows / len(prompts)) * len(prompts)  # what the draw gives: whole rows per prompt
    tv = chisquare_detectable_w(n / 2, profile.two_sample_bins, levels.position, profile.power) / 2
    return TwoSampleDesign(classes.rows, tv, levels, classes, len(rows))


def _proxy_confirmed(
    ctx: CellContext,
    facts: SampleFacts,
    design: TwoSampleDesign,
    prompts: list[list[int]],
    plain: torch.Tensor,
    horizon: int,
) -> SampleFacts:
    """The facts of a proxy-sized cell: each class's coverage from the tested plain rows `plain`
    [P, m, L] (the first rows of every prompt, up to `CONFIRM_TOKENS`), checked against the design."""
    from losscheck.cells.proxy_design import proxy_coverage, proxy_not_judged, proxy_sums
    from losscheck.cells.sampled import confirmed_coverage

    profile = ctx.profile
    per_prompt = plain.shape[1]
    first = max(1, min(per_prompt, math.ceil(CONFIRM_TOKENS / (horizon * len(prompts)))))
    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(first)]
    sums = proxy_sums(ctx, target, rows, _generation(ctx, plain[:, :first], target))
    tested = per_prompt * len(prompts)
    coverage = proxy_coverage(
        design.classes, sums, tested, horizon, design.levels, profile.power, profile.two_sample_bins
    )
    coverage = confirmed_coverage(ctx.cell, coverage, profile.power)
    return dataclasses.replace(
        facts,
        pilot_sequences=design.pilot_sequences,
        design_tokens=design.classes.rows * horizon,
        bug_classes=coverage,
        classes_not_judged=proxy_not_judged(),
    )
