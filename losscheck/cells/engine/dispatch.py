"""Dispatch of a black-box engine cell: the phases its mode asks for, behind the check that the
engine serves every sampling parameter the cell sets, drawn alone or side by side with the run's
other engine cells (`losscheck.cells.engine.phases`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from losscheck.cells.engine.greedy import engine_greedy
from losscheck.cells.engine.handle import engine_of
from losscheck.cells.engine.one_sample import one_sample
from losscheck.cells.engine.two_sample import two_sample
from losscheck.cells.outcome import CellOutcome
from losscheck.plan.modes import Mode
from losscheck.run.context import CellContext
from losscheck.run.memo import EngineBatch

if TYPE_CHECKING:
    from losscheck.cells.engine.phases import EngineDraws


def run_engine_cell(ctx: CellContext) -> CellOutcome:
    """Certify a black-box engine's cell the way its mode asks. When the run draws its engine cells
    side by side (`CellContext.engine_batch`: an engine that keeps one instance alive at a time),
    the first of them draws them all (`losscheck.cells.engine.phases`) and each takes its own
    outcome; otherwise the cell is drawn alone, speculative side first."""
    from losscheck.cells.engine.draft_law import checked
    from losscheck.cells.engine.phases import draw_side_by_side

    engine = engine_of(ctx)
    batch = ctx.engine_batch()
    vocab_size, eos = ctx.engine_vocab()

    def drawn() -> dict[str, CellOutcome | Exception]:
        cells = {cell.id: engine_draws(ctx.of_cell(cell)) for cell in batch}
        try:
            return draw_side_by_side(engine, cells, vocab_size, eos, ctx.release_engine_target).results
        finally:
            ctx.release_engine()  # the last phase's instance: nothing of the batch needs it

    results = ctx.memo(EngineBatch(batch), drawn) if len(batch) > 1 else drawn()
    result = results[ctx.cell.id]
    if isinstance(result, Exception):
        raise result
    result.facts = checked(result.facts, not result.passed)  # the engine's counters are in: its draft law checked
    return result


def engine_draws(ctx: CellContext) -> EngineDraws:
    """The cell's rounds of draws, as its mode asks (`losscheck.plan.memory.rounds`), behind
    `_fail_closed`."""
    steps = {Mode.ENGINE_GREEDY: engine_greedy, Mode.ONE_SAMPLE: one_sample, Mode.TWO_SAMPLE: two_sample}
    return _fail_closed(ctx, steps[ctx.cell.mode])


def _fail_closed(ctx: CellContext, draws: Callable[[CellContext], EngineDraws]) -> EngineDraws:
    """`draws(ctx)`, unless the cell sets a sampling parameter its engine does not declare it
    serves: that is refused by name before any draw (`losscheck.engines.served`), raised where the
    cell is first resumed, so that the rest of a side-by-side batch still draws."""
    from losscheck.engines.served import declared, refuse

    engine = engine_of(ctx)
    eos = ctx.engine_vocab()[1] if ctx.cell.params.stop_ids else None
    refuse(ctx.cell.params, engine.name, declared(engine), eos=eos)
    return (yield from draws(ctx))
