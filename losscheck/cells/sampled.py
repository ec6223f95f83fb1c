"""Sampled cells of losscheck's own loop: teacher-forced PIT on the main target (with the
verifier's conformance checks) and exact enumeration on the small-vocabulary target."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from losscheck.cells.draw import generate_rows
from losscheck.cells.outcome import CellOutcome, Phases, sampled_outcome
from losscheck.cells.record import BugClassRecord, LooksRecord, SampleFacts, bug_class_records
from losscheck.core.generation import Generation
from losscheck.core.sampling import SamplingParams, make_generator, process_logits
from losscheck.errors import LosscheckError, UnderpoweredError, flag
from losscheck.plan.cell import Cell
from losscheck.plan.modes import Mode
from losscheck.plan.profiles import Profile, min_horizon
from losscheck.run.context import CellContext
from losscheck.serving.axis import requests
from losscheck.stats import registry, sample_size, sequential
from losscheck.stats.design import bug_class_coverage, design_looks
from losscheck.stats.pit import pit_required_values

if TYPE_CHECKING:
    from losscheck.stats.bugclass import PowerAccumulator


def run_cell(ctx: CellContext) -> CellOutcome:
    """Certify a cell of losscheck's own loop the way its mode asks."""
    from losscheck.cells.greedy import run_greedy

    run = {Mode.GREEDY: run_greedy, Mode.PIT: run_pit, Mode.EXACT: run_exact}[ctx.cell.mode]
    return run(ctx)


def run_pit(ctx: CellContext) -> CellOutcome:
    """Teacher-forced PIT and exact-conditional tests of the spec loop's sequences, plus the
    conformance of its verifier to standard speculative sampling (`losscheck.cells.conformance`),
    the cell's alpha split evenly over all of them.

    The tested sample is sized by power per bug class: a pilot, drawn from its own stream and
    never tested, measures from its own p and q what each test would see per token under each
    bug class (`losscheck.stats.bugclass`); the design is the tokens the costliest class within
    the profile's cap needs. The fresh sample then grows look by look towards the design and
    stops at the first look where the data rule out every class the design covers
    (`losscheck.stats.sequential`) and the tested sample's own p and q confirm that the design
    catches every class and member it promised at its power; at the last look, the cell errors
    unless the tested sample confirms it."""
    from losscheck.cells.conformance import Recorder, conformance_rtol
    from losscheck.cells.scoring import PitScores, measure_power
    from losscheck.stats.bugclass import PowerAccumulator

    cell, profile = ctx.cell, ctx.profile
    horizon = profile.pit_horizon(cell.k)
    prompts = ctx.all_prompts()
    budget = registry.split(ctx.alpha, "pit", "conditional", "conformance")
    alpha_scored, alpha_test = budget.share("pit", "conditional"), budget.per_test
    limit = sequential.max_looks(profile.min_pit_tokens, profile.max_pit_tokens) if profile.early_stop else 1
    clock = Phases()
    server, serving = ctx.served()
    target = ctx.target
    tolerance = cell.precision.tolerance
    with clock("requests"):  # a warm prefix cache's first turn
        prompts = requests(server, serving, prompts, horizon, cell.params, "pit")
    with clock("pilot"):
        pilot_rows, pilot = generate_rows(ctx, server, prompts, profile.pilot_sequences, horizon, "pit-pilot")
        measured = measure_power(ctx, target, pilot_rows, pilot, tolerance)
    with clock("design"):  # from the pilot: the sequential design, the fixed-sample one it replaces, the looks
        design, fixed = (_class_design(measured, profile, alpha_scored, alpha_test, looks) for looks in (limit, 1))
        looks, ids, grid = design_looks(measured, design, alpha_test, profile.power, limit)
    per_sequence = max(measured.steps / len(pilot_rows), 1e-9)  # tested tokens: the looks count those
    engine = server.engine
    recorder = None
    if engine is not None:  # the recorder wraps the verifier in this process only
        recorder = engine.verifier = Recorder(
            engine.verifier,
            make_generator(ctx.seed, cell.id, "conformance"),
            conformance_rtol(cell.precision.tolerance if cell.precision.reduced else 0.0),
        )
    power = PowerAccumulator(misreported=measured.misreported_id, grid=grid)  # judged where the test looks
    scores = PitScores(ctx, cell.id, target, tolerance, power, measured.misreported_id)
    gens: list[Generation] = []
    drawn, stopped, unconfirmed = 0, len(looks.tokens), []
    coverage = None
    for look, tokens in enumerate(looks.tokens, 1):
        more = max(math.ceil(tokens / per_sequence) - drawn, 1)
        with clock("generate"):
            rows, gen = generate_rows(ctx, server, prompts, more, horizon, "pit-sample", first=drawn)
        with clock("score"):  # the teacher-forced pass, the PITs, the conditional and rule-out sums
            scores.add(rows, gen, part=f"look{look}")
        drawn += more
        gens.append(gen)
        if look < len(looks.tokens) and looks.may_stop(power.rule_out_log_e(ids)):
            # the data rule every member out; the stop also needs the tested sample's own p and q
            # to keep the design's promise (else it goes on: a stricter stop loses no power or level)
            with clock("design"):
                coverage = bug_class_records(
                    bug_class_coverage(design, measured, power, alpha_test, profile.power, looks, True, ids)
                )
            if not shortfall(coverage, profile.power):
                stopped = look
                break
            unconfirmed.append(look)
    with clock("score"):
        results, facts = scores.tests(alpha_scored, profile.pooled_tv, limit)
    with clock("conformance"):
        if recorder is not None:
            results += recorder.tests(budget.share("conformance"), profile.power, limit)
    early = stopped < len(looks.tokens)
    if not early:
        with clock("design"):
            coverage = bug_class_records(
                bug_class_coverage(design, measured, power, alpha_test, profile.power, looks, False, ids)
            )
    assert coverage is not None
    require_coverage(cell, coverage, profile.power)
    gen = Generation.concat(gens)
    outcome = sampled_outcome(
        ctx,
        results,
        gen,
        dataclasses.replace(
            facts,
            sequences=drawn,
            horizon=horizon,
            phases=clock.seconds,
            pilot_sequences=len(pilot_rows),
            pilot_tokens=int(pilot.mask().sum()),
            design_tokens=design.tokens,
            fixed_design_tokens=fixed.tokens,
            looks=LooksRecord(
                tokens=tuple(looks.tokens),
                allowed=limit,
                stopped_at=stopped,
                tested_tokens=scores.tested_tokens,
                early=early,
                unconfirmed=tuple(unconfirmed),
            ),
            bug_classes=coverage,
        ),
    )
    outcome.serving_facts = server.facts()
    return outcome


def _class_design(
    measured: PowerAccumulator, profile: Profile, alpha_scored: float, alpha_test: float, looks: int
) -> sample_size.ClassDesign:
    """The tested tokens a PIT cell aims at from its pilot, for a cell that may stop at `looks`
    points: its tests at the power `sequential.design_power` leaves them (the profile's when the
    cell has a single look), the fixed-sample ones at their level / `looks`."""
    from losscheck.stats.bugclass import LR_BOUND

    level = profile.power if looks == 1 else sequential.design_power(profile.power)
    alpha_pit = registry.split(alpha_scored, "pit", "conditional").share("pit")
    pooled = 0
    if profile.pooled_tv is not None:
        pooled = pit_required_values(alpha_pit / looks, profile.power, profile.pooled_tv)
    return sample_size.ClassDesign.of(
        measured.tokens_needed(alpha_test, level, looks),
        LR_BOUND,
        profile.min_pit_tokens,
        profile.max_pit_tokens,
        pooled,
    )


def shortfall(coverage: dict[str, BugClassRecord], level: float) -> dict[str, BugClassRecord]:
    """The classes whose promise the tested sample does not keep: covered and caught below
    `level`, or short of a family member's promised power."""
    return {
        name: c
        for name, c in coverage.items()
        if (c.covered and (c.power if c.power_checked is None else c.power_checked) < level) or c.short
    }


def require_coverage(cell: Cell, coverage: dict[str, BugClassRecord], level: float) -> None:
    """Error (never pass) when the tested sample, from its own p and q, does not keep what the
    design promised: a covered class caught at `level`, and every member of a family an early
    stop had to rule out caught at the power the design gave it — the pilot underestimated what
    the cell needs."""
    short = shortfall(coverage, level)
    if short:
        listed = "; ".join(
            f"{name}: {c.test} power {c.power:.3f} (needs {_tokens(c.tokens_needed)} tokens, "
            f"the pilot said {_tokens(c.pilot_tokens_needed)})"
            + "".join(f", at ρ = {m.rho:.3g} power {m.power:.3f} < {m.promised:g}" for m in c.short)
            for name, c in short.items()
        )
        raise UnderpoweredError(
            f"cell {cell.id}: the tested sample does not reach the power its design promised against the bug "
            f"classes it covers — {listed}. Raise {flag('profile')} to thorough or report this as a losscheck bug."
        )


def _tokens(n: float | None) -> str:
    return "-" if n is None else f"{n:.0f}"


def exact_prompt(ctx: CellContext) -> list[int]:
    """The small target's longest prompt: the most context, still cheap to enumerate from."""
    return max(ctx.prompts("small"), key=len)


def exact_continuations(ctx: CellContext, target: str, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation of `exact_prompt` up to the profile's exact horizon and its exact target
    probability: (sequences [S, L], probabilities [S] float64), memoised per parameters."""
    from losscheck.stats.exact import enumerate_continuations

    model = ctx.target_named(target)
    horizon = ctx.profile.exact_horizon

    @torch.inference_mode()
    def next_probs(context: torch.Tensor) -> torch.Tensor:
        logits = model.model(input_ids=context.to(model.device)).logits[:, -1]
        return process_logits(logits, params).double().cpu()

    return ctx.memo(
        ("exact", target, params, horizon),
        lambda: enumerate_continuations(next_probs, exact_prompt(ctx), horizon, model.eos_id),
    )


def exact_cell_size(ctx: CellContext, n_continuations: int) -> int:
    """Sequences an exact cell draws."""
    profile = ctx.profile
    return sample_size.exact_sequences(
        n_continuations, profile.exact_horizon, ctx.alpha, profile.power, profile.detect_tv
    )


def run_exact(ctx: CellContext) -> CellOutcome:
    from losscheck.stats.exact import exact_tests

    cell, profile = ctx.cell, ctx.profile
    if profile.exact_horizon < min_horizon(cell.k):
        raise LosscheckError(
            f"exact cell {cell.id}: its horizon {profile.exact_horizon} must reach a bonus slot and a second "
            f"round (2k + 2 = {min_horizon(cell.k)}); run exact mode at a smaller k or a longer exact horizon"
        )
    target = ctx.target_named(cell.target)
    prompt = exact_prompt(ctx)
    seqs, probs = exact_continuations(ctx, cell.target, cell.params)
    n = exact_cell_size(ctx, len(seqs))
    _, gen = generate_rows(ctx, ctx.served()[0], [prompt], n, profile.exact_horizon, "exact-sample")
    samples = torch.where(gen.mask(), gen.tokens, target.eos_id if target.eos_id is not None else 0).cpu()
    results = exact_tests(samples, seqs, probs, ctx.alpha, profile.power, profile.detect_tv)
    facts = SampleFacts(sequences=n, horizon=profile.exact_horizon, prompt=tuple(prompt), continuations=len(seqs))
    return sampled_outcome(ctx, results, gen, facts)
