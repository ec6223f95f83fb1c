"""Mutant tier (`pytest -m mutants`): the lossless gate must catch every planted bug (DESIGN §4.3).

Each mutant runs the gate cells it shows in through the gate's own runners, with the gate's
sample sizes and the per-test α of `pytest -m lossless` (α / the gate's statistical-test count,
whatever this run collected), until one cell fails. Greedy mutants must be caught by greedy
cells, sampling mutants by statistical cells. The control runs the unmodified engine on the
cells each mutant tries first — the cells that do the catching — in the same run.
"""

from __future__ import annotations

import pytest

from losscheck.mutants import MUTANT_NAMES

pytestmark = pytest.mark.mutants


@pytest.mark.parametrize("name", MUTANT_NAMES)
def test_mutant_is_caught(name, losscheck_session):
    from losscheck.mutants import get_mutant
    from losscheck.mutants.catch import run_mutant

    report = run_mutant(losscheck_session, get_mutant(name))
    assert report.cells, (
        f"mutant {name} shows in none of this run's gate cells; the tier runs on the bundled "
        "family-A drafter (no --losscheck-drafter / --losscheck-target)"
    )
    assert report.caught, report.message()


def test_unmodified_engine_passes_the_catching_cells(losscheck_session):
    from losscheck.mutants import catalogue
    from losscheck.mutants.catch import gate_session, run_control

    session = gate_session(losscheck_session, None)
    first = {m.cells(session)[0].id: m.cells(session)[0] for m in catalogue() if m.cells(session)}
    control = run_control(losscheck_session, list(first.values()))
    alarms = [f"{c.cell}: {', '.join(c.failing)} {c.evidence}" for c in control if c.failed]
    assert not alarms, "the unmodified engine fails cells the mutant tier relies on:\n" + "\n".join(alarms)
