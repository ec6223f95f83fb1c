"""Sampled cells of losscheck's own loop: teacher-forced PIT on the main target (with the
verifier's conformance checks) and exact enumeration on the small-vocabulary target."""

from __future__ import annotations

import dataclasses
import math

import torch

from losscheck.cells.draw import generate_rows
from losscheck.cells.outcome import CellOutcome, Phases, sampled_outcome
from losscheck.cells.record import BugClassRecord, SampleFacts
from losscheck.cells.sequential_design import SequentialDesign, shortfall
from losscheck.core.generation import Generation
from losscheck.core.history import History, adjust_logits
from losscheck.core.sampling import SamplingParams, make_generator, process_logits
from losscheck.errors import LosscheckError, flag
from losscheck.plan.cell import Cell
from losscheck.plan.modes import Mode
from losscheck.plan.profiles import min_horizon
from losscheck.run.context import CellContext
from losscheck.run.memo import ExactContinuations
from losscheck.serving.axis import Server, requests
from losscheck.stats import registry, sample_size


def run_cell(ctx: CellContext) -> CellOutcome:
    """Certify a cell of losscheck's own loop the way its mode asks."""
    from losscheck.cells.greedy import run_greedy

    run = {Mode.GREEDY: run_greedy, Mode.PIT: run_pit, Mode.EXACT: run_exact}[ctx.cell.mode]
    return run(ctx)


def run_pit(ctx: CellContext) -> CellOutcome:
    """Teacher-forced PIT and exact-conditional tests of the spec loop's sequences, plus the
    conformance of its verifier to standard speculative sampling (`losscheck.cells.conformance`),
    the cell's alpha split evenly over all of them.

    The tested sample is sized by power per bug class (`losscheck.cells.sequential_design`): a
    pilot, drawn from its own stream and never tested, measures from its own p and q what each
    test would see per token under each bug class (`losscheck.stats.bugclass`); the design is the
    tokens the costliest class within the profile's cap needs. The fresh sample then grows look
    by look towards the design and stops at the first look where the data rule out every class
    the design covers (`losscheck.stats.sequential`) and the tested sample's own p and q confirm
    that the design catches every class and member it promised at its power; at the last look,
    a class the tested sample does not confirm is withdrawn by name (`confirmed_coverage`)."""
    from losscheck.cells.conformance import conformance_rtol, recording
    from losscheck.cells.scoring import measure_power

    cell, profile = ctx.cell, ctx.profile
    horizon = profile.pit_horizon(cell.k)
    budget = registry.split(ctx.alpha, registry.PIT, registry.CONDITIONAL, registry.CONFORMANCE)
    clock = Phases()
    server, serving = ctx.served()
    with clock("requests"):  # a warm prefix cache's first turn
        prompts = requests(server, serving, ctx.all_prompts(), horizon, cell.params, "pit")
    with clock("pilot"):
        pilot_rows, pilot = generate_rows(ctx, server, prompts, profile.pilot_sequences, horizon, "pit-pilot")
        measured = measure_power(ctx, ctx.target, pilot_rows, pilot, cell.precision.tolerance)
    with clock("design"):  # from the pilot: the sequential design, the fixed-sample one it replaces, the looks
        design = SequentialDesign.plan(measured, profile, budget)
    sample = _TestedSample(ctx, server, prompts, horizon, design, measured.steps / len(pilot_rows), clock)
    rtol = conformance_rtol(cell.precision.tolerance if cell.precision.reduced else 0.0)
    with recording(server.engine, make_generator(ctx.seed, cell.id, "conformance"), rtol) as recorder:
        stop = design.run(sample.power, sample.grow, clock)
    with clock("score"):
        results, facts = sample.scores.tests(
            budget.share(registry.PIT, registry.CONDITIONAL), profile.pooled_tv, design.limit
        )
    with clock("conformance"):
        if recorder is not None:
            results += recorder.tests(budget.share(registry.CONFORMANCE), profile.power, design.limit)
    with clock("design"):
        coverage = design.confirmed(stop, sample.power)
    coverage = confirmed_coverage(cell, coverage, profile.power)
    outcome = sampled_outcome(
        ctx,
        results,
        Generation.concat(sample.gens),
        dataclasses.replace(
            facts,
            sequences=sample.drawn,
            horizon=horizon,
            phases=clock.seconds,
            pilot_sequences=len(pilot_rows),
            pilot_tokens=int(pilot.mask().sum()),
            design_tokens=design.design.tokens,
            fixed_design_tokens=design.fixed.tokens,
            looks=design.record(stop, sample.scores.tested_tokens),
            bug_classes=coverage,
        ),
    )
    outcome.serving_facts = server.facts()
    return outcome


class _TestedSample:
    """A PIT cell's tested sample, grown look by look (`SequentialDesign.run`): the sequences
    drawn, their scores, and the bug classes' power and rule-out sums from their own p and q."""

    def __init__(
        self,
        ctx: CellContext,
        server: Server,
        prompts: list[list[int]],
        horizon: int,
        design: SequentialDesign,
        per_sequence: float,
        clock: Phases,
    ) -> None:
        from losscheck.cells.scoring import PitScores

        self.ctx, self.server, self.prompts, self.horizon, self.clock = ctx, server, prompts, horizon, clock
        self.per_sequence = max(per_sequence, 1e-9)  # tested tokens per sequence, the pilot's
        self.power = design.tested()
        cell = ctx.cell
        self.scores = PitScores(
            ctx, cell.id, ctx.target, cell.precision.tolerance, self.power, design.pilot.misreported_id
        )
        self.drawn = 0
        self.gens: list[Generation] = []

    def grow(self, look: int, tokens: int) -> None:
        """Draw on to about `tokens` tested tokens (at least one more sequence) and score them."""
        more = max(math.ceil(tokens / self.per_sequence) - self.drawn, 1)
        with self.clock("generate"):
            rows, gen = generate_rows(
                self.ctx, self.server, self.prompts, more, self.horizon, "pit-sample", first=self.drawn
            )
        with self.clock("score"):  # the teacher-forced pass, the PITs, the conditional and rule-out sums
            self.scores.add(rows, gen, part=f"look{look}")
        self.drawn += more
        self.gens.append(gen)


def confirmed_coverage(cell: Cell, coverage: dict[str, BugClassRecord], level: float) -> dict[str, BugClassRecord]:
    """`coverage` with every promise the tested sample does not keep withdrawn by name: a covered
    class caught below `level`, or a member of a family an early stop had to rule out caught below
    the power the design gave it (the pilot underestimated what the cell needs). Such a class is
    NOT COVERED by this cell — no power is claimed for it — and the cell's verdict stays its
    tests': a shortfall of power is not a finding about the engine, so it never fails a cell
    (a FAIL outside the cell's α). The record says why and how to cover it."""
    short = shortfall(coverage, level)
    out = dict(coverage)
    for name, c in short.items():
        said = f"{c.test} power {c.power:.3f} (needs {_tokens(c.tokens_needed)} tokens, the pilot said " + (
            f"{_tokens(c.pilot_tokens_needed)})"
            + "".join(f", at ρ = {m.rho:.3g} power {m.power:.3f} < {m.promised:g}" for m in c.short)
        )
        why = (
            f"cell {cell.id}: the tested sample does not reach the power its design promised — {said}; "
            f"raise {flag('profile')} to thorough to cover it"
        )
        out[name] = dataclasses.replace(c, covered=False, withdrawn=why)
    return out


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
    prompt = len(exact_prompt(ctx))
    if params.stop_ids:
        raise LosscheckError(f"exact mode ends a sequence at EOS only; stop ids {params.stop_ids} need a PIT cell")

    @torch.inference_mode()
    def next_probs(context: torch.Tensor) -> torch.Tensor:
        context = context.to(model.device)  # [M, P + t]
        logits = model.model(input_ids=context).logits[:, -1:]  # [M, 1, V]
        rows, width = context.shape
        lengths, prompts = torch.full((rows,), width), torch.full((rows,), prompt)
        seen = History(context, lengths.to(context.device), prompts.to(context.device), model.eos_id)
        return process_logits(adjust_logits(logits, params, seen, context[:, :0])[:, 0], params).double().cpu()

    return ctx.memo(
        ExactContinuations(target, params, horizon),
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
