"""A sequential PIT cell's design as one object, `SequentialDesign`: from what a pilot measured,
the design and the fixed-sample one it replaces, the looks, the stop rule and what the tested
sample confirms of the design's promises.

Phases, in order:

- *pilot*: the caller's, drawn from its own stream and never tested; it hands over the
  `PowerAccumulator` of its p and q.
- *design* (`SequentialDesign.plan`): the tested tokens the costliest bug class within the cap
  needs at `sequential.design_power`, at least the pooled tests' requirement when the profile
  sets a pooled TV (`ClassDesign`); the fixed-sample design of one look beside it; the looks, the
  ids and the family members an early stop must rule out (`losscheck.stats.design.design_looks`).
- *looks* (`SequentialDesign.run`): the caller grows the tested sample to each look's tokens,
  feeding the accumulator `SequentialDesign.tested` returned.
- *stop rule*: at a look before the last, the cell stops when the data rule out every member the
  design requires (`sequential.Looks.may_stop`) and the tested sample's own p and q keep every
  promise of the design (`shortfall` is empty); a look where only the first holds is
  *unconfirmed*, and the sample grows on.
- *coverage* (`SequentialDesign.coverage`): per bug class, what the tested sample says
  (`losscheck.stats.design.bug_class_coverage`), as records.

Model-free: the caller draws and scores; `losscheck.cells.sampled.run_pit` runs it on the spec
loop, `losscheck.selftest.seqpower` on a Markov chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from losscheck.cells.outcome import Phases
from losscheck.cells.record import BugClassRecord, LooksRecord, bug_class_records
from losscheck.plan.profiles import Profile
from losscheck.stats import registry, sequential
from losscheck.stats.bugclass import LR_BOUND, PowerAccumulator
from losscheck.stats.design import bug_class_coverage, design_looks
from losscheck.stats.pit import pit_required_values
from losscheck.stats.sample_size import ClassDesign


@dataclass(frozen=True)
class Stop:
    """Where a sequential cell stopped and what its tested sample confirmed there.

    stopped_at:  the look it stopped at, from 1 (the last look when it ran to the end)
    early:       whether that is before the last look
    unconfirmed: looks where the data ruled every required member out but the tested sample fell
                 short of a promise, so the cell went on
    coverage:    at an early stop, per bug class, what the tested sample confirmed there; None
                 when it ran to the last look (`SequentialDesign.confirmed` then says it)
    """

    stopped_at: int
    early: bool
    unconfirmed: tuple[int, ...]
    coverage: dict[str, BugClassRecord] | None


@dataclass(frozen=True)
class SequentialDesign:
    """What a pilot fixes before any tested token is drawn.

    pilot:      the pilot's measurements (its p and q), never tested
    design:     the sequential design: its tests at `sequential.design_power` at the last look
    fixed:      the fixed-sample design of one look it replaces, at the profile's power
    looks:      where the cell may stop and what must be ruled out to stop there
    ids:        the misreporting drafter's ids an early stop must rule out
    grid:       per class, the family members ρ whose rule-out e-values the tested sample keeps
    alpha_test: one test's share of the cell's α, the level the bug-class power is judged at
    power:      the profile's power
    """

    pilot: PowerAccumulator
    design: ClassDesign
    fixed: ClassDesign
    looks: sequential.Looks
    ids: list[int]
    grid: dict[str, tuple[float, ...]]
    alpha_test: float
    power: float

    @classmethod
    def plan(cls, pilot: PowerAccumulator, profile: Profile, budget: registry.Split) -> SequentialDesign:
        """The design phase, from the pilot's measurements, the profile and the cell's α split
        over its `pit`, `conditional` and `conformance` families: at most `sequential.max_looks`
        looks between the profile's floor and cap (one when it does not stop early)."""
        limit = sequential.max_looks(profile.min_pit_tokens, profile.max_pit_tokens) if profile.early_stop else 1
        alpha_scored, alpha_test = budget.share(registry.PIT, registry.CONDITIONAL), budget.per_test
        design, fixed = (_class_design(pilot, profile, alpha_scored, alpha_test, looks) for looks in (limit, 1))
        looks, ids, grid = design_looks(pilot, design, alpha_test, profile.power, limit)
        return cls(pilot, design, fixed, looks, ids, grid, alpha_test, profile.power)

    @property
    def limit(self) -> int:
        """The looks the profile allows: the fixed-sample tests' Bonferroni divisor."""
        return self.looks.limit

    def tested(self) -> PowerAccumulator:
        """An empty accumulator for the tested sample, keeping the rule-out e-values of the
        members the design requires (judged where the tests look)."""
        return PowerAccumulator(misreported=self.pilot.misreported_id, grid=self.grid)

    def run(self, tested: PowerAccumulator, grow: Callable[[int, int], None], clock: Phases | None = None) -> Stop:
        """The looks and the stop rule: `grow(look, tokens)` draws the tested sample on to about
        `tokens` tested tokens at look `look` (from 1) and feeds what it drew to `tested` (from
        `SequentialDesign.tested`); the cell stops at the first look before the last where the
        stop rule holds, else at the last. `clock` times the stop rule's coverage as "design"."""
        timed = clock or Phases()
        unconfirmed: list[int] = []
        last = len(self.looks.tokens)
        for look, tokens in enumerate(self.looks.tokens, 1):
            grow(look, tokens)
            if look == last or not self.looks.may_stop(tested.rule_out_log_e(self.ids)):
                continue
            # the data rule every member out; the stop also needs the tested sample's own p and q
            # to keep the design's promise (else it goes on: a stricter stop loses no power or level)
            with timed("design"):
                coverage = self.coverage(tested, early=True)
            if not shortfall(coverage, self.power):
                return Stop(look, True, tuple(unconfirmed), coverage)
            unconfirmed.append(look)
        return Stop(last, False, tuple(unconfirmed), None)

    def confirmed(self, stop: Stop, tested: PowerAccumulator) -> dict[str, BugClassRecord]:
        """Per bug class, what the tested sample confirms where `stop` fell: the stop rule's own
        coverage at an early stop, else from everything it tested."""
        return self.coverage(tested, early=False) if stop.coverage is None else stop.coverage

    def coverage(self, tested: PowerAccumulator, early: bool) -> dict[str, BugClassRecord]:
        """Per bug class, what the tested sample's own p and q say of the design's promises: at
        the design's tokens at an `early` stop, at the tokens it tested when it ran to the end."""
        return bug_class_records(
            bug_class_coverage(
                self.design, self.pilot, tested, self.alpha_test, self.power, self.looks, early, self.ids
            )
        )

    def record(self, stop: Stop, tested_tokens: int) -> LooksRecord:
        """The certificate's record of the looks and where `stop` fell."""
        return LooksRecord(
            tokens=self.looks.tokens,
            allowed=self.limit,
            stopped_at=stop.stopped_at,
            tested_tokens=tested_tokens,
            early=stop.early,
            unconfirmed=stop.unconfirmed,
        )


def _class_design(
    pilot: PowerAccumulator, profile: Profile, alpha_scored: float, alpha_test: float, looks: int
) -> ClassDesign:
    """The tested tokens a PIT cell aims at from its pilot, for a cell that may stop at `looks`
    points: its tests at the power `sequential.design_power` leaves them (the profile's when the
    cell has a single look), the fixed-sample ones at their level / `looks`; with more than one
    look, the cap where a class beyond it is reached at `sequential.PARTIAL_POWER` (its early stop
    then waits for that class's rule-out)."""
    level = profile.power if looks == 1 else sequential.design_power(profile.power)
    alpha_pit = registry.split(alpha_scored, registry.PIT, registry.CONDITIONAL).share(registry.PIT)
    pooled = 0
    if profile.pooled_tv is not None:
        pooled = pit_required_values(alpha_pit / looks, profile.power, profile.pooled_tv)
    # with looks to stop at, a class beyond the cap that the cap reaches partly takes the design to it
    needed = pilot.tokens_needed_at(alpha_test, (level, sequential.PARTIAL_POWER) if looks > 1 else (level,), looks)
    return ClassDesign.of(
        needed[0],
        LR_BOUND,
        profile.min_pit_tokens,
        profile.max_pit_tokens,
        pooled,
        needed[1] if looks > 1 else None,
    )


def shortfall(coverage: dict[str, BugClassRecord], level: float) -> dict[str, BugClassRecord]:
    """The classes whose promise the tested sample does not keep: covered and caught below
    `level`, or short of a family member's promised power."""
    return {
        name: c
        for name, c in coverage.items()
        if (c.covered and (c.power if c.power_checked is None else c.power_checked) < level) or c.short
    }
