"""The certification tests: one test per cell argument, parametrised by the run's plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from losscheck.errors import CellUnavailable

if TYPE_CHECKING:
    from losscheck.cells.outcome import CellOutcome
    from losscheck.plugin.hooks import RecordSlot
    from losscheck.run.context import CellContext


def certify(run: Callable[[CellContext], CellOutcome], ctx: CellContext, slot: RecordSlot) -> None:
    """Run a cell in its context (the `losscheck_context` fixture's), leave its record in `slot`
    (the `losscheck_record` fixture, whose record travels on the report) and assert it passed; a
    cell this platform cannot run is skipped with the reason (the certificate lists it as not run)."""
    from losscheck.cells.record import RunFacts

    cell = ctx.cell
    # a cell that must not hold the reference target across its run counts no target passes
    lm = None if cell.target not in ("main", "small") or not ctx.holds_reference_target else ctx.target.lm
    passes, tokens = (lm.passes, lm.tokens) if lm is not None else (0, 0)
    started = time.perf_counter()
    try:
        outcome = run(ctx)
    except CellUnavailable as exc:
        from losscheck.plan.scope import hint

        declare = f"; {hint(exc.aspect)}" if exc.aspect else ""
        pytest.skip(f"cell {cell.id} cannot run here: {exc}{declare}")
    slot.record = outcome.to_record(
        RunFacts(
            nodeid=slot.nodeid,
            outcome="passed" if outcome.passed else "failed",
            seconds=round(time.perf_counter() - started, 2),
            # this process's target passes (a split cell's run in its ranks)
            target_passes=None if lm is None else lm.passes - passes,
            target_tokens=None if lm is None else lm.tokens - tokens,
        )
    )
    assert outcome.passed, outcome.message()
