"""A drafter and the request's history (penalties, bias, bans, min tokens, grammar): one that
samples from q processed without the history and reports that q is a worse drafter, not a lossy
one, and passes its penalty cell; one that samples from the processed q but reports the
unprocessed one fails it. In process, at the α share the full matrix gives each test: a lossless
drafter fails with probability <= that α, the bug (its q off by the repetition penalty 1.5 at
every repeated id) moves the law by far more than the cell's detectable TV."""

from __future__ import annotations

import pytest

from losscheck import bundled
from losscheck.drafters.autoregressive import from_path
from losscheck.selftest.drafters import MisreportingDrafter, history_ignored_honestly, history_left_out_of_report

CELL = "user-k4-T1-rep1.5"


def history_blind(target):
    return MisreportingDrafter(
        from_path(bundled.fixtures_dir() / "drafter_a", target), history_ignored_honestly, "blind"
    )


def history_misreported(target):
    honest = from_path(bundled.fixtures_dir() / "drafter_a", target)
    return MisreportingDrafter(honest, history_left_out_of_report, "misreported")


@pytest.mark.parametrize("factory, lossless", [("history_blind", True), ("history_misreported", False)])
def test_a_drafter_blind_to_the_history_is_lossless_one_misreporting_it_is_not(factory, lossless, one_thread):
    from losscheck.cells.sampled import run_pit
    from losscheck.run.context import CellContext
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(drafter=f"{__name__}:{factory}"))
    (planned,) = [c for cells in session.plan.values() for c in cells if c.id == CELL]
    outcome = run_pit(CellContext.of(session, planned))
    assert outcome.passed == lossless, outcome.message()
    if not lossless:
        failed = {t.name for t in outcome.verdict.results if t.p_value is not None and t.p_value <= t.alpha}
        assert "conformance.draft_honesty" in failed, outcome.message()
