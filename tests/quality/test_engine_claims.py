"""A one-sample engine cell's claim against a target-side class, checked by simulation with both
stages counted: losscheck's loop behind the black-box interface with the catalogue's
`target_temperature_1.1` planted on its speculative path (`hotter_when_speculating`), 50 T 0.3
cells of fresh run seeds, each sized from its own pilot (its claims confirmed from the pilot's and
the tested rows together) and planned through its second stage. The class binds the design there,
near the profile's cap. A cell whose pilot covers it claims power >= 0.99 (both stages); one whose
pilot puts it just beyond the cap reaches it partly: its design runs to the cap and its early stop
waits for the class's rule-out (`ClassDesign.of`), and it states the power it has there. In each
group, at least the binomial 1e-3 quantile at the smallest power stated must FAIL blamed on
speculation — claims that held would fail this test with probability under 1e-3 a group. Measured
(2026-12-07, 50 cells, ~22 s each): see docs/engine-power.md."""

from __future__ import annotations

import pytest
from scipy import stats

CELLS, LEVEL = 50, 0.99
SEED = 20261310  # the cells' run seeds: SEED + i (fixed after the method)


@pytest.mark.slow  # 50 cells of the tiny loop engine near the cap, each with its second stage (~20 min)
@pytest.mark.usefixtures("one_thread")
def test_a_planted_target_temperature_fails_the_cells_that_claim_it_at_the_power_they_claim():
    from losscheck.cells.engine import run_engine_cell
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    engine = "losscheck.selftest.engines:hotter_when_speculating"
    stated: dict[str, list[float]] = {"covered": [], "partial": []}
    fails = {"covered": 0, "partial": 0}
    for i in range(CELLS):
        session = Session(Options(engine=engine, seed=SEED + i))
        (cell,) = [c for c in session.plan["engine_cell"] if c.id == "engine-k4-T0.3"]
        outcome = run_engine_cell(CellContext.of(session, cell))
        claim = (outcome.facts.bug_classes or {})["target_temperature_1.1"]
        group = "covered" if claim.covered else "partial" if claim.reach == "partial" else None
        if group is None:
            continue  # no claim made (beyond reach, or withdrawn by name): nothing to check
        assert claim.second_stage_power is not None, claim
        assert group == "partial" or claim.power >= LEVEL, claim
        stated[group].append(claim.power)
        attribution = outcome.facts.attribution
        fails[group] += attribution is not None and attribution.finding == "speculation" and not outcome.passed
    assert len(stated["covered"]) >= CELLS // 2, stated  # the check needs cells that claim
    for reach, powers in stated.items():
        if not powers:
            continue
        floor = int(stats.binom.ppf(1e-3, len(powers), min(powers)))
        assert fails[reach] >= floor, (reach, fails[reach], len(powers), min(powers))
