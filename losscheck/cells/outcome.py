"""What a cell found: `CellOutcome`, the typed findings of one cell (statistical verdict,
divergences, loop statistics, oracle problems, the facts of its sample), which explain themselves
in `message()` and become the certificate's `CellRecord` in `to_record()`. The certification tests
only assert on it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from losscheck import acceptance
from losscheck.cells.ends import end_problems, ends_in_blocks
from losscheck.cells.logprob_check import logprob_problems
from losscheck.cells.record import (
    AcceptanceRecord,
    CellRecord,
    DivergenceRecord,
    RunFacts,
    SampleFacts,
    VerdictRecord,
)
from losscheck.core.divergence import Divergence
from losscheck.core.generation import Generation, LoopStats
from losscheck.errors import flag
from losscheck.jsonrecord import Scalar, decode, encode
from losscheck.plan.cell import ORACLE, Cell
from losscheck.serving.axis import record as serving_record
from losscheck.stats.result import CellVerdict, TestResult, combine

if TYPE_CHECKING:
    from losscheck.run.context import CellContext


@dataclass
class CellOutcome:
    """What one cell found."""

    cell: Cell
    verdict: CellVerdict | None = None  # statistical cells
    divergences: list[Divergence] = field(default_factory=list)  # greedy cells
    acceptance: dict[str, LoopStats] = field(default_factory=dict)  # prompt group -> loop counters
    problems: list[str] = field(default_factory=list)  # e.g. the oracle rejected a draft
    facts: SampleFacts = field(default_factory=SampleFacts)  # sample sizes, horizon, design, looks…
    serving_facts: dict[str, dict[str, Scalar]] = field(default_factory=dict)  # serving axis -> what it measured
    strict: bool = False  # near-tie divergences fail too (--losscheck-strict)

    @property
    def details(self) -> dict[str, object]:
        """Deprecated: the sample's facts as the JSON object they used to be; read `facts`."""
        import warnings

        warnings.warn(
            "CellOutcome.details is deprecated: read CellOutcome.facts (a SampleFacts); it will be removed after 0.1.0",
            DeprecationWarning,
            stacklevel=2,
        )
        facts = encode(self.facts)
        assert isinstance(facts, dict)
        return facts

    @property
    def kind(self) -> str:
        return self.cell.mode

    @property
    def failing_divergences(self) -> list[Divergence]:
        """Divergences that fail the cell: all of them under `strict`, else all but near-ties."""
        return [d for d in self.divergences if self.strict or not d.near_tie]

    @property
    def near_ties(self) -> int:
        return sum(d.near_tie for d in self.divergences)

    @property
    def passed(self) -> bool:
        statistical = self.verdict is None or self.verdict.passed
        return statistical and not self.failing_divergences and not self.problems

    def message(self) -> str:
        if self.verdict is not None:
            lines = [self.verdict.message()]
        else:
            same = (
                "equals"
                if not self.divergences
                else "DIFFERS FROM"
                if not self.passed
                else "differs at near-ties only from"
            )
            lines = [
                f"cell {self.cell.id}: greedy output {same} the baseline on {self.facts.prompts} prompts "
                f"x {self.facts.max_new_tokens} tokens ({self.cell.precision.label()}; "
                f"{self.near_ties} near-tie divergences{', failing under ' + flag('strict') if self.strict else ''})"
            ]
            lines += ["  " + d.describe() for d in self.divergences[:10]]
        lines += ["  " + p for p in self.problems]
        if self.facts.acceptance_rule:  # a checkpoint that brings its own rule names it
            lines.append(f"  the drafter ran its own acceptance rule: {self.facts.acceptance_rule}")
        for group, stats in self.acceptance.items():
            conditional = acceptance.shown(stats.conditional_acceptance())
            lines.append(
                f"  {group}: acceptance length {stats.acceptance_length:.3f}, conditional slot acceptance {conditional}"
            )
        return "\n".join(lines)

    def to_record(self, run: RunFacts) -> CellRecord:
        """The cell's entry in the certificate, with how its test ran."""
        c = self.cell
        verdict = None if self.verdict is None else decode(VerdictRecord, self.verdict.to_dict(), "verdict")
        return CellRecord(
            cell=c.id,
            run=run,
            kind=self.kind,
            drafter=c.drafter,
            k=c.k,
            width=c.width,
            params=c.params.label(),
            target=c.target,
            precision=c.precision.label(),
            passed=self.passed,
            near_ties=self.near_ties,
            verdict=verdict,
            divergences=tuple(decode(DivergenceRecord, d.to_dict(), "divergence") for d in self.divergences),
            acceptance={
                group: AcceptanceRecord.of(stats, f"acceptance.{group}") for group, stats in self.acceptance.items()
            },
            problems=tuple(self.problems),
            serving=serving_record(c.serving),
            serving_facts=self.serving_facts,
            engine_axes=dict(c.variant),
            sample=self.facts,
        )


def oracle_problems(cell: Cell, acceptance: dict[str, LoopStats]) -> list[str]:
    """The self-draft oracle must have every draft accepted (the target drafting for itself). Only
    in fp32: in reduced precision the drafting (one token at a time) and the scoring (k+1 at once)
    round differently, so near-ties may reject; the acceptance is still reported."""
    if cell.drafter != ORACLE or cell.precision.reduced:
        return []
    return [
        f"self-draft oracle accepted {int(s.accepted.sum())}/{int(s.proposed.sum())} drafts on {group} "
        "prompts; drafting with the target itself must be accepted with probability 1"
        for group, s in acceptance.items()
        if not s.all_accepted
    ]


def sampled_outcome(ctx: CellContext, results: list[TestResult], gen: Generation, facts: SampleFacts) -> CellOutcome:
    acceptance = {"all": gen.stats}
    target = ctx.target_named(ctx.cell.target)
    eos, vocab = target.eos_id, target.vocab_size
    counted = ends_in_blocks(gen, eos, vocab)
    if counted is not None:
        strings = ctx.cell.params.stop_strings is not None  # the string counts only where the cell has strings
        facts = dataclasses.replace(
            facts,
            ends=counted.ends,
            ends_in_block=counted.ends_in_block,
            string_ends=counted.string_ends if strings else None,
            string_ends_in_block=counted.string_ends_in_block if strings else None,
        )
    return CellOutcome(
        ctx.cell,
        verdict=combine(ctx.cell.id, results, ctx.alpha),
        acceptance=acceptance,
        problems=oracle_problems(ctx.cell, acceptance)
        + [f"ends: {p}" for p in end_problems(gen, eos, vocab)]
        + logprob_problems(facts),
        facts=with_rule(ctx, facts),
    )


def with_rule(ctx: CellContext, facts: SampleFacts) -> SampleFacts:
    """`facts` naming the cell drafter's own acceptance rule when it verifies with one
    (`Drafter.acceptance_rule`, e.g. a speculators checkpoint's verifier_accept_k)."""
    return dataclasses.replace(facts, acceptance_rule=ctx.acceptance_rule or None)


class Phases:
    """Wall seconds a cell spends in each of its phases (`with phases("generate"): ...`), for the
    certificate's cost report."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.perf_counter() - started, 3)
