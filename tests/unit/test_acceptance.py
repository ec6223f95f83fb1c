"""The two per-slot acceptance figures (`losscheck.acceptance`), fixed on hand-built rounds: the
loop's counters, the certificate's record, an engine's own counters and the perf report agree."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from losscheck import acceptance
from losscheck.cells.record import AcceptanceRecord
from losscheck.core.generation import LoopStats
from losscheck.engines.counters import EngineCounters
from losscheck.jsonrecord import decode, encode
from tests.unit.perf.runs import rung

# One round of k = 3 drafts over four rows that kept 0, 1, 3 and 2 drafts:
#   slot 1: proposed 4, reached 4 (every row), accepted 3 (rows keeping >= 1)
#   slot 2: proposed 4, reached 3 (rows keeping >= 1), accepted 2
#   slot 3: proposed 4, reached 2, accepted 1
ROUND = torch.tensor([0, 1, 3, 2])
CUMULATIVE = (3 / 4, 2 / 4, 1 / 4)  # P(drafts 1..j all accepted)
CONDITIONAL = (3 / 4, 2 / 3, 1 / 2)  # P(draft j accepted | drafts 1..j-1 accepted)


def one_round() -> LoopStats:
    stats = LoopStats.empty(3)
    stats.record_round(ROUND, torch.ones(4, dtype=torch.bool), 3)
    return stats


def test_one_round_gives_both_figures_by_their_definitions():
    stats = one_round()
    assert stats.proposed.tolist() == [4, 4, 4] and stats.accepted.tolist() == [3, 2, 1]
    assert stats.reached.tolist() == [4, 3, 2]
    assert stats.cumulative_acceptance() == pytest.approx(CUMULATIVE)
    assert stats.conditional_acceptance() == pytest.approx(CONDITIONAL)
    assert stats.acceptance_length == pytest.approx(1 + sum(CUMULATIVE))  # τ = 1 + Σ cumulative at fixed k


def test_rounds_of_another_k_and_inactive_rows_count_only_where_they_drafted():
    """A second round of k = 2 (a budget's last round) over three rows, one retired: the fixed-k
    shortcut (conditional = accepted[j] / accepted[j-1]) would give slot 3 1/3; it is 1/2."""
    stats = one_round()
    stats.record_round(torch.tensor([2, 0, 1]), torch.tensor([True, True, False]), 2)
    assert stats.proposed.tolist() == [6, 6, 4] and stats.accepted.tolist() == [4, 3, 1]
    assert stats.reached.tolist() == [6, 4, 2]
    assert stats.cumulative_acceptance() == pytest.approx([4 / 6, 3 / 6, 1 / 4])
    assert stats.conditional_acceptance() == pytest.approx([4 / 6, 3 / 4, 1 / 2])
    assert (stats + stats).conditional_acceptance() == pytest.approx(stats.conditional_acceptance())


def test_a_slot_never_reached_is_nan_in_the_loop_and_none_in_the_record():
    stats = LoopStats.empty(3)
    stats.record_round(torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool), 3)  # nobody reaches slot 3
    conditional = stats.conditional_acceptance()
    assert conditional[:2] == pytest.approx([1 / 2, 0.0]) and conditional[2] != conditional[2]  # NaN
    record = AcceptanceRecord.of(stats)
    assert record.conditional_acceptance == (0.5, 0.0, None) and record.conditional() == (0.5, 0.0, None)
    assert acceptance.shown(record.conditional_acceptance) == "0.500 / 0.000 / -"


def test_the_record_writes_both_figures_and_reads_back_the_same():
    record = AcceptanceRecord.of(one_round())
    data = json.loads(json.dumps(encode(record)))
    assert data["slot_acceptance"] == pytest.approx(CUMULATIVE)  # the key certificates have always had
    assert data["conditional_acceptance"] == pytest.approx(CONDITIONAL) and data["reached"] == [4, 3, 2]
    again = decode(AcceptanceRecord, data, "acceptance")
    assert again == record and again.conditional() == pytest.approx(CONDITIONAL)


def test_a_record_written_before_the_reached_counts_derives_them_at_fixed_k():
    data = encode(AcceptanceRecord.of(one_round()))
    for key in ("reached", "conditional_acceptance"):
        del data[key]
    old = decode(AcceptanceRecord, data, "acceptance")
    assert old.reached == () and old.conditional() == pytest.approx(CONDITIONAL)


def test_an_engines_counters_give_the_same_two_figures():
    """vLLM's counters of the same round: 4 drafts, accepted per position (3, 2, 1)."""
    counters = EngineCounters(drafts=4, drafted=12, accepted=6, accepted_per_position=(3, 2, 1), emitted=10)
    assert counters.cumulative_acceptance() == pytest.approx(CUMULATIVE)
    assert counters.conditional_acceptance() == pytest.approx(CONDITIONAL)
    assert counters.tau == pytest.approx(one_round().acceptance_length)


def test_the_perf_record_keeps_both_and_derives_the_conditional_of_an_older_report():
    stats = one_round()
    recorded = dataclasses.replace(
        rung("A", 1, 2.5, speedup=1.5),
        cumulative_acceptance=tuple(stats.cumulative_acceptance()),
        conditional_acceptance=tuple(stats.conditional_acceptance()),
    )
    assert recorded.conditional() == pytest.approx(CONDITIONAL)
    assert encode(recorded)["slot_acceptance"] == pytest.approx(CUMULATIVE)
    older = dataclasses.replace(recorded, conditional_acceptance=())
    assert older.conditional() == pytest.approx(CONDITIONAL)


def test_counts_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="per-position counts of different lengths: 2 and 3"):
        acceptance.conditional((1, 2), (3, 4, 5))


def test_the_old_name_gives_the_cumulative_rate_with_a_deprecation_warning():
    stats = one_round()
    with pytest.warns(DeprecationWarning, match=r"slot_acceptance\(\) is the cumulative rate"):
        assert stats.slot_acceptance() == pytest.approx(CUMULATIVE)
    with pytest.warns(DeprecationWarning, match="slot_acceptance is the cumulative rate"):
        assert AcceptanceRecord.of(stats).slot_acceptance == pytest.approx(CUMULATIVE)
