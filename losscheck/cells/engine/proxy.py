"""A two-sample engine cell sized by bug classes through a *proxy* reference.

An engine whose target losscheck cannot load in the engine's form (`precision = None`; a
`quantization` variant: a Q8_0 target) is certified two-sample, its speculative rows against its
own plain rows. losscheck still loads the same model in fp32 (`--target`; for a quantized variant,
the model unquantized): the proxy. Teacher-forced on the engine's own plain rows, the proxy's p
says what each target-side bug class (`buglaws.TARGET_SIDE`) would do to the tokens at every
position and to each row's surprisal, and so how many rows the per-position tests and the
surprisal U test need to catch it (`losscheck.stats.two_sample_power`). A pilot of the
engine's plain side (never tested) sizes the cell; the tested plain rows confirm it, as a
one-sample cell's tested sample does (`confirmed_coverage`). The figures are the proxy's: the
tested plain rows' own surprisal scores check that it is their law (mean 0 in the model's standard
errors, `proxy_withdrawn`; else every claim is withdrawn by name), and the effects are read against
the larger of the model's and the rows' measured variance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from losscheck.cells.engine.handle import CONFIRM_TOKENS, generation, pilot_request
from losscheck.cells.record import BugClassRecord, SampleFacts
from losscheck.engines import GenerationRequest
from losscheck.stats import registry
from losscheck.stats.buglaws import CATALOGUE
from losscheck.stats.sample_size import DESIGN_MARGIN
from losscheck.stats.two_sample_power import MarginalSums, SurprisalSums

if TYPE_CHECKING:
    from losscheck.cells.scoring import ForcedProbs
    from losscheck.core.generation import Generation
    from losscheck.core.target import HFTarget
    from losscheck.run.context import CellContext

POSITIONS, SURPRISAL = "two_sample.position", "attribution.surprisal"  # the tests with a power model


@dataclass
class ProxySums:
    """What the proxy says of some rows, for both tests' power models."""

    marginals: MarginalSums
    surprisal: SurprisalSums

    def needed(self, name: str, levels: Levels, power: float, max_bins: int, cap: int) -> dict[str, float]:
        """Test -> rows a side it needs to catch class `name` at `power` (math.inf: not within `cap`)."""
        score = self.surprisal.rows_needed(name, levels.score_tail, power)
        return {
            POSITIONS: self.marginals.rows_needed(name, levels.position, power, max_bins, cap),
            SURPRISAL: score if score <= cap else math.inf,
        }

    def power_at(self, test: str, name: str, rows: int, levels: Levels, max_bins: int) -> float:
        if test == POSITIONS:
            return self.marginals.power_at(name, rows, levels.position, max_bins)
        return self.surprisal.power_at(name, rows, levels.score_tail)


@dataclass(frozen=True)
class Levels:
    """The levels of a proxy-sized cell's tests: each position's χ² test, and the surprisal U
    test's one tail (it is two-sided)."""

    position: float
    score_tail: float


@dataclass(frozen=True)
class ProxyDesign:
    """rows: rows a side the cell draws; best: class -> (its best test, the rows a side that test
    needs at the design's power; math.inf: not within `cap`); covered: the classes within the cap,
    cheapest first."""

    rows: int
    best: dict[str, tuple[str, float]]
    covered: tuple[str, ...]
    floor: int
    cap: int

    @classmethod
    def of(cls, sums: ProxySums, levels: Levels, power: float, max_bins: int, floor: int, cap: int) -> ProxyDesign:
        best = {}
        for bug in sums.marginals.classes:
            needed = sums.needed(bug.name, levels, power, max_bins, cap)
            best[bug.name] = min(needed.items(), key=lambda tn: tn[1])
        covered = tuple(sorted((c for c, (_, n) in best.items() if n * DESIGN_MARGIN <= cap), key=lambda c: best[c][1]))
        most = max((best[c][1] for c in covered), default=0.0)
        return cls(min(cap, max(floor, math.ceil(most * DESIGN_MARGIN))), best, covered, floor, cap)


def proxy_sums(ctx: CellContext, target: HFTarget, rows: list[list[int]], gen: Generation) -> ProxySums:
    """The proxy `target`'s sums over the rows `gen` (prompts `rows`): the marginals at every
    position, a finished row's EOS pad counted as the point mass it is on both sides, and the
    surprisal score's moments over the generated positions."""
    from losscheck.cells.scoring import teacher_forced_pit

    eos = ctx.engine_vocab()[1]
    generated = gen.mask()  # [N, L]
    sums = ProxySums(MarginalSums(), SurprisalSums())

    def observe(at: slice, forced: ForcedProbs) -> None:
        probs = forced.probs.double()  # [n, L, V]
        read = generated[at].to(probs.device)  # [n, L]
        pad = torch.zeros_like(probs[0, 0])
        pad[eos] = 1.0
        filled = torch.where(read[..., None], probs, pad)
        sums.marginals.add(filled, torch.ones_like(read))
        sums.surprisal.add(probs, read & ~forced.ambiguous, gen.tokens[at].to(probs.device))

    v = torch.zeros(gen.tokens.shape, dtype=torch.float64, device=target.device)
    teacher_forced_pit(target, rows, gen, v, ctx.memory_budget_bytes, ctx.profile.batch, observe=observe)
    return sums


def proxy_coverage(
    design: ProxyDesign, sums: ProxySums, rows: int, horizon: int, levels: Levels, level: float, max_bins: int
) -> dict[str, BugClassRecord]:
    """Per target-side class, from the tested plain rows' proxy sums: its best test and the rows a
    side that test needs at `level` (as tokens a side: rows × `horizon`), the cell's power with
    `rows` a side, whether the design covered it."""
    records = {}
    for name, (_, pilot) in design.best.items():
        needed = sums.needed(name, levels, level, max_bins, max(design.cap, rows))
        test, tokens = min(needed.items(), key=lambda tn: tn[1])
        records[name] = BugClassRecord(
            test=test,
            tokens_needed=tokens * horizon if math.isfinite(tokens) else None,
            pilot_tokens_needed=pilot * horizon if math.isfinite(pilot) else None,
            power=max(sums.power_at(t, name, rows, levels, max_bins) for t in needed),
            covered=name in design.covered,
            reach="covered" if name in design.covered else "none",
        )
    why = proxy_withdrawn(sums)
    if why is not None:
        records = {name: replace(r, covered=False, withdrawn=why) for name, r in records.items()}
    return records


# |z| of the tested plain rows' mean surprisal score beyond which the proxy is not their law: the
# two-sided 1e-3 normal point (a proxy that is the engine's law loses its claims once in 1,000 cells)
PROXY_Z = 3.29


def proxy_withdrawn(sums: ProxySums) -> str | None:
    """Why the proxy's figures describe nothing, or None: the tested plain rows' own surprisal
    scores under the proxy centre on 0 where it is the law they were drawn from; beyond `PROXY_Z`
    standard errors it is not (another checkpoint, a quantization that moved the law), and every
    power it would state is the proxy's, not the engine's."""
    z = sums.surprisal.centre_z()
    if z is None or abs(z) <= PROXY_Z:
        return None
    return (
        f"the engine's plain rows are not the proxy's law: their mean surprisal score under it is {z:+.1f} "
        f"standard errors from 0 (|z| > {PROXY_Z:g}; measured variance {sums.surprisal.measured_ratio():.2f}× "
        "the proxy's), so no power is claimed from it; certify with the engine's own target "
        "(one-sample) to have claims"
    )


def proxy_not_judged() -> dict[str, str]:
    """The catalogue's classes a proxy-sized two-sample cell has no power model for, and why."""
    from losscheck.stats.hidden_rounds import Q_CONTRACT

    reason = "a two-sample cell reads no q or slots: only the target-side classes (p alone) have a power model"
    return {bug.name: reason for bug in CATALOGUE if not bug.target_side} | dict.fromkeys(Q_CONTRACT, reason)


# --- the proxy phase of a two-sample cell ---------------------------------------------------------
@dataclass(frozen=True)
class TwoSampleDesign:
    """A proxy-sized two-sample cell's design: the rows a side, the TV per position they detect at
    the profile's power, the tests' levels and the classes' design."""

    rows: int
    detectable_tv: float
    levels: Levels
    classes: ProxyDesign
    pilot_sequences: int


def proxy_design(
    ctx: CellContext, prompts: list[list[int]], horizon: int
) -> Generator[tuple[GenerationRequest, ...], tuple[torch.Tensor, ...], TwoSampleDesign]:
    """A pilot of the plain side (a seed of its own, never tested), scored by the proxy: the rows a
    side each target-side class needs, within the profile's floor and cap (its PIT tokens as rows of
    `horizon` tokens)."""
    from losscheck.stats.power import chisquare_detectable_w

    profile = ctx.profile
    half = ctx.alpha / 2
    levels = Levels(registry.split(half, registry.TWO_SAMPLE, positions=horizon).per_test, half / 2)
    asked, pilot_per_prompt = pilot_request(ctx, prompts, horizon, speculative=False)
    (pilot,) = yield (asked,)
    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(pilot_per_prompt)]
    sums = proxy_sums(ctx, target, rows, generation(ctx, pilot, target))
    floor, cap = (math.ceil(t / horizon) for t in (profile.min_pit_tokens, profile.max_pit_tokens))
    classes = ProxyDesign.of(sums, levels, profile.power, profile.two_sample_bins, floor, cap)
    n = math.ceil(classes.rows / len(prompts)) * len(prompts)  # what the draw gives: whole rows per prompt
    tv = chisquare_detectable_w(n / 2, profile.two_sample_bins, levels.position, profile.power) / 2
    return TwoSampleDesign(classes.rows, tv, levels, classes, len(rows))


def proxy_confirmed(
    ctx: CellContext,
    facts: SampleFacts,
    design: TwoSampleDesign,
    prompts: list[list[int]],
    plain: torch.Tensor,
    horizon: int,
) -> SampleFacts:
    """The facts of a proxy-sized cell: each class's coverage from the tested plain rows `plain`
    [P, m, L] (the first rows of every prompt, up to `CONFIRM_TOKENS`), checked against the design."""
    from losscheck.cells.sampled import confirmed_coverage

    profile = ctx.profile
    per_prompt = plain.shape[1]
    first = max(1, min(per_prompt, math.ceil(CONFIRM_TOKENS / (horizon * len(prompts)))))
    target = ctx.engine_target()
    rows = [p for p in prompts for _ in range(first)]
    sums = proxy_sums(ctx, target, rows, generation(ctx, plain[:, :first], target))
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
