"""What one cell reads of its run, built once per cell (`CellContext.of`).

A cell takes a `CellContext`, never the run's `Session`: its share of the family-wise alpha, the
options it reads (seed, profile, memory budget, strictness), its target in its precision, the
prompts, the black-box engine, what cells share (`memo`), where it reports progress, and how to
build its server and its plain-decoding baseline. The models stay the session's (loaded once per
process, lazily: a two-sample engine cell never loads a target), reached only through these
typed members.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

from losscheck.progress import QUIET, Progress
from losscheck.run.memo import EngineVocab, MemoKey

if TYPE_CHECKING:
    from losscheck.core.engine import Engine
    from losscheck.core.target import HFTarget
    from losscheck.engines import BlackBoxEngine
    from losscheck.plan.cell import Cell
    from losscheck.plan.profiles import Profile
    from losscheck.run.session import Session
    from losscheck.serving.axis import ServeContext, Server

T = TypeVar("T")


@dataclass(eq=False)
class CellContext:
    cell: Cell
    alpha: float  # the cell's share of the family-wise alpha (Bonferroni over the matrix's statistical cells)
    seed: int  # the run's seed: every stream of the cell is derived from it and the cell's id
    profile: Profile
    memory_budget_bytes: int
    strict: bool  # greedy near-ties fail too
    progress: Progress  # where the cell reports its stages (the plugin's terminal line, else nothing)
    _session: Session

    @classmethod
    def of(cls, session: Session, cell: Cell, progress: Progress = QUIET) -> CellContext:
        opts = session.options
        return cls(
            cell,
            session.per_test_alpha,
            opts.seed,
            opts.profile,
            opts.memory_budget_mib << 20,
            opts.strict,
            progress,
            session,
        )

    @cached_property
    def target(self) -> HFTarget:
        """The cell's target in the cell's precision."""
        return self._session.cell_target(self.cell)

    def target_named(self, name: str) -> HFTarget:
        """Target `name` ("main", or "small": the exact-mode fixture) in the run's base precision."""
        return self._session.target(name)

    def engine_target(self) -> HFTarget:
        """losscheck's copy of a black-box engine's target (the main one) in the cell's precision (a
        two-sample cell's proxy in `Session.proxy_precision`).
        An engine that keeps one instance alive at a time releases it first: the reference target
        and an engine instance are never loaded together (`release_engine_target` is the other half).
        The engine's draft model (`hold_draft`) comes onto the run's device with it: whoever asks
        for the reference target scores."""
        from losscheck.engines.pool import instances_of, one_at_a_time
        from losscheck.plan.cell import OWN_TARGET

        if one_at_a_time(self.engine):
            instances = instances_of(self.engine)
            assert instances is not None
            instances.close()
        proxy = self.cell.target == OWN_TARGET  # a two-sample cell's: the proxy, in its own precision
        target = self._session.target("main", self._session.proxy_precision if proxy else self.cell.precision.target)
        self._session.models.place_drafts()
        return target

    def hold_draft(self, draft: HFTarget) -> HFTarget:
        """The engine's draft model `draft` (on the CPU), kept under the run's memory plan: on the
        run's device only beside the reference target (`losscheck.run.models.Models.hold_draft`)."""
        return self._session.models.hold_draft(draft)

    def release_engine(self) -> None:
        """After a batch of engine cells: close the engine's instance still alive when the engine
        keeps one instance alive at a time (the next batch, or the run's end, needs none of it)."""
        from losscheck.engines.pool import instances_of, one_at_a_time

        if one_at_a_time(self.engine):
            instances = instances_of(self.engine)
            assert instances is not None
            instances.close()

    def release_engine_target(self) -> None:
        """Before an engine instance is used: drop losscheck's copies of the engine's target, and
        move its draft model off the device, when the engine keeps one instance alive at a time
        (they come back when a cell scores)."""
        from losscheck.engines.pool import one_at_a_time

        if one_at_a_time(self.engine):
            self._session.models.release("main")
            self._session.models.park_drafts()

    @property
    def holds_reference_target(self) -> bool:
        """Whether the reference target may stay loaded through the cell (not for the cells of an
        engine that keeps one instance alive at a time: it is loaded only while they score)."""
        from losscheck.engines.pool import one_at_a_time
        from losscheck.plan.cell import ENGINE

        return not (self.cell.drafter == ENGINE and one_at_a_time(self.engine))

    def engine_vocab(self) -> tuple[int, int]:
        """(vocabulary size, EOS id) of the engine's target, read once per run (EOS 0 when it has none)."""

        def read() -> tuple[int, int]:
            target = self.engine_target()
            return target.vocab_size, target.eos_id if target.eos_id is not None else 0

        return self.memo(EngineVocab(self.cell.precision.target), read)

    def engine_batch(self) -> tuple[Cell, ...]:
        """The engine cells drawn side by side with this one (`losscheck.cells.engine.phases`): every
        engine cell of this cell's engine variant this process runs when the engine keeps one
        instance alive at a time (each side is then built as few times as the cells allow), else
        this cell alone."""
        from losscheck.engines.pool import one_at_a_time

        cells = self._session.engine_cells
        if one_at_a_time(self.engine) and self.cell in cells:
            return tuple(c for c in cells if c.variant == self.cell.variant)  # one engine variant at a time
        return (self.cell,)

    def of_cell(self, cell: Cell) -> CellContext:
        """The context of another cell of the same run, reporting to the same place."""
        return CellContext.of(self._session, cell, self.progress)

    @property
    def prompt_tiers(self) -> tuple[str, ...]:
        """The main target's non-empty prompt tiers."""
        return self._session.prompt_tiers

    def prompts(self, tier: str) -> list[list[int]]:
        """Prompt set `tier` of the main target, or "small": the exact-mode target's."""
        return self._session.prompts(tier)

    def all_prompts(self) -> list[list[int]]:
        """Every prompt of every tier of the main target, tier by tier."""
        return [p for tier in self.prompt_tiers for p in self.prompts(tier)]

    @property
    def engine(self) -> BlackBoxEngine | None:
        """The cell's black-box engine (`--losscheck-engine`, or the variant of it the cell names:
        `Session.engine_for`), or None."""
        return self._session.engine_for(self.cell)

    def memo(self, key: MemoKey, make: Callable[[], T]) -> T:
        """`make()`, computed once per key for the whole run (what cells share)."""
        result: T = self._session.memo(key, make)
        return result

    def served(self) -> tuple[Server, ServeContext]:
        """The cell's server and the context it was built with (`losscheck.run.factory.served`)."""
        from losscheck.run import factory

        return factory.served(self._session, self.cell)

    def baseline_engine(self) -> Engine:
        """Plain decoding of the cell's target in its precision: the same loop, no drafter."""
        from losscheck.run import factory

        return factory.baseline_engine(self._session, self.cell)

    @cached_property
    def acceptance_rule(self) -> str | None:
        """The rule the cell's drafter verifies with when it has one of its own
        (`Drafter.acceptance_rule`, e.g. a speculators checkpoint's verifier_accept_k), else None."""
        drafter = self._session.drafters(self.cell.target, self.cell.precision).get(self.cell.drafter)
        rule = getattr(drafter, "acceptance_rule", None)
        return str(rule) if rule else None
