"""Splitting a false-alarm budget over several tests (Bonferroni).

Bonferroni needs no assumption about how the tests depend on each other — the tests of one
cell all look at the same samples — and lets each test pass or fail on its own.
"""

from __future__ import annotations

from losscheck.errors import LosscheckError
from losscheck.stats._checks import check_open_unit


def per_test_alpha(family_alpha: float, n_tests: int) -> float:
    """The level each of `n_tests` tests runs at so that P(any false alarm) <= `family_alpha`."""
    check_open_unit("family alpha", family_alpha)
    if isinstance(n_tests, bool) or not isinstance(n_tests, int) or n_tests < 1:
        raise LosscheckError(f"the number of tests sharing alpha must be an int >= 1, got {n_tests!r}")
    return family_alpha / n_tests
