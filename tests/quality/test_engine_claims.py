"""A one-sample engine cell's claim against a target-side class, checked by simulation with both
stages counted: losscheck's loop behind the black-box interface with the catalogue's
`target_temperature_1.1` planted on its speculative path (`hotter_when_speculating`), 50 T 0.3
cells of fresh run seeds, each sized from its own pilot at the engine floor (one row a prompt)
and planned through its second stage. The class binds the design there, near the profile's cap:
a cell whose pilot puts it beyond the cap claims nothing of it (NOT COVERED). Of the cells that
claim it (each at power >= 0.99, both stages), at least the binomial 1e-3 quantile at 0.99 must
FAIL blamed on speculation — a claim of 0.99 that held would fail this test with probability
under 1e-3. Measured (2026-12-07, 50 cells, ~22 s each): see docs/engine-power.md."""

from __future__ import annotations

import pytest
from scipy import stats

CELLS, LEVEL = 50, 0.99


@pytest.mark.slow  # 50 cells of the tiny loop engine near the cap, each with its second stage (~20 min)
@pytest.mark.usefixtures("one_thread")
def test_a_planted_target_temperature_fails_the_cells_that_claim_it_at_the_power_they_claim():
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    engine = "losscheck.selftest.engines:hotter_when_speculating"
    claiming = fails = 0
    for i in range(CELLS):
        session = Session(Options(engine=engine, seed=20261210 + i))
        (cell,) = [c for c in session.plan["engine_cell"] if c.id == "engine-k4-T0.3"]
        outcome = run_engine_cell(CellContext.of(session, cell))
        claim = (outcome.facts.bug_classes or {})["target_temperature_1.1"]
        if not claim.covered:
            continue  # no claim made: nothing to check
        assert claim.power >= LEVEL and claim.second_stage_power is not None, claim
        claiming += 1
        attribution = outcome.facts.attribution
        fails += attribution is not None and attribution.finding == "speculation" and not outcome.passed
    floor = int(stats.binom.ppf(1e-3, claiming, LEVEL))
    assert claiming >= CELLS // 2, claiming  # the check needs cells that claim
    assert stats.binom.cdf(floor - 1, claiming, LEVEL) < 1e-3
    assert fails >= floor, (fails, claiming)
