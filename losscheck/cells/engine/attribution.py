"""The second stage of a black-box engine's one-sample cell: is a rejection speculation's doing?

The first stage tests the engine's speculative rows against losscheck's copy of its target (the
*reference*). A rejection there has two explanations: speculation changes the engine's output
law, or the reference differs from the engine's own target (its kernels, precision or logits
processing; on a GPU a bf16 engine never matches an fp32 reference exactly). Only after a
rejection, the cell draws fresh rows from both sides, m each, and compares them two-sample on
*row scores*: functions of one row under the reference that the failing tests sum
(`SCORES`), one paired sign-flip test per score (`losscheck.stats.second_stage`), α split over them.

Planned with the first (`SecondStagePlan`, `losscheck.stats.second_stage`): the scores that read
the classes the cell claims (`surprisal`, `support` and each judged verifier class's log-LR) are
compared whatever failed, the failing tests' own scores beside them, on as many rows as give every
class the second stage's share of the power. A cell's claim against a class is then its chance
to FAIL, P(S1)·P(S2); where the second stage does not confirm (the reference differs), the cell's
claims are the second stage's own.

Level: the sides draw as many rows per prompt, independent of each other and of the first stage;
a lossless engine gives a prompt's rows one law on both sides, so each pair's two rows are
exchangeable and each sign-flip test has its level whatever the reference is. A cell FAILs only
when both stages reject: its false alarm is at most α whether the reference is exact (the first
stage's level) or not (the second's). A first-stage rejection the second does not confirm is
reported as a reference mismatch, and the cell's verdict is the second stage's, with its
detectable shift and its claims stated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from losscheck.cells.engine.handle import engine_of, first_token, generation, request, with_engine_facts
from losscheck.cells.logprob_check import logprob_problems
from losscheck.cells.outcome import CellOutcome
from losscheck.cells.record import AttributionRecord, BugClassRecord, SampleFacts
from losscheck.cells.scoring import ForcedProbs, teacher_forced_pit
from losscheck.core.sampling import make_generator
from losscheck.engines import DraftModel
from losscheck.errors import LosscheckError
from losscheck.stats.buglaws import TARGET_SIDE
from losscheck.stats.conditional import surprisal_scores
from losscheck.stats.hidden_rounds import CLASSES
from losscheck.stats.registry import ATTRIBUTION, StatTest, register, run_family
from losscheck.stats.result import TestResult, combine
from losscheck.stats.second_stage import (
    RowShift,
    SupportShift,
    detectable_shift,
    sign_flip_test,
    stage_two_power,
)
from losscheck.stats.streams import top_tokens

if TYPE_CHECKING:
    from losscheck.cells.engine.phases import EngineDraws
    from losscheck.cells.engine.rounds import RoundsScoring
    from losscheck.core.generation import Generation
    from losscheck.core.target import HFTarget
    from losscheck.run.context import CellContext
    from losscheck.stats.bugclass import PowerAccumulator
    from losscheck.stats.hidden_rounds import RoundsSample

TINY = 1e-300
# Row scores, each a sum over the row's tested tokens (or their mean); which failing test reads which:
SCORES = {
    "surprisal": "Σ y(x): pit.surprisal's bounded, centred score of the tokens' surprisal (temperature, processors)",
    "pit_mean": "mean of u - 1/2 over the row's randomized PITs (a shifted law)",
    "pit_spread": "mean of |u - 1/2| - 1/4 (a law too flat or too peaked)",
    "repeats": "Σ (1[x repeats an id of the output] - p(those ids)) (penalties)",
    "support": "the row's tokens of probability 0 under the reference (a cut-off or mask kept them)",
    "argmax": "Σ (1[x is the top token] - p(top token)): tokens at the argmax beyond their law (a greedy fallback)",
    "ends": "Σ (1[x ends the row] - p(EOS or a stop id)): the row's end against the target's hazard (where rows stop)",
}
# a second stage's rows a side at most, in generated tokens, as a multiple of the profile's cap:
# drawn only after a first-stage rejection, so they cost nothing under H0
SECOND_STAGE_CAP = 2


@dataclass(frozen=True)
class SecondStagePlan:
    """A one-sample cell's second stage, fixed from its first stage's sums, whatever its tests
    found: its rows a side per prompt, the row scores it compares whatever failed, and per class
    the power of the score that reads it at `alpha` — one score's level when the stage compares
    every score it may (`comparable`): a lower bound, whichever scores the failing tests add."""

    per_prompt: int
    scores: tuple[str, ...]
    alpha: float
    power: dict[str, float]


def planned_scores(judged: tuple[str, ...]) -> tuple[str, ...]:
    """The scores a second stage always compares: `surprisal` (the target-side classes),
    `support` (a token the reference cannot emit) and the log-LR of each verifier class in `judged`."""
    return ("surprisal", "support", *(f"rounds.{name}" for name in judged))


def comparable(judged: tuple[str, ...]) -> int:
    """How many row scores a second stage may compare, with the verifier classes `judged`."""
    return len(SCORES) + len(judged)


def scores_for(failed: list[str]) -> tuple[str, ...]:
    """The row scores that read what the failing tests `failed` (result names) read."""
    out: list[str] = []
    for name in failed:
        base = name.split("[")[0]
        if base.startswith("rounds."):
            picks = [base]
        elif base in ("pit.surprisal", "pit.bug_classes"):
            picks = ["surprisal"]
        elif base == "pit.repeats":
            picks = ["repeats"]
        elif base == "pit.support":
            picks = ["support"]
        elif base == "pit.greedy_fallback":
            picks = ["argmax"]
        elif base == "pit.stop_hazard":
            picks = ["ends"]
        else:
            picks = ["surprisal", "pit_mean", "pit_spread"]
        out += [p for p in picks if p not in out]
    return tuple(out)


def row_scores(
    ctx: CellContext,
    stream: str,
    target: HFTarget,
    rows: list[list[int]],
    gen: Generation,
    tolerance: float,
    rounds: RoundsScoring | None = None,
) -> dict[str, torch.Tensor]:
    """Every row score of `gen` (sequences continuing `rows`) under the reference: name -> [N]
    (the rounds classes' log-LRs at ρ = 1 too when `rounds` is given). A token of probability 0
    (no PIT) scores as u = 1, on either side alike."""
    n = gen.tokens.shape[0]
    generated = gen.mask()
    surprisal = torch.zeros(n, dtype=torch.float64)
    repeats = torch.zeros(n, dtype=torch.float64)
    impossible = torch.zeros(n, dtype=torch.float64)
    argmax = torch.zeros(n, dtype=torch.float64)
    ends = torch.zeros(n, dtype=torch.float64)
    end_ids = torch.tensor(
        ((target.eos_id,) if target.eos_id is not None else ()) + gen.params.stop_ids, dtype=torch.long
    )

    def observe(at: slice, forced: ForcedProbs) -> None:
        p = forced.probs.double()  # [c, L, V]
        tokens = gen.tokens[at].to(p.device)  # [c, L]
        scored = (generated[at].to(p.device) & ~forced.ambiguous).double()
        drawn = p.gather(-1, tokens[..., None]).squeeze(-1)  # [c, L]
        y = surprisal_scores(p.flatten(0, 1))[0].view_as(p)  # [c, L, V] (what the power sums model)
        surprisal[at] = (y.gather(-1, tokens[..., None]).squeeze(-1) * scored).sum(-1).cpu()
        impossible[at] = ((drawn <= 0) & generated[at].to(p.device)).double().sum(-1).cpu()
        seen = torch.zeros_like(p, dtype=torch.bool)  # [c, L, V] ids of the output before each position
        seen[:, 1:].scatter_(-1, tokens[:, :-1, None], True)
        seen = seen.to(torch.uint8).cummax(1).values.bool()
        hit = seen.gather(-1, tokens[..., None]).squeeze(-1).double()  # [c, L]
        repeats[at] = ((hit - (p * seen).sum(-1)) * scored).sum(-1).cpu()
        top, at_top = top_tokens(p, tokens)
        argmax[at] = ((at_top.double() - top) * scored).sum(-1).cpu()
        stops = end_ids.to(p.device)
        hazard = p[..., stops].sum(-1)  # [c, L]
        ends[at] = ((torch.isin(tokens, stops).double() - hazard) * scored).sum(-1).cpu()
        if rounds is not None:  # its row scores alone: no power sums (most of the rounds scoring's cost)
            rounds.observe(rows[at], gen, at, forced, power_rows=torch.zeros(len(rows[at]), dtype=torch.bool))

    v = torch.rand(gen.tokens.shape, generator=make_generator(ctx.seed, stream, "attribution-v"), dtype=torch.float64)
    u, _, left_out = teacher_forced_pit(
        target, rows, gen, v.to(target.device), ctx.memory_budget_bytes, ctx.profile.batch, tolerance, observe=observe
    )
    tested = (generated.cpu() & ~left_out.cpu()).double()
    centred = torch.nan_to_num(u.cpu().double(), nan=1.0) - 0.5  # [N, L]
    count = tested.sum(-1).clamp_min(1)
    out = {
        "surprisal": surprisal,
        "pit_mean": (centred * tested).sum(-1) / count,
        "pit_spread": ((centred.abs() - 0.25) * tested).sum(-1) / count,
        "repeats": repeats,
        "support": impossible,
        "argmax": argmax,
        "ends": ends,
    }
    if rounds is not None:
        out.update({f"rounds.{c}": rounds.sample.row_scores(c) for c in rounds.sample.power.classes})
    return out


@dataclass(frozen=True)
class RowScorePair:
    """What the second stage's tests read: each side's row scores, name -> [N] (`row_scores`)."""

    on: dict[str, torch.Tensor]
    off: dict[str, torch.Tensor]


def _paired_test(name: str, on: torch.Tensor, off: torch.Tensor, alpha: float, power: float) -> TestResult:
    """Row score `name`, the i-th speculative row against the i-th speculation-off row (one
    prompt's), by `second_stage.sign_flip_test` at `alpha`: a rounds class's score one-sided (a
    verifier with the class scores higher), the others two-sided. States the mean shift, in
    standard deviations of one row's score (both sides' alike, so √2 of a pair's), that it
    detects at `power`."""
    two_sided = not name.startswith("rounds.")
    statistic, p_value = sign_flip_test(on, off, two_sided)
    m = len(on)
    a, b = on.numpy(), off.numpy()
    return TestResult(
        name=f"attribution.{name}",
        expected=f"speculative and speculation-off rows of one prompt exchangeable in the row score {name} "
        f"({SCORES.get(name, 'the class log-LR at rho = 1')})",
        observed=f"median {np.median(a):.4g} with speculation, {np.median(b):.4g} without ({m} pairs); "
        f"sign-flip statistic {statistic:.3g}",
        statistic=statistic,
        p_value=p_value,
        alpha=alpha,
        n=2 * m,
        power=power,
        detectable={"d": math.sqrt(2) * detectable_shift(m, alpha, power, two_sided)},
    )


def _registered(name: str) -> Callable[[RowScorePair, float, float], TestResult]:
    def run(values: RowScorePair, alpha: float, power: float) -> TestResult:
        return _paired_test(name, values.on[name], values.off[name], alpha, power)

    return run


def _needs(name: str) -> frozenset[str]:
    """The input a row score's test reads: a second stage compares only the failing tests' scores."""
    return frozenset({f"row_score:{name}"})


ROW_SCORES = (*SCORES, *(f"rounds.{c.name}" for c in CLASSES))  # every score a second stage may compare
for _name in ROW_SCORES:
    register(StatTest(f"attribution.{_name}", ATTRIBUTION, "pooled", _registered(_name), needs=_needs(_name)))


def attribution_tests(
    on: dict[str, torch.Tensor], off: dict[str, torch.Tensor], names: tuple[str, ...], alpha: float, power: float
) -> list[TestResult]:
    """One U test per row score of `names` (the registered `attribution.*` tests, family
    `ATTRIBUTION`), speculative rows `on` against speculation-off rows `off`, α split evenly over
    them: the scores not compared are inputs the stage lacks, and spend nothing."""
    unknown = set(names) - set(ROW_SCORES)
    if unknown:
        raise LosscheckError(f"no row score named {sorted(unknown)}; the second stage compares {list(ROW_SCORES)}")
    unread = frozenset().union(*(_needs(n) for n in ROW_SCORES if n not in names))
    return run_family(ATTRIBUTION, RowScorePair(on, off), alpha, power, missing=unread)


def plan_second_stage(
    ctx: CellContext,
    power: PowerAccumulator,
    rounds: RoundsSample | None,
    judged: tuple[str, ...],
    covered: set[str],
    per_sequence: float,
    floor: int,
    horizon: int,
) -> SecondStagePlan:
    """The second stage of a one-sample cell (`losscheck.stats.second_stage`), from the tested
    sample's own sums, whatever its tests found: per class the law of the row scores that read it
    (`surprisal` for a target-side class; its own log-LR, and `support` for its mass outside p's
    support, for a verifier class judged through the draft model, `judged`), and the rows a side
    that give every class in `covered` (those the first stage covers or reaches partly) at least
    `stage_two_power` — at least `floor` per prompt (the
    first stage's design), at most `SECOND_STAGE_CAP` times the profile's cap in generated tokens
    (rows of `horizon`). Its power is stated
    at α / (every row score the stage may compare), whichever the first stage's failing tests
    add. The rows are drawn only after a first-stage rejection: under H0 they cost nothing."""
    profile, prompts = ctx.profile, len(ctx.all_prompts())
    alpha = ctx.alpha / comparable(judged)
    # per class the scores that read it: the best one sizes the stage and states its power
    ways: dict[str, tuple[RowShift | SupportShift, ...]] = {
        bug.name: (power.surprisal_shift(bug.name, max(per_sequence, 1e-9)),) for bug in TARGET_SIDE
    }
    if rounds is not None:
        ways |= {name: (rounds.power.row_shift(name), rounds.power.support_shift(name)) for name in judged}
    level = stage_two_power(profile.power)
    wanted = (min(w.rows_needed(alpha, level) for w in ways[name]) for name in covered if name in ways)
    needed = max((n for n in wanted if math.isfinite(n)), default=0.0)  # a class it cannot reach: withdrawn
    cap = max(floor, math.ceil(SECOND_STAGE_CAP * profile.max_pit_tokens / max(horizon, 1) / prompts))
    per_prompt = min(max(floor, math.ceil(needed / prompts)), cap)
    return SecondStagePlan(
        per_prompt=per_prompt,
        scores=planned_scores(judged),
        alpha=alpha,
        power={name: max(w.power(per_prompt * prompts, alpha) for w in found) for name, found in ways.items()},
    )


def both_stages(coverage: dict[str, BugClassRecord], second: dict[str, float]) -> dict[str, BugClassRecord]:
    """Each class's claim as the cell's chance to FAIL under it: the first stage's power times
    the second's (independent rows), the second's beside it."""
    return {
        name: dataclasses.replace(c, power=c.power * second.get(name, 0.0), second_stage_power=second.get(name, 0.0))
        for name, c in coverage.items()
    }


def second_stage_claims(
    ctx: CellContext, claims: dict[str, BugClassRecord] | None, plan: SecondStagePlan
) -> dict[str, BugClassRecord] | None:
    """Where the second stage did not confirm a first-stage rejection, the cell's verdict is
    the second stage's: each class's claim is that stage's power against it, withdrawn by name
    below the profile's power (`confirmed_coverage`)."""
    from losscheck.cells.sampled import confirmed_coverage

    if claims is None:
        return None
    own = {
        name: dataclasses.replace(c, power=plan.power.get(name, 0.0), second_stage_power=plan.power.get(name, 0.0))
        for name, c in claims.items()
    }
    return confirmed_coverage(ctx.cell, own, ctx.profile.power)


# --- the attribution phase of a one-sample cell ---------------------------------------------------
def attribute(
    ctx: CellContext,
    prompts: list[list[int]],
    plan: SecondStagePlan,
    horizon: int,
    failed: list[TestResult],
    facts: SampleFacts,
    drafter: DraftModel | None,
) -> EngineDraws:
    """The second stage after the first rejected with `failed`: `plan`'s fresh rows per prompt and
    side, compared on its scores and the failing tests'. It confirms: a FAIL blamed on
    speculation. It does not: the reference differs, and the cell's claims are the second
    stage's own power (`plan.power`)."""
    from losscheck.cells.engine.rounds import RoundsScoring

    cell, engine = ctx.cell, engine_of(ctx)
    names = tuple(dict.fromkeys((*plan.scores, *scores_for([r.name for r in failed]))))
    per_prompt = plan.per_prompt
    rows = [p for p in prompts for _ in range(per_prompt)]
    asked = tuple(
        request(
            ctx,
            prompts=prompts,
            n=per_prompt,
            horizon=horizon,
            speculative=side,
            purpose="attribution",
        )
        for side in (True, False)
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
            generation(ctx, tokens, target),
            cell.precision.tolerance,
            None if scorer is None else RoundsScoring(scorer.model, engine.k, scorer.law, first_token(engine)),
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
    claims = facts.bug_classes if blamed else second_stage_claims(ctx, facts.bug_classes, plan)
    facts = dataclasses.replace(facts, attribution=record, bug_classes=claims)
    return CellOutcome(
        cell, verdict=combine(cell.id, second, ctx.alpha), problems=problems, facts=with_engine_facts(ctx, facts)
    )
