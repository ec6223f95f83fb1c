"""The statistical tests a sampled cell runs, each declared once: its name, the family that runs
it, the scope of its detectable effect, its share of the false-alarm budget (none, one, or one
per tested position), whether it stays valid under any stopping rule, and its power model.

A *family* is a set of tests that read the same values (`PIT`: the randomized PITs of the tested
tokens; `CONDITIONAL`: the per-step sums of `ConditionalValues`; `CONFORMANCE`: what a `Recorder`
saw the verifier do; `EXACT`: samples against an enumerated law; `TWO_SAMPLE`: two samples of
token ids). Its module registers its tests when imported; the family's runner calls each
registered test in registration order with the family's values. Counts, the Bonferroni split of
a cell's α over families (`split`), the list of tests a certificate names and the tests a PIT
cell's design sizes its sample for (`designed`: those with a power model, read by
`losscheck.stats.bugclass`) come from here, so adding a test is one function plus one `register`
call — nothing else counts or names tests by hand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from losscheck.definitions import same_definition
from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit
from losscheck.stats.result import TestResult

if TYPE_CHECKING:
    from losscheck.stats.effects import PowerModel

# The families, spelt once: every split, runner and registration names them through these.
PIT = "pit"
CONDITIONAL = "conditional"
CONFORMANCE = "conformance"
EXACT = "exact"
TWO_SAMPLE = "two_sample"
ROUNDS = "rounds"  # a black-box engine's verifier classes through its drafter (`losscheck.stats.hidden_rounds`)
STREAMS = "streams"  # a black-box engine's random streams across requests (`losscheck.cells.engine.streams`)
# a one-sample engine cell's second stage: its two sides' row scores (`losscheck.cells.engine.attribution`)
ATTRIBUTION = "attribution"
# Inputs a test may read that a cell may lack (`StatTest.needs`): a black-box engine reports no slots.
SLOTS = "slots"
# ... and what a sample's rows say about their random streams (`losscheck.stats.streams.StreamValues`):
# a caller of the PIT tests that scores no rows (a bare array of PITs) gives none
ROW_STREAMS = "row_streams"
# ... and drafts sampled from q: an engine that drafts its draft model's argmax gives none, so a test
# of a drafter-side sampling bug (top-p on one side) cannot reject there and spends no α
SAMPLED_DRAFTS = "sampled_drafts"
# ... and a draft model whose raw law differs from the q the engine draws from: at temperature 1
# with nothing else processed the two are one, and a q-contract class is the correct round there
OTHER_Q = "other_q"
# the order a PIT cell's design lists its tests in (`designed`); a family not named here follows
DESIGN_ORDER = (PIT, CONDITIONAL)

Values = TypeVar("Values")
# what a test's detectable effect speaks for (`TestResult.scope`)
Scope = Literal["pooled", "stratified", "conditional", "conformance"]


@dataclass(frozen=True)
class StatTest(Generic[Values]):
    """One registered test: `run(values, alpha, power)` judges the family's `values` at `alpha`
    and states what it detects at `power` — one result, or for a `per_position` test one per
    tested position (named `name[l]`; none when the values leave nothing to test)."""

    name: str  # dotted, as in its results: "pit.pooled_chisquare"
    family: str  # the values it reads: one of the family constants above, or a new family's name
    scope: Scope
    run: Callable[[Values, float, float], TestResult | Sequence[TestResult]]
    # valid under any stopping rule (an e-value): judged at its whole share in a sequential cell;
    # otherwise at its share / the cell's number of looks (`losscheck.stats.sequential`)
    anytime: bool = False
    # False: fails only on an event of probability 0 under H0, so it is judged at alpha 0
    spends_alpha: bool = True
    # one assertion, and one share of the family's α, per tested position (the family's runner
    # says how many positions are tested) instead of one in all
    per_position: bool = False
    # what the test sees per token under each bug class, for the design that sizes a PIT cell's
    # sample (`losscheck.stats.bugclass`); None: the test is not part of that design
    power: PowerModel | None = None
    # inputs it reads that a cell may lack (`SLOTS`): where one is missing the test has nothing to
    # test, so it is neither run nor given a share of α
    needs: frozenset[str] = frozenset()

    def shares(self, positions: int | None = None, missing: frozenset[str] = frozenset()) -> int:
        """How many shares of its family's α the test spends when `positions` are tested and the
        cell lacks the inputs `missing`."""
        if not self.spends_alpha or self.needs & missing:
            return 0
        if not self.per_position:
            return 1
        if positions is None:
            raise LosscheckError(
                f"{self.name} asserts once per tested position: its family's split needs the number of positions"
            )
        return positions


_TESTS: dict[str, StatTest] = {}


def register(test: StatTest[Values]) -> StatTest[Values]:
    """Add `test` to its family (after the family's earlier tests); returns it."""
    known = _TESTS.get(test.name)
    if known is not None and not same_definition(known.run, test.run):  # a re-import replaces itself
        raise LosscheckError(f"a statistical test named {test.name!r} is already registered; give yours another name")
    _TESTS[test.name] = test
    return test


def registered(family: str) -> tuple[StatTest, ...]:
    """The tests of `family` in registration order; an error when it has none (its module was
    never imported, or the family is misspelt) — a family counted as empty would shift α."""
    tests = tuple(t for t in _TESTS.values() if t.family == family)
    if not tests:
        known = sorted({t.family for t in _TESTS.values()})
        raise LosscheckError(
            f"no statistical test is registered in family {family!r} (registered families: {known}); "
            "import the module that defines the family's tests first"
        )
    return tests


def get(name: str) -> StatTest:
    """The test registered as `name`."""
    if name not in _TESTS:
        raise LosscheckError(f"no statistical test is registered as {name!r}; registered: {sorted(_TESTS)}")
    return _TESTS[name]


def budget_count(family: str, positions: int | None = None, missing: frozenset[str] = frozenset()) -> int:
    """How many shares `family`'s α is split into (tests of probability-0 events spend none, a
    per-position test one per tested position: `positions`, a test that reads an input of
    `missing` none)."""
    return sum(t.shares(positions, missing) for t in registered(family))


def deprecated_count(old: str, family: str) -> int:
    """What the removed hand-kept count `old` (e.g. `losscheck.stats.PIT_TESTS`) now reads, with a
    `DeprecationWarning` naming its replacement; the aliases go after 0.1.0."""
    warnings.warn(
        f"{old} is deprecated: statistical tests are registered; use losscheck.stats.registry.budget_count({family!r})",
        DeprecationWarning,
        stacklevel=3,
    )
    return budget_count(family)


def all_tests() -> tuple[StatTest, ...]:
    """Every registered test, for the certificate's list."""
    return tuple(_TESTS.values())


def designed() -> tuple[StatTest, ...]:
    """The tests with a power model, which a PIT cell's design sizes its sample for: the families
    of `DESIGN_ORDER` in that order, then any other, each in registration order."""
    rank = {family: i for i, family in enumerate(DESIGN_ORDER)}
    with_power = [t for t in _TESTS.values() if t.power is not None]
    return tuple(sorted(with_power, key=lambda t: rank.get(t.family, len(rank))))


@dataclass(frozen=True)
class Split:
    """A budget `alpha` split evenly (Bonferroni) over every α-spending test of `families`;
    `positions`: how many positions a per-position test among them asserts on."""

    alpha: float
    families: tuple[str, ...]
    positions: int | None = None
    missing: frozenset[str] = frozenset()  # inputs the cell lacks: the tests reading them spend nothing

    @property
    def per_test(self) -> float:
        """One test's level."""
        return self.alpha / sum(budget_count(f, self.positions, self.missing) for f in self.families)

    def share(self, *families: str) -> float:
        """What `families` (some of this split's) receive together: their tests' levels summed."""
        unknown = set(families) - set(self.families)
        if unknown:
            raise LosscheckError(f"families {sorted(unknown)} are not part of this split over {list(self.families)}")
        return self.per_test * sum(budget_count(f, self.positions, self.missing) for f in families)


def split(alpha: float, *families: str, positions: int | None = None, missing: frozenset[str] = frozenset()) -> Split:
    """`alpha` split over every α-spending test of `families`, a per-position test's over
    `positions` positions, none for a test reading an input of `missing`."""
    check_open_unit("alpha", alpha)
    if not families:
        raise LosscheckError("split needs at least one family of tests")
    return Split(alpha, families, positions, missing)


def run_family(
    family: str,
    values: object,
    alpha: float,
    power: float,
    looks: int = 1,
    positions: int | None = None,
    missing: frozenset[str] = frozenset(),
) -> list[TestResult]:
    """Every test of `family` on `values`, the family's budget `alpha` split evenly over its
    α-spending tests (a per-position test one share per position of `positions`); with `looks` > 1
    (a sequential cell) a test not valid under any stopping rule is judged at its share / `looks`.
    A test reading an input of `missing` is not run. Each result carries its test's scope."""
    check_open_unit(f"the {family} family's alpha", alpha)
    tests = [t for t in registered(family) if not t.needs & missing]
    share = split(alpha, family, positions=positions, missing=missing).per_test
    results = []
    for test in tests:
        level = 0.0 if not test.spends_alpha else share if test.anytime else share / looks
        ran = test.run(values, level, power)
        for result in [ran] if isinstance(ran, TestResult) else ran:
            own = result.name == test.name or (test.per_position and result.name.startswith(f"{test.name}["))
            if not own:
                raise LosscheckError(f"the test registered as {test.name!r} returned a result named {result.name!r}")
            results.append(replace(result, scope=test.scope))
    return results
