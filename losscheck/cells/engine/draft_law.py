"""Whether an engine drafts as losscheck assumed: its own counters against the round filter.

A one-sample engine cell judges the verifier's classes (`losscheck.stats.hidden_rounds`) by
teacher-forcing the engine's draft model under a declared *draft law* (its q processed as the
request asks, tempered only, or its argmax). Under H0 the emitted tokens say nothing about that
law; the engine's counters do. The filter, run under H0 over the rows the cell read (its pilot and
its tested sample), gives for every position the probability that a round starts there and that
its first draft is accepted, given the tokens so far: summed, the counts the engine should report
(`Acceptance`). A drafter whose law is not the declared one — a bf16 copy flipping near-ties, bans,
a bias or penalties applied before its argmax, a processed q where a raw one was declared —
accepts at another rate, and the drafter-side claims (every `rounds.*` class) are withdrawn by
name: their power was computed for a q the engine does not draw from. Level is untouched (every
`rounds.*` test is a martingale whatever q is); only claims of power go.

The rule: inconsistent when the counted first-draft acceptances leave the prediction by more
than `Z` standard deviations plus `TOLERANCE` of the prediction (the counters also count what the
filter cannot see exactly: a cut-off's ambiguous positions, an engine's own edge cases). Measured
on Markov-table engines (tests/unit/blackbox/test_draft_law.py): the honest loop's z has sd
0.6–0.7; under argmax drafts the prediction is exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from losscheck.cells.record import DraftLawRecord

if TYPE_CHECKING:
    from losscheck.cells.record import SampleFacts
    from losscheck.stats.hidden_rounds import Acceptance

Z = 4.0  # standard deviations of the prediction's own noise
TOLERANCE = 0.05  # and this share of the prediction, for what the filter does not model


def predicted(acceptance: Acceptance) -> DraftLawRecord:
    """The prediction of a cell's rows, before the engine's counts are known."""
    return DraftLawRecord(acceptance.rounds, acceptance.first_accepted, math.sqrt(max(acceptance.first_var, 0.0)))


def checked(facts: SampleFacts, rejected: bool = False) -> SampleFacts:
    """`facts` with its draft-law record judged against its engine counters; on a mismatch every
    drafter-side class (`rounds.*`) is withdrawn from its bug classes by name. A cell that
    `rejected` H0 is not checked: the prediction is made under it, and a bug moves the counts too."""
    from losscheck.stats.hidden_rounds import CLASSES

    record, counters = facts.draft_law, facts.engine_counters
    if record is None or record.verdict != "not checked":
        return facts
    if rejected:
        why = "not checked: the cell rejected H0, under which the counts are predicted"
        return dataclasses.replace(facts, draft_law=dataclasses.replace(record, verdict=why))
    per = None if counters is None else counters.accepted_per_position
    if counters is None or not per:
        why = "not checked: the engine counts no accepted drafts per position"
        return dataclasses.replace(facts, draft_law=dataclasses.replace(record, verdict=why))
    counted = per[0]
    allowed = Z * record.sd_first_accepted + TOLERANCE * record.predicted_first_accepted
    consistent = abs(counted - record.predicted_first_accepted) <= allowed
    record = dataclasses.replace(
        record,
        counted_rounds=counters.drafts,
        counted_first_accepted=counted,
        verdict="consistent" if consistent else "inconsistent",
    )
    classes = facts.bug_classes
    if consistent or not classes:
        return dataclasses.replace(facts, draft_law=record)
    why = (
        f"the engine's counters accepted {counted} first drafts where its draft model under the declared law "
        f"predicts {record.predicted_first_accepted:.1f} ± {allowed:.1f}: it does not draft from the q losscheck "
        "teacher-forced, so no power is claimed through it (declare its draft law, `DraftModel.law`)"
    )
    drafter_side = {cls.name for cls in CLASSES}
    classes = {
        name: dataclasses.replace(c, covered=False, withdrawn=why) if name in drafter_side else c
        for name, c in classes.items()
    }
    return dataclasses.replace(facts, draft_law=record, bug_classes=classes)
