"""What one statistical test found, and the verdict of a cell that ran several.

Every test losscheck runs has the same null hypothesis H0: the sampled tokens follow the
target's distribution. A `TestResult` carries enough to explain itself: what H0
predicted, what the sample showed, the statistic, the p-value, the level it was judged at, the
sample size and the smallest effect it detects at the configured power.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from losscheck.errors import LosscheckError

# Levels of the tests in one cell may add up to the cell's budget up to float rounding.
_BUDGET_RTOL = 1e-9


@dataclass(frozen=True)
class TestResult:
    """One hypothesis test of H0, judged at its own share `alpha` of the run's false-alarm budget.

    H0 is rejected when `p_value <= alpha`; `passed` means it was not. A test with `alpha == 0`
    spends no budget: it can only fail on an event that has probability 0 under H0 (a sampled
    sequence the target gives probability 0).
    """

    __test__ = False  # a result, not a pytest test class, whatever its name

    name: str  # dotted, e.g. "pit.pooled_chisquare" or "exact.position[3]"
    expected: str  # what H0 predicts, in words
    observed: str  # what the sample showed, in words
    statistic: float
    p_value: float
    alpha: float  # the level this test alone was judged at
    n: int  # sample size the test saw (sequences, tokens or PIT values; `expected` says which)
    power: float  # the power at which `detectable` is stated
    # effect name -> smallest value detected with probability >= `power` at `alpha` and `n`:
    # "w" Cohen's effect size, "tv" total variation on the test's bins, "ks" Kolmogorov distance,
    # "mass" probability outside the target's support. math.inf: nothing is guaranteed.
    detectable: dict[str, float] = field(default_factory=dict)
    # log10 of the p-value (of an upper bound on it where even the log-tail underflows), for tests
    # that compute it: a p-value that underflows to 0 still says how small it is. None: not computed.
    log10_p: float | None = None
    # what the test's detectable effect speaks for: "pooled" (the whole sample's law, the cell's
    # stated guarantee), "stratified" (one position, slot or pair of the sample) or "conformance"
    # (the verifier's steps against standard speculative sampling)
    scope: str = "pooled"

    @classmethod
    def untestable(
        cls,
        name: str,
        expected: str,
        observed: str,
        alpha: float,
        power: float,
        n: int = 0,
        effects: Sequence[str] = ("w", "tv"),
    ) -> TestResult:
        """A test whose sample was too small (or absent) to judge: it passes at p = 1 and states
        that it detects nothing (every effect in `effects` infinite), so the cell's claims can
        never lean on it."""
        return cls(
            name=name,
            expected=expected,
            observed=observed,
            statistic=0.0,
            p_value=1.0,
            alpha=alpha,
            n=n,
            power=power,
            detectable=dict.fromkeys(effects, math.inf),
        )

    @property
    def passed(self) -> bool:
        return self.p_value > self.alpha

    def message(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        relation = ">" if self.passed else "<="
        effects = ", ".join(f"{k} >= {v:.3g}" for k, v in self.detectable.items()) or "nothing"
        return (
            f"{self.name} {verdict}: expected {self.expected}; observed {self.observed}. "
            f"statistic = {self.statistic:.4g}, p = {self._p_text()} {relation} alpha = "
            f"{self.alpha:.3g}, n = {self.n}; detects {effects} with power {self.power:g}."
        )

    def _p_text(self) -> str:
        if self.p_value == 0 and self.log10_p is not None and math.isfinite(self.log10_p):
            return f"<= 10^{self.log10_p:.1f}"
        return f"{self.p_value:.3g}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields, `passed` included; infinities become None (JSON has no inf)."""
        d = {k: _json_number(v) for k, v in asdict(self).items()}
        d["detectable"] = {k: _json_number(v) for k, v in self.detectable.items()}
        d["passed"] = self.passed
        return d


@dataclass(frozen=True)
class CellVerdict:
    """All statistical tests of one matrix cell, run under the cell's share `alpha` of the budget."""

    cell: str
    alpha: float
    results: tuple[TestResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def message(self) -> str:
        failed = [r for r in self.results if not r.passed]
        head = (
            f"cell {self.cell}: {len(self.results) - len(failed)}/{len(self.results)} tests "
            f"passed under a cell budget alpha = {self.alpha:.3g} (Bonferroni within the cell)"
        )
        shown = failed if failed else self.results
        return "\n".join([head, *("  " + r.message() for r in shown)])

    def to_dict(self) -> dict[str, object]:
        return {
            "cell": self.cell,
            "alpha": self.alpha,
            "passed": self.passed,
            "results": [r.to_dict() for r in self.results],
        }


def combine(cell: str, results: Sequence[TestResult], alpha: float) -> CellVerdict:
    """The verdict of a cell whose tests split the budget `alpha`: it fails if any test fails.

    Raises `LosscheckError` when the tests' levels add up to more than `alpha` — the cell would
    then false-alarm more often than its share of the run's budget allows.
    """
    if not results:
        raise LosscheckError(f"cell {cell}: no statistical test results to combine")
    spent = math.fsum(r.alpha for r in results)
    if spent > alpha * (1 + _BUDGET_RTOL):
        raise LosscheckError(
            f"cell {cell}: its tests were judged at levels summing to {spent:.4g}, more than the "
            f"cell's budget alpha = {alpha:.4g}; split alpha with per_test_alpha"
        )
    return CellVerdict(cell=cell, alpha=alpha, results=tuple(results))


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def scoped(results: Sequence[TestResult], scope: str) -> list[TestResult]:
    """`results` marked with `scope` (see `TestResult.scope`)."""
    return [replace(r, scope=scope) for r in results]
