"""The sequential design as one object (`losscheck.cells.sequential_design`): its stop rule on
looks whose rule-out e-values are scripted, where the answer is read off the thresholds by hand
(at power 0.99, log(1/β_r) = log 200 ≈ 5.30 for a covered key, log(1/β_p) = log 10 ≈ 2.30 for a
partly reached one); a stop the tested sample's shortfall holds back; a stop that never triggers;
and the design phase on the bugtable chain, with the pooled tests' floor."""

from __future__ import annotations

import dataclasses
import math

import pytest

from losscheck.cells.record import BugClassRecord, ShortRecord
from losscheck.cells.sequential_design import SequentialDesign, shortfall
from losscheck.plan.profiles import PROFILES
from losscheck.selftest import bugtable
from losscheck.stats import registry, sequential
from losscheck.stats.bugclass import PowerAccumulator
from losscheck.stats.pit import pit_required_values
from losscheck.stats.sample_size import ClassDesign

pytestmark = pytest.mark.usefixtures("one_thread")

POWER = 0.99
TOKENS = (100, 150, 225)
KEPT = {"a": BugClassRecord("pit.ks", 90.0, power=0.999, covered=True, power_checked=0.995)}
SHORT = {"a": dataclasses.replace(KEPT["a"], power_checked=0.98)}  # covered, caught below 0.99


@dataclasses.dataclass(frozen=True)
class Toy(SequentialDesign):
    """Looks at 100, 150 and 225 tokens; key "a" covered, "b" partly reached. The tested sample's
    coverage is scripted per look, as the e-values are (`Scripted`)."""

    by_look: tuple[dict[str, BugClassRecord], ...] = (KEPT, KEPT, KEPT)

    def coverage(self, tested, early):
        return self.by_look[tested.look - 1] if early else {"ran to the end": KEPT["a"]}


def toy(*by_look: dict[str, BugClassRecord]) -> Toy:
    design = ClassDesign({}, (), TOKENS[-1], TOKENS[-1], TOKENS[0])
    looks = sequential.Looks(TOKENS, len(TOKENS), covered=("a",), partial=("b",), power=POWER)
    return Toy(PowerAccumulator(), design, design, looks, [], {}, 1e-3, POWER, *([by_look] if by_look else []))


class Scripted:
    """The tested sample's accumulator, reduced to its log rule-out e-values after each look."""

    def __init__(self, *by_look: dict[str, float]) -> None:
        self.by_look, self.look, self.grown = by_look, 0, []

    def grow(self, look: int, tokens: int) -> None:
        self.look = look
        self.grown.append(tokens)

    def rule_out_log_e(self, ids):
        return self.by_look[self.look - 1]


def test_the_thresholds_are_log_200_and_log_10():
    assert toy().looks.thresholds() == {"a": pytest.approx(math.log(200)), "b": pytest.approx(math.log(10))}


def test_the_cell_stops_at_the_first_look_that_rules_every_key_out():
    # look 1: "a" at 5.0 < log 200; look 2: "a" at 5.4 >= log 200, "b" at 2.4 >= log 10
    tested = Scripted({"a": 5.0, "b": 3.0}, {"a": 5.4, "b": 2.4}, {"a": 9.0, "b": 9.0})
    design = toy()
    stop = design.run(tested, tested.grow)
    assert (stop.stopped_at, stop.early, stop.unconfirmed) == (2, True, ())
    assert tested.grown == [100, 150]
    assert design.confirmed(stop, tested) is KEPT
    record = design.record(stop, 151)
    assert (record.tokens, record.allowed, record.stopped_at, record.early) == (TOKENS, 3, 2, True)


def test_a_stop_waits_while_the_tested_sample_falls_short_of_the_design():
    tested = Scripted({"a": 6.0, "b": 3.0}, {"a": 6.0, "b": 3.0}, {"a": 6.0, "b": 3.0})
    stop = toy(SHORT, KEPT, KEPT).run(tested, tested.grow)
    assert (stop.stopped_at, stop.early, stop.unconfirmed) == (2, True, (1,))


def test_the_stop_fails_to_trigger_when_a_key_stays_below_its_threshold():
    # "a" at 5.2 < log 200 at every look but the last, where the cell never stops early
    tested = Scripted({"a": 5.2, "b": 9.0}, {"a": 5.2, "b": 9.0}, {"a": 99.0, "b": 99.0})
    design = toy()
    stop = design.run(tested, tested.grow)
    assert (stop.stopped_at, stop.early, stop.unconfirmed, stop.coverage) == (3, False, (), None)
    assert tested.grown == list(TOKENS)
    assert list(design.confirmed(stop, tested)) == ["ran to the end"]  # from everything it tested
    assert design.record(stop, 230).stopped_at == 3


def test_the_stop_fails_to_trigger_when_every_look_falls_short():
    tested = Scripted({"a": 6.0, "b": 3.0}, {"a": 6.0, "b": 3.0}, {"a": 6.0, "b": 3.0})
    stop = toy(SHORT, SHORT, SHORT).run(tested, tested.grow)
    assert (stop.stopped_at, stop.early, stop.unconfirmed) == (3, False, (1, 2))


def test_the_shortfall_is_a_covered_class_below_the_power_or_a_member_short_of_its_promise():
    member = ShortRecord(rho=0.5, power=0.7, promised=0.8)
    coverage = {
        "kept": KEPT["a"],
        "below": SHORT["a"],
        "old record": dataclasses.replace(KEPT["a"], power=0.98, power_checked=None),
        "not covered": dataclasses.replace(SHORT["a"], covered=False),
        "member": dataclasses.replace(KEPT["a"], covered=False, short=(member,)),
    }
    assert list(shortfall(coverage, POWER)) == ["below", "old record", "member"]


def test_the_design_phase_takes_the_pooled_tests_floor():
    import losscheck.cells.conformance  # noqa: F401  (registers the conformance family)

    chain = bugtable.make_chain(0.88, seed=0)
    pilot = bugtable.accumulate(chain, bugtable.simulate(chain, 256, 1))
    budget = registry.split(bugtable.CELL_ALPHA, "pit", "conditional", "conformance")
    ci = PROFILES["ci"]
    plain = SequentialDesign.plan(pilot, ci, budget)
    assert plain.design.floor == ci.min_pit_tokens and plain.looks.tokens[0] == ci.min_pit_tokens
    assert plain.limit == sequential.max_looks(ci.min_pit_tokens, ci.max_pit_tokens)
    assert plain.design.tokens >= plain.fixed.tokens  # the sequential design's tests at a higher power

    pooled = SequentialDesign.plan(pilot, dataclasses.replace(ci, pooled_tv=0.02), budget)
    alpha_pit = registry.split(budget.share("pit", "conditional"), "pit", "conditional").share("pit")
    floor = pit_required_values(alpha_pit / plain.limit, POWER, 0.02)
    assert floor > ci.min_pit_tokens and pooled.design.floor == floor and pooled.looks.tokens[0] >= floor

    single = SequentialDesign.plan(pilot, dataclasses.replace(ci, early_stop=False), budget)
    assert single.limit == 1 and single.design == single.fixed == plain.fixed
