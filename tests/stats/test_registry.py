"""The registry of statistical tests: counts and α splits come from it, and a new test is one
function plus one registration (`losscheck.stats.registry`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

from losscheck.cells.record import RunFacts
from losscheck.errors import LosscheckError
from losscheck.stats import registry
from losscheck.stats.conditional import ConditionalValues, conditional_tests
from losscheck.stats.result import TestResult


def order_mean_test(values: ConditionalValues, alpha: float, power: float) -> TestResult:
    """A toy test a user might add: the mean of the p - q ordered PITs, exactly 1/2 under H0
    (each is U(0, 1)), z-tested two-sided with the normal approximation."""
    u = values.order_u.double()  # [n]
    n = len(u)
    se = math.sqrt(1 / (12 * n))
    z = (float(u.mean()) - 0.5) / se
    return TestResult(
        name="pit.order_mean",
        expected="ordered PIT values of mean 1/2",
        observed=f"mean {float(u.mean()):.4f} ({z:+.2f} se)",
        statistic=z,
        p_value=float(2 * stats.norm.sf(abs(z))),
        alpha=alpha,
        n=n,
        power=power,
        detectable={"mean_shift": (stats.norm.isf(alpha / 2) + stats.norm.ppf(power)) * se},
    )


ORDER_MEAN = registry.StatTest("pit.order_mean", "conditional", "conditional", order_mean_test)


@pytest.fixture
def with_order_mean(monkeypatch):
    """ORDER_MEAN registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(registry, "_TESTS", dict(registry._TESTS))
    registry.register(ORDER_MEAN)


def values_of(order_u: torch.Tensor) -> ConditionalValues:
    """The conditional values of an honest sample of `len(order_u)` one-step rows over 8 ids, with
    the ordered PITs replaced by `order_u` [n]."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(len(order_u), 1, 8, generator=g, dtype=torch.float64), -1)  # [n, 1, V]
    tokens = torch.multinomial(p.view(-1, 8), 1, generator=g)  # [n, 1]
    v = torch.rand(tokens.shape, generator=g, dtype=torch.float64)
    values = ConditionalValues.from_chunk(p, None, tokens, v, torch.ones(tokens.shape, dtype=torch.bool))
    return dataclasses.replace(values, order_u=order_u.double())


def test_the_registry_counts_every_family():
    """The counts a cell splits α by: 5 PIT tests, 4 conditional, 5 conformance (the support and
    impossible-decision checks spend none), 14 in a PIT cell of losscheck's own loop."""
    import losscheck.cells.conformance  # noqa: F401  (registers the conformance family)

    counts = {f: registry.budget_count(f) for f in ("pit", "conditional", "conformance")}
    assert counts == {"pit": 5, "conditional": 4, "conformance": 5}
    budget = registry.split(0.014, "pit", "conditional", "conformance")
    assert budget.per_test == pytest.approx(0.001)
    assert budget.share("pit", "conditional") == pytest.approx(0.009)
    names = [t.name for t in registry.registered("pit")]
    assert names[0] == "pit.support" and not registry.registered("pit")[0].spends_alpha


def test_a_new_test_is_one_registration(with_order_mean):
    """Registered in the conditional family, the toy test runs with the family at an even share of
    its α, and the split gives every test of a cell one fifteenth of the cell's α."""
    assert registry.budget_count("conditional") == 5
    assert registry.split(0.015, "pit", "conditional", "conformance").per_test == pytest.approx(0.001)
    g = torch.Generator().manual_seed(0)
    results = conditional_tests(values_of(torch.rand(4000, generator=g)), 0.05, 0.9)
    assert [r.name for r in results][-1] == "pit.order_mean"
    assert all(r.alpha == pytest.approx(0.01) and r.scope == "conditional" for r in results)
    assert all(r.passed for r in results), [r.message() for r in results if not r.passed]
    # and it can fail: ordered PITs pushed towards 1 (the direction of a residual bug)
    pushed = conditional_tests(values_of(torch.rand(4000, generator=g) ** 0.8), 0.05, 0.9)
    assert not next(r for r in pushed if r.name == "pit.order_mean").passed


def test_a_real_cell_runs_a_registered_test(with_order_mean, session):
    """The base PIT cell of the bundled loop, with the toy test registered: its certificate record
    lists the new test, judged at the cell's α / 15 (14 built-in tests and the new one), and the
    levels of all its tests add up to the cell's share of the run's α."""
    from losscheck.cells.sampled import run_pit
    from losscheck.run.context import CellContext

    cell = next(c for cells in session.plan.values() for c in cells if c.id == "A-k4-T1")
    outcome = run_pit(CellContext.of(session, cell))
    assert outcome.passed, outcome.message()
    verdict = outcome.to_record(RunFacts("test_sampling.py::test_sampling[A-k4-T1]", "passed")).verdict
    assert verdict is not None
    tests = {t.name: t for t in verdict.results}
    assert "pit.order_mean" in tests
    assert tests["pit.token_counts"].alpha == pytest.approx(session.per_test_alpha / 15)
    assert math.fsum(t.alpha for t in tests.values()) <= session.per_test_alpha * (1 + 1e-9)


def test_registry_errors_name_the_fix(with_order_mean):
    with pytest.raises(LosscheckError, match="already registered"):
        registry.register(ORDER_MEAN)
    with pytest.raises(LosscheckError, match="no statistical test is registered in family 'pti'"):
        registry.registered("pti")
    with pytest.raises(LosscheckError, match=r"not part of this split"):
        registry.split(0.01, "pit").share("conditional")
    misnamed = registry.StatTest("pit.other", "conditional", "conditional", order_mean_test)
    registry.register(misnamed)
    with pytest.raises(LosscheckError, match="registered as 'pit.other' returned a result named 'pit.order_mean'"):
        conditional_tests(values_of(torch.rand(100)), 0.05, 0.9)
