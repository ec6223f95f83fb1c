"""The certification tests: one test per cell argument, parametrised by the run's plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from losscheck.errors import CellUnavailable


def certify(run: Callable[[Any, Any], Any], session: Any, cell: Any, record: dict[str, Any]) -> None:
    """Run `cell`, put its record on the report and assert it passed; a cell this platform cannot
    run is skipped with the reason (the certificate lists it as not run)."""
    lm = None if cell.target not in ("main", "small") else session.cell_target(cell).lm
    passes, tokens = (lm.passes, lm.tokens) if lm is not None else (0, 0)
    started = time.perf_counter()
    try:
        outcome = run(session, cell)
    except CellUnavailable as exc:
        from losscheck.plan.scope import hint

        declare = f"; {hint(exc.aspect)}" if exc.aspect else ""
        pytest.skip(f"cell {cell.id} cannot run here: {exc}{declare}")
    record.update(outcome.to_record(), seconds=round(time.perf_counter() - started, 2))
    if lm is not None:  # this process's target passes (a split cell's run in its ranks)
        record.update(target_passes=lm.passes - passes, target_tokens=lm.tokens - tokens)
    assert outcome.passed, outcome.message()
