"""Mutant tier (`pytest -m mutants`): the lossless gate must catch every planted bug (docs/mutants.md).

Each mutant runs the gate cells it shows in through the gate's own runners, with the gate's
sample sizes and the per-test α of `pytest -m lossless` (α / the gate's statistical-test count,
whatever this run collected), until one cell fails. Greedy mutants must be caught by greedy
cells, sampling mutants by statistical cells. The control runs the unmodified engine on the
cells each mutant tries first — the cells that do the catching — in the same run. (The
recurrent-state mutants need a hybrid target: `losscheck mutants --target
fixtures/hybrid_target --drafter fixtures/hybrid_drafter_a`.)
"""

from __future__ import annotations

import pytest

from losscheck.selftest import catalogue

pytestmark = pytest.mark.mutants

BUNDLED_ONLY = "the mutant tier plants its bugs in the bundled models; drop --losscheck-drafter/-target"


@pytest.mark.parametrize("name", [m.name for m in catalogue()])
def test_mutant_is_caught(name, losscheck_session):
    from losscheck.selftest import get_mutant
    from losscheck.selftest.catch import run_mutant

    if losscheck_session.options.drafter or losscheck_session.options.target:
        pytest.skip(BUNDLED_ONLY)
    report = run_mutant(losscheck_session, get_mutant(name))
    assert report.cells, f"mutant {name} shows in none of the gate's cells"
    assert report.caught, report.message()


def test_unmodified_engine_passes_the_catching_cells(losscheck_session):
    from losscheck.selftest.catch import gate_session, run_control

    if losscheck_session.options.drafter or losscheck_session.options.target:
        pytest.skip(BUNDLED_ONLY)
    session = gate_session(losscheck_session, None)
    heads = [cells[0] for cells in (m.cells(session.plan, session.options.profile) for m in catalogue()) if cells]
    control = run_control(losscheck_session, list({c.id: c for c in heads}.values()))
    alarms = [f"{c.cell}: {', '.join(c.failing)} {c.evidence}{c.error}" for c in control if c.failed or c.error]
    assert not alarms, "the unmodified engine fails cells the mutant tier relies on:\n" + "\n".join(alarms)
