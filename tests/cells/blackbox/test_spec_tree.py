"""losscheck's tree loop behind the black-box interface (`losscheck.engines.spec_tree`): its greedy
and T = 1 engine cells pass, and it gives the cells no draft model, since theirs models a chain's
drafts (its certificate claims no drafter-side bug class)."""

from __future__ import annotations

import pytest


@pytest.mark.usefixtures("one_thread")
def test_the_tree_loop_engine_passes_its_greedy_and_t1_cells():
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(engine="losscheck.engines.spec_tree:spec_tree"))
    engine = session.engine_for(session.plan["engine_greedy_cell"][0])
    assert engine is not None and engine.draft_model() is None and engine.k == 4
    assert engine.name == "spec-tree(branching:2,2,1,1, iid)"
    cells = [*session.plan["engine_greedy_cell"], *(c for c in session.plan["engine_cell"] if c.id == "engine-k4-T1")]
    assert [c.id for c in cells] == ["engine-k4-greedy", "engine-k4-T1"]
    for cell in cells:
        outcome = run_engine_cell(CellContext.of(session, cell))
        assert outcome.passed, outcome.message()
