"""The statistical tests a sampled cell runs, each declared once: its name, the family that runs
it, the scope of its detectable effect, whether it stays valid under any stopping rule and
whether it spends a share of the false-alarm budget.

A *family* is a set of tests that read the same values (`pit`: the randomized PITs of the tested
tokens; `conditional`: the per-step sums of `ConditionalValues`; `conformance`: what a `Recorder`
saw the verifier do). Its module registers its tests when imported; the family's runner calls
each registered test in registration order with the family's values. Counts, the Bonferroni split
of a cell's α over families (`split`) and the list of tests a certificate names come from here,
so adding a test is one function plus one `register` call — nothing else counts tests by hand.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, Literal, TypeVar

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit
from losscheck.stats.result import TestResult

Values = TypeVar("Values")
# what a test's detectable effect speaks for (`TestResult.scope`)
Scope = Literal["pooled", "stratified", "conditional", "conformance"]


@dataclass(frozen=True)
class StatTest(Generic[Values]):
    """One registered test: `run(values, alpha, power)` judges the family's `values` at `alpha`
    and states what it detects at `power`."""

    name: str  # dotted, as in its results: "pit.pooled_chisquare"
    family: str  # the values it reads: "pit", "conditional" or "conformance"
    scope: Scope
    run: Callable[[Values, float, float], TestResult]
    # valid under any stopping rule (an e-value): judged at its whole share in a sequential cell;
    # otherwise at its share / the cell's number of looks (`losscheck.stats.sequential`)
    anytime: bool = False
    # False: fails only on an event of probability 0 under H0, so it is judged at alpha 0
    spends_alpha: bool = True


_TESTS: dict[str, StatTest] = {}


def register(test: StatTest[Values]) -> StatTest[Values]:
    """Add `test` to its family (after the family's earlier tests); returns it."""
    if test.name in _TESTS:
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


def budget_count(family: str) -> int:
    """How many of `family`'s tests share its α (tests of probability-0 events spend none)."""
    return sum(t.spends_alpha for t in registered(family))


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


@dataclass(frozen=True)
class Split:
    """A budget `alpha` split evenly (Bonferroni) over every α-spending test of `families`."""

    alpha: float
    families: tuple[str, ...]

    @property
    def per_test(self) -> float:
        """One test's level."""
        return self.alpha / sum(budget_count(f) for f in self.families)

    def share(self, *families: str) -> float:
        """What `families` (some of this split's) receive together: their tests' levels summed."""
        unknown = set(families) - set(self.families)
        if unknown:
            raise LosscheckError(f"families {sorted(unknown)} are not part of this split over {list(self.families)}")
        return self.per_test * sum(budget_count(f) for f in families)


def split(alpha: float, *families: str) -> Split:
    """`alpha` split over every α-spending test of `families`."""
    check_open_unit("alpha", alpha)
    if not families:
        raise LosscheckError("split needs at least one family of tests")
    return Split(alpha, families)


def run_family(family: str, values: object, alpha: float, power: float, looks: int = 1) -> list[TestResult]:
    """Every test of `family` on `values`, the family's budget `alpha` split evenly over its
    α-spending tests; with `looks` > 1 (a sequential cell) a test not valid under any stopping
    rule is judged at its share / `looks`. Each result carries its test's scope."""
    check_open_unit(f"the {family} family's alpha", alpha)
    tests = registered(family)
    share = alpha / budget_count(family)
    results = []
    for test in tests:
        level = 0.0 if not test.spends_alpha else share if test.anytime else share / looks
        result = test.run(values, level, power)
        if result.name != test.name:
            raise LosscheckError(f"the test registered as {test.name!r} returned a result named {result.name!r}")
        results.append(replace(result, scope=test.scope))
    return results
