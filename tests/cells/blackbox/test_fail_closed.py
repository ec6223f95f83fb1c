"""Fail closed (`losscheck.engines.served`): a served cell whose parameter the engine does not
declare is refused by name before any row is drawn, and the engine's other cells still run."""

from __future__ import annotations

import pytest

from losscheck.engines.served import UnsupportedParameter

CALLS: list[object] = []


class Undeclared:
    """losscheck's loop behind an engine that declares no `serves`: it would pass every field on,
    but says nothing of it, so losscheck may not assume it does."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.k, self.precision = inner, "undeclared", inner.k, inner.precision

    def generate(self, request):
        CALLS.append(request.params)
        return self.inner.generate(request)


def undeclared_engine(target):
    from losscheck.engines.spec_loop import spec_loop

    return Undeclared(spec_loop(target))


@pytest.mark.usefixtures("one_thread")
def test_a_served_cell_of_an_engine_that_declares_nothing_is_refused_before_any_draw():
    from losscheck.cells.engine import engine_draws
    from losscheck.plan.scope import parse_scope
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(
        Options(engine="tests.cells.blackbox.test_fail_closed:undeclared_engine", scope=parse_scope("+served"))
    )
    cells = {c.id: c for c in session.plan["engine_cell"]}
    assert "engine-k4-T1-minp0.1" in cells and "engine-k4-T1" in cells
    CALLS.clear()
    refused = engine_draws(CellContext.of(session, cells["engine-k4-T1-minp0.1"]))
    with pytest.raises(UnsupportedParameter, match=r"engine 'undeclared' cannot serve min_p=0.1: the engine does not"):
        next(refused)
    assert CALLS == []  # nothing drawn
    plain = engine_draws(CellContext.of(session, cells["engine-k4-T1"]))
    (pilot,) = next(plain)  # the core three need no declaring: its pilot is asked for
    assert pilot.params == cells["engine-k4-T1"].params
