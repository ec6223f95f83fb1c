"""The statistical core of losscheck's sampling certification (docs/statistics.md).

Pure functions: tensors and arrays in, `TestResult`s out; no engine, no pytest. One module per
concept: `result` (what a test found, cell verdicts), `budget` (splitting α), `power`
(detectable effects, required sample sizes), `gof` (counts against exact expected counts),
and one module per test mode — `exact`, `pit`, `conditional`, `two_sample`. `registry` holds
the tests a sampled cell runs, `bugclass` (with `bugsums`, `bugperid`, `effects`, `powermodels`)
their power per bug class, `design` a sequential cell's design statistics. Importing this
package registers the `pit`, `conditional`, `exact`, `two_sample` and `rounds` families (the
`conformance` family registers with `losscheck.cells.conformance`).
"""

from losscheck.stats.budget import per_test_alpha
from losscheck.stats.conditional import conditional_tests
from losscheck.stats.exact import enumerate_continuations, exact_required_n, exact_tests, probability_bins
from losscheck.stats.hidden_rounds import rounds_test
from losscheck.stats.pit import pit_required_values, pit_tests, randomized_pit
from losscheck.stats.power import (
    chisquare_detectable_w,
    chisquare_required_n,
    dkwm_detectable,
    dkwm_required_n,
    dkwm_two_sample_detectable,
    predicted_power,
    require_power,
)
from losscheck.stats.registry import PIT, deprecated_count
from losscheck.stats.result import CellVerdict, TestResult, combine
from losscheck.stats.two_sample import two_sample_tests

__all__ = [
    "CellVerdict",
    "TestResult",
    "chisquare_detectable_w",
    "chisquare_required_n",
    "combine",
    "conditional_tests",
    "dkwm_detectable",
    "dkwm_required_n",
    "dkwm_two_sample_detectable",
    "enumerate_continuations",
    "exact_required_n",
    "exact_tests",
    "per_test_alpha",
    "pit_required_values",
    "pit_tests",
    "predicted_power",
    "probability_bins",
    "randomized_pit",
    "require_power",
    "rounds_test",
    "two_sample_tests",
]


def __getattr__(name: str) -> int:
    if name == "PIT_TESTS":  # the removed hand-kept count (CHANGELOG.md, Deprecated)
        return deprecated_count("losscheck.stats.PIT_TESTS", PIT)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
