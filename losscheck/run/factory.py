"""Building a cell's engine and server: the cell's target, drafter (stressed when the cell says
so), block length and width, with the run's planted bug (`losscheck.run.plant`) if any, served
along the cell's serving axes (`losscheck.serving.axis`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import Engine
from losscheck.serving.axis import ServeContext, Server, build_server, runs_elsewhere

if TYPE_CHECKING:
    from losscheck.plan.cell import Cell
    from losscheck.run.options import Options
    from losscheck.run.plant import Plant
    from losscheck.run.session import Session


def engine(session: Session, cell: Cell) -> Engine:
    """The speculative engine of `cell`, planted when the run plants a bug."""
    target, drafter = session.cell_target(cell), session.drafters(cell.target, cell.precision)[cell.drafter]
    if cell.stress is not None:
        from losscheck.drafters.stress import stressed

        drafter = stressed(drafter, cell.stress, target.vocab_size)
    return planted_engine(session.plant, target, drafter, cell.k, cell.width)


def planted_engine(plant: Plant | None, target: Target, drafter: Drafter, k: int, width: int | None = None) -> Engine:
    """The speculative engine of `drafter` on `target`, with `plant`'s bug when there is one."""
    if plant is None:
        return Engine(target, drafter, k, width)
    if plant.wrap_drafter is not None:
        drafter = plant.wrap_drafter(drafter)
    if plant.wrap_target is not None:
        target = plant.wrap_target(target, k)
    return Engine(target, drafter, k, width, plant.verifier)


def baseline_engine(session: Session, cell: Cell) -> Engine:
    """Plain decoding of `cell`'s target in its precision: the same loop with no drafter (never planted)."""
    return Engine(session.cell_target(cell))


def serve_context(session: Session, cell: Cell) -> ServeContext:
    profile = session.options.profile
    return ServeContext(
        seed=session.options.seed,
        cell_id=cell.id,
        serving=dict(cell.serving),
        max_rows=profile.batch,
        greedy_max_new=profile.greedy_max_new,
        plant=session.plant,
        options=session.options,
        cell=cell,
        rank_server=rank_server,
    )


def server(session: Session, cell: Cell) -> Server:
    """The cell's server: its engine in this process, or, for an axis that runs elsewhere (a
    split), no engine here at all."""
    built = None if runs_elsewhere(cell.serving) else engine(session, cell)
    return build_server(built, serve_context(session, cell))


def rank_server(options: Options, cell: Any) -> Server:
    """`server` in another process (a rank of a split run), from the run's options alone."""
    from losscheck.run.session import Session

    return server(Session(options), cell)
