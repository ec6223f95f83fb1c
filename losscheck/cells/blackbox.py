"""Running a black-box engine's cells: the engine with speculation on against itself with it off.

- greedy (`engine_greedy`): on == off token for token on every prompt of the prompt sets;
  a divergence is triaged by the target's float64 top-2 margin (`losscheck.core.divergence`) in the
  engine's precision;
- one-sample (`one_sample`, the engine declares the `precision` losscheck loads its target in):
  the speculative samples scored by teacher-forced PIT (`losscheck.cells.scoring.score_pit`) — no baseline rows;
- two-sample (`two_sample`, `precision = None`): speculative samples against the same engine's
  samples with drafting off, independent seeds (`losscheck.stats.two_sample`).

Sampled horizons are at least 2k + 2 (k the engine's block length), so every row reaches a
second round and a bonus slot; rows cycle over the prompts of every tier.

Each cell is a generator of rounds of requests (`losscheck.cells.engine_phases`): the run decides
the order in which the engine answers them, and no cell holds the reference target across a
round (an engine that keeps one instance alive at a time never has it loaded beside one).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import BugClassRecord, SampleFacts
from losscheck.cells.scoring import score_pit
from losscheck.core.divergence import find_divergences
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.sampling import GREEDY, SamplingParams, derive_seed
from losscheck.engines import BlackBoxEngine, GenerationRequest, lengths
from losscheck.errors import LosscheckError, flag
from losscheck.plan import profiles
from losscheck.plan.matrix import ENGINE
from losscheck.plan.modes import Mode
from losscheck.run.context import CellContext
from losscheck.stats import registry, sample_size
from losscheck.stats.result import combine

if TYPE_CHECKING:
    from losscheck.cells.engine_phases import EngineDraws
    from losscheck.core.target import HFTarget
    from losscheck.stats.bugclass import PowerAccumulator


def run_engine_cell(ctx: CellContext) -> CellOutcome:
    """Certify a black-box engine's cell the way its mode asks. When the run draws its engine cells
    side by side (`CellContext.engine_batch`: an engine that keeps one instance alive at a time),
    the first of them draws them all (`losscheck.cells.engine_phases`) and each takes its own
    outcome; otherwise the cell is drawn alone, speculative side first."""
    from losscheck.cells.engine_phases import draw_side_by_side

    engine = _engine(ctx)
    batch = ctx.engine_batch()
    vocab_size, eos = ctx.engine_vocab()

    def drawn() -> dict[str, CellOutcome | Exception]:
        cells = {cell.id: engine_draws(ctx.of_cell(cell)) for cell in batch}
        return draw_side_by_side(engine, cells, vocab_size, eos, ctx.release_engine_target).results

    results = ctx.memo(("engine-cells", batch), drawn) if len(batch) > 1 else drawn()
    result = results[ctx.cell.id]
    if isinstance(result, Exception):
        raise result
    return result


def engine_draws(ctx: CellContext) -> EngineDraws:
    """The cell's rounds of draws, as its mode asks (`losscheck.plan.memory.rounds`)."""
    _engine(ctx)
    steps = {Mode.ENGINE_GREEDY: engine_greedy, Mode.ONE_SAMPLE: one_sample, Mode.TWO_SAMPLE: two_sample}
    return steps[ctx.cell.mode](ctx)


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
) -> GenerationRequest:
    """A request for `n` continuations of each prompt, whose answer is a validated LongTensor
    [len(prompts), n, horizon] (EOS-padded), seeded from the run seed, the cell, the side and the
    `purpose` ("pilot": a sample of its own, never tested)."""
    side = "speculative" if speculative else "baseline"
    seed = derive_seed(ctx.seed, ctx.cell.id, *((side, purpose) if purpose else (side,)))
    return GenerationRequest(
        prompts=tuple(map(tuple, prompts)),
        n=n,
        params=params,
        seed=seed,
        max_new_tokens=horizon,
        speculative=speculative,
    )


def as_generation(tokens: torch.Tensor, eos: int, k: int, params: SamplingParams) -> Generation:
    """EOS-padded engine rows `tokens` [N, L] as a `Generation` (no loop counters: a black box
    reports none)."""
    return Generation(tokens, lengths(tokens, eos), LoopStats.empty(k), params)


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
    scorable = cell.target != ENGINE
    tolerance = cell.precision.tolerance if scorable and cell.precision.reduced else 0.0
    tiers = ctx.prompt_tiers
    asked = [request(ctx, ctx.prompts(tier), 1, GREEDY, max_new, side) for side in (True, False) for tier in tiers]
    drawn = yield tuple(asked)
    eos = ctx.engine_vocab()[1]
    outcome = CellOutcome(cell, strict=ctx.strict)
    for t, tier in enumerate(tiers):
        on, off = (as_generation(drawn[s * len(tiers) + t][:, 0], eos, engine.k, GREEDY) for s in (0, 1))
        # the target is loaded only where on and off differ: a margin to read
        model = ctx.engine_target().model if scorable and not torch.equal(on.tokens, off.tokens) else None
        outcome.divergences += find_divergences(model, tier, ctx.prompts(tier), on, off, tolerance)
    prompts = sum(len(ctx.prompts(tier)) for tier in tiers)
    outcome.facts = _facts(ctx, SampleFacts(prompts=prompts, max_new_tokens=max_new, near_tie_margin=tolerance))
    return outcome


# --- sampling: one-sample (teacher-forced PIT) ---------------------------------------------------------
def one_sample(ctx: CellContext) -> EngineDraws:
    """The engine's speculative samples, scored by losscheck's copy of its target in the engine's
    precision: randomized PIT uniform (`losscheck.stats.pit`) and the exact-conditional tests,
    at a top-k / top-p cut-off another implementation may draw elsewhere within that precision's
    logit tolerance, the law conditioned on the tokens every implementation keeps
    (`losscheck.cells.scoring.cutoff_law`).

    The sample is sized for the pooled tests' detectable TV and for the bug classes a black box can
    be judged on — those whose law reads the target's p alone (`buglaws.TARGET_SIDE`: the engine
    reports no q and no slots): a pilot of its own, never tested, says what each needs
    (`_target_side_design`), and the tested sample's own p confirms it (`target_side_coverage`).

    The control: the same engine's samples with speculation off, scored the same way under the
    other half of the cell's alpha. A lossless engine whose kernels or truncation rules differ from
    losscheck's `process_logits` on its copy of the target fails the speculative tests and the
    control alike; a failing control is reported as "the reference differs from the engine", not as
    lossiness.

    Two rounds: the pilot (speculative), then the sample and the control (both sides); the
    reference target is read only between and after them."""
    from losscheck.cells.sampled import require_coverage
    from losscheck.stats.bugclass import PowerAccumulator

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    horizon = max(profile.horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    half = ctx.alpha / 2
    alpha_test = registry.split(half, registry.PIT, registry.CONDITIONAL).per_test  # one test's share, as a PIT cell's
    pilot_per_prompt = max(1, math.ceil(profile.pilot_sequences / len(prompts)))
    (pilot,) = yield (request(ctx, prompts, pilot_per_prompt, cell.params, horizon, True, purpose="pilot"),)
    design, per_sequence, pilot_tokens, pilot_tested = _target_side_design(ctx, prompts, pilot, alpha_test)
    pooled = sample_size.pit_sequences(half, profile.power, profile.detect_tv, profile.pit_bins, per_sequence)
    n = max(pooled, design.sequences(per_sequence))
    per_prompt = math.ceil(n / len(prompts))
    rows = [p for p in prompts for _ in range(per_prompt)]  # prompt-major, as the engine returns them
    drawn = yield tuple(request(ctx, prompts, per_prompt, cell.params, horizon, side) for side in (True, False))
    target = ctx.engine_target()
    power = PowerAccumulator()  # gathered from the speculative sample only
    scored = []
    for tokens, speculative, stream in zip(drawn, (True, False), (cell.id, f"{cell.id}-control"), strict=True):
        gen = _on_device(as_generation(tokens.flatten(0, 1), ctx.engine_vocab()[1], engine.k, cell.params), target)
        scored.append(
            score_pit(
                ctx,
                stream,
                target,
                rows,
                gen,
                cell.precision.tolerance,
                half,
                pooled_tv=profile.detect_tv,
                power=power if speculative else None,
            )
        )
    (results, facts), (control, _) = scored
    control = [dataclasses.replace(r, name=f"control.{r.name}", scope="control") for r in control]
    coverage = target_side_coverage(design, power, alpha_test, profile.power)
    require_coverage(cell, coverage, profile.power)
    failed = [r.name for r in control if not r.passed]
    problems = []
    if failed:
        problems.append(
            f"the reference differs from the engine: its output with speculation off fails {', '.join(failed)} "
            "under losscheck's copy of the target, so the speculative tests cannot judge losslessness here (the "
            "engine's kernels, logits processing or truncation differ from losscheck's); certify it two-sample "
            "(an engine of precision None) instead"
        )
    facts = dataclasses.replace(
        facts,
        sequences=len(rows),
        prompts=len(prompts),
        horizon=horizon,
        pilot_sequences=math.ceil(profile.pilot_sequences / len(prompts)) * len(prompts),
        pilot_tokens=pilot_tokens,
        pilot_tested_tokens=pilot_tested,
        design_tokens=design.tokens,
        bug_classes=coverage,
    )
    return CellOutcome(
        cell,
        verdict=combine(cell.id, results + control, ctx.alpha),
        problems=problems,
        facts=_facts(ctx, facts),
    )


def _on_device(gen: Generation, target: HFTarget) -> Generation:
    gen.tokens, gen.lengths = gen.tokens.to(target.device), gen.lengths.to(target.device)
    return gen


def _target_side_design(
    ctx: CellContext, prompts: list[list[int]], pilot: torch.Tensor, alpha_test: float
) -> tuple[sample_size.ClassDesign, float, int, int]:
    """From a pilot of the engine's speculative samples `pilot` [P, m, L] (a seed of its own, never
    tested): the design of the target-side bug classes (`buglaws.TARGET_SIDE`) at the profile's
    power, with the design's margin, within the profile's cap; the pilot's tested tokens per
    sequence (EOS and cut-off uncertainty leave some of the horizon untested), its generated
    tokens, and its tested ones."""
    from losscheck.cells.scoring import measure_power
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    target = ctx.engine_target()
    gen = _on_device(as_generation(pilot.flatten(0, 1), ctx.engine_vocab()[1], engine.k, cell.params), target)
    rows = [p for p in prompts for _ in range(pilot.shape[1])]
    # the whole catalogue, so that pit.bug_classes is judged over the classes the test scores
    measured = measure_power(ctx, target, rows, gen, cell.precision.tolerance)
    needed = measured.tokens_needed(alpha_test, profile.power)
    design = sample_size.ClassDesign.of(
        {bug.name: needed[bug.name] for bug in TARGET_SIDE}, LR_BOUND, 1, profile.max_pit_tokens
    )
    return design, measured.steps / len(rows), int(gen.mask().sum()), measured.steps


def target_side_coverage(
    design: sample_size.ClassDesign, power: PowerAccumulator, alpha_test: float, level: float
) -> dict[str, BugClassRecord]:
    """Per target-side bug class, from the tested sample's own p: its best test and the tokens that
    test needs at `level`, the cell's power against the catalogue point at the tokens it tested,
    whether the pilot's design covered it, and its curve (the smallest member ρ of its family
    (1 - ρ)·p + ρ·p' caught at power `level` and 0.8 at the tokens tested)."""
    from losscheck.stats.bugclass import LR_BOUND
    from losscheck.stats.buglaws import TARGET_SIDE
    from losscheck.stats.sequential import PARTIAL_POWER

    tested = max(power.steps, 1)
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


# --- sampling: two-sample (on against off) ---------------------------------------------------------------
def two_sample(ctx: CellContext) -> EngineDraws:
    """The engine's speculative samples against its own samples with drafting off, independent seeds,
    the same number of rows from each prompt on both sides: one round, no target read."""
    from losscheck.stats.two_sample import two_sample_tests

    cell, engine, profile = ctx.cell, _engine(ctx), ctx.profile
    horizon = max(profile.two_sample_horizon, min_horizon(engine))
    prompts = ctx.all_prompts()
    n = sample_size.two_sample_rows(ctx.alpha, profile.power, profile.detect_tv, profile.two_sample_bins, horizon)
    per_prompt = math.ceil(n / len(prompts))
    drawn = yield tuple(request(ctx, prompts, per_prompt, cell.params, horizon, side) for side in (True, False))
    on, off = (tokens.flatten(0, 1) for tokens in drawn)  # [P*m, L] each
    results = two_sample_tests(
        on, off, ctx.engine_vocab()[0], ctx.alpha, profile.power, profile.detect_tv, max_bins=profile.two_sample_bins
    )
    return CellOutcome(
        cell,
        verdict=combine(cell.id, results, ctx.alpha),
        facts=_facts(ctx, SampleFacts(sequences=len(on), prompts=len(prompts), horizon=horizon)),
    )
