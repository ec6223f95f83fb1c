"""Where rows end, judged by its law (`pit.stop_hazard`, `losscheck.stats.streams`): an engine that
counts min tokens in rounds on its speculative path (its stops masked too long: SGLang PR #33643's
shape) fails its one-sample cell on the count of rows' ends, blamed on speculation, while every
token it emits is one the target gives positive probability."""

from __future__ import annotations

import pytest


@pytest.mark.usefixtures("one_thread")
def test_an_engine_that_counts_min_tokens_in_rounds_fails_on_where_its_rows_end():
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    options = Options(
        engine="losscheck.selftest.engines:min_tokens_counted_in_rounds", sampling=("min_tokens=6 stop_ids=5",)
    )
    session = Session(options)
    (cell,) = [c for c in session.plan["engine_cell"] if c.id.endswith("min6-stop5")]
    outcome = run_engine_cell(CellContext.of(session, cell))
    assert not outcome.passed, outcome.message()
    attribution = outcome.facts.attribution
    assert attribution is not None and attribution.finding == "speculation", attribution
    assert "pit.stop_hazard" in [f.split(" ")[0] for f in attribution.first_stage_failed], attribution
    # the second stage reads where rows end too: speculative rows end later than plain ones
    ends = next(r for r in outcome.verdict.results if r.name == "attribution.ends")
    assert not ends.passed, outcome.message()
