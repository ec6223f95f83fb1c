"""The registry of statistical tests: counts, α splits and the tests a PIT cell's design sizes its
sample for come from it, and a new test is one function plus one registration
(`losscheck.stats.registry`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy import stats

from losscheck.cells.record import RunFacts
from losscheck.errors import LosscheckError
from losscheck.selftest import bugtable
from losscheck.stats import bugclass, effects, registry, sample_size
from losscheck.stats.bugclass import LR_BOUND, PowerAccumulator
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
    """The counts a cell splits α by: 9 PIT tests (4 of them the row-stream tests), 5 conditional,
    5 conformance (the support and impossible-decision checks spend none), 19 in a PIT cell of
    losscheck's own loop."""
    import losscheck.cells.conformance  # noqa: F401  (registers the conformance family)

    counts = {f: registry.budget_count(f) for f in ("pit", "conditional", "conformance")}
    assert counts == {"pit": 9, "conditional": 5, "conformance": 5}
    budget = registry.split(0.019, "pit", "conditional", "conformance")
    assert budget.per_test == pytest.approx(0.001)
    assert budget.share("pit", "conditional") == pytest.approx(0.014)
    names = [t.name for t in registry.registered("pit")]
    assert names[0] == "pit.support" and not registry.registered("pit")[0].spends_alpha


def test_a_new_test_is_one_registration(with_order_mean):
    """Registered in the conditional family, the toy test runs with the family at an even share of
    its α, and the split gives every test of a cell one twentieth of the cell's α."""
    assert registry.budget_count("conditional") == 6
    assert registry.split(0.020, "pit", "conditional", "conformance").per_test == pytest.approx(0.001)
    g = torch.Generator().manual_seed(0)
    results = conditional_tests(values_of(torch.rand(4000, generator=g)), 0.06, 0.9)
    assert [r.name for r in results][-1] == "pit.order_mean"
    assert all(r.alpha == pytest.approx(0.01) and r.scope == "conditional" for r in results)
    assert all(r.passed for r in results), [r.message() for r in results if not r.passed]
    # and it can fail: ordered PITs pushed towards 1 (the direction of a residual bug)
    pushed = conditional_tests(values_of(torch.rand(4000, generator=g) ** 0.8), 0.05, 0.9)
    assert not next(r for r in pushed if r.name == "pit.order_mean").passed


def test_a_real_cell_runs_a_registered_test(with_order_mean, session):
    """The base PIT cell of the bundled loop, with the toy test registered: its certificate record
    lists the new test, judged at the cell's α / 20 (19 built-in tests and the new one), and the
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
    assert tests["pit.token_counts"].alpha == pytest.approx(session.per_test_alpha / 20)
    assert math.fsum(t.alpha for t in tests.values()) <= session.per_test_alpha * (1 + 1e-9)


def test_registry_errors_name_the_fix(with_order_mean):
    registry.register(ORDER_MEAN)  # the same definition again (a module imported twice) replaces itself
    with pytest.raises(LosscheckError, match="already registered"):
        registry.register(registry.StatTest("pit.order_mean", "conditional", "conditional", values_of))
    with pytest.raises(LosscheckError, match="no statistical test is registered in family 'pti'"):
        registry.registered("pti")
    with pytest.raises(LosscheckError, match=r"not part of this split"):
        registry.split(0.01, "pit").share("conditional")
    misnamed = registry.StatTest("pit.other", "conditional", "conditional", order_mean_test)
    registry.register(misnamed)
    with pytest.raises(LosscheckError, match="registered as 'pit.other' returned a result named 'pit.order_mean'"):
        conditional_tests(values_of(torch.rand(100)), 0.05, 0.9)


@dataclasses.dataclass(frozen=True)
class MeanShiftEffect:
    """The toy test's power model per token: the shift `shift` of the mean of u from 1/2, sd
    sqrt(1/12) under H0, a two-sided z test; it sees the share `support` of the tokens."""

    shift: float
    support: float

    def tokens_needed(self, alpha: float, power: float) -> float:
        if self.shift == 0 or self.support <= 0:
            return math.inf
        z = stats.norm.isf(alpha / 2) + stats.norm.ppf(power)
        return math.ceil((z * math.sqrt(1 / 12) / abs(self.shift)) ** 2 / self.support)

    def power(self, n: float, alpha: float) -> float:
        return float(stats.norm.sf(stats.norm.isf(alpha / 2) - math.sqrt(n * self.support * 12) * abs(self.shift)))


def order_mean_effect(view: effects.ClassView) -> MeanShiftEffect:
    """Under the bug, the mean of the p - q ordered PITs from the class's residual bin masses
    (each bin's mass at its midpoint), among the tokens inside p's support."""
    masses = view.sums.residual / view.sums.residual.sum()  # [B]
    midpoints = (torch.arange(view.n_bins, dtype=torch.float64) + 0.5) / view.n_bins
    return MeanShiftEffect(float((masses * midpoints).sum()) - 0.5, float(view.sums.in_support) / view.steps)


# the same toy test, now with a power model: the one registration is all it takes to enter the design
ORDER_MEAN_DESIGNED = dataclasses.replace(
    ORDER_MEAN, power=effects.PowerModel(order_mean_effect, frozenset({"residual", "in_support"}))
)


@pytest.fixture
def with_designed_order_mean(monkeypatch):
    """ORDER_MEAN_DESIGNED registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(registry, "_TESTS", dict(registry._TESTS))
    registry.register(ORDER_MEAN_DESIGNED)


def pilot() -> PowerAccumulator:
    """A pilot of the bug-class table's Markov loop (V = 64, k = 4, acceptance about 0.88)."""
    chain = bugtable.make_chain(0.88, seed=3)
    return bugtable.accumulate(chain, bugtable.simulate(chain, rows=300, seed=4))


def design_of(acc: PowerAccumulator, alpha: float) -> tuple[dict[str, dict[str, float]], sample_size.ClassDesign]:
    """The design a PIT cell of budget `alpha` makes from `acc`: per class and test the tokens
    needed at one test's share of the PIT and conditional families, and the design itself."""
    needed = acc.tokens_needed(registry.split(alpha, registry.PIT, registry.CONDITIONAL).per_test, 0.9)
    return needed, sample_size.ClassDesign.of(needed, LR_BOUND, 500, 10**9)


def test_a_registered_power_model_enters_the_design(with_designed_order_mean):
    """Registered with a power model, the toy test is sized into a PIT cell's design: it appears
    in every class's per-test table with what its model reads from the class's own sums (on the
    ordered PITs a residual bug shifts, its one-degree mean test needs fewer tokens than the χ² of
    the same values), and it spends α — every other test now needs more tokens at its smaller
    share (a fifteenth of the two families' budget instead of a fourteenth), and so does the design."""
    acc = pilot()
    needed, design = design_of(acc, 0.01)
    assert "pit.order_mean" in bugclass.design_tests()
    assert all("pit.order_mean" in tests for tests in needed.values())
    assert needed["residual_is_p"]["pit.order_mean"] < needed["residual_is_p"]["pit.residual_order"]
    assert registry.split(0.015, registry.PIT, registry.CONDITIONAL).per_test == pytest.approx(0.001)

    with pytest.MonkeyPatch.context() as unregistered:
        unregistered.delitem(registry._TESTS, "pit.order_mean")
        before, design_before = design_of(acc, 0.01)
        assert registry.split(0.01, registry.PIT, registry.CONDITIONAL).per_test == pytest.approx(0.01 / 14)
    assert all("pit.order_mean" not in tests for tests in before.values())
    grew = 0
    for bug, tests in before.items():
        for test, tokens in tests.items():
            if math.isfinite(tokens) and test != LR_BOUND:
                assert needed[bug][test] >= tokens, (bug, test)  # never fewer (the slot χ² of one class: 100 at both)
                grew += needed[bug][test] > tokens
    assert grew > 0
    assert design.tokens > design_before.tokens


def test_a_power_model_names_the_sums_it_reads():
    with pytest.raises(LosscheckError, match=r"reads sums \['order_sums'\] that the bug-class design does not keep"):
        effects.PowerModel(order_mean_effect, frozenset({"residual", "order_sums"}))


def test_exact_and_two_sample_split_alpha_through_the_registry():
    """The per-position tests spend one share per position: an exact cell with 3 testable
    positions judges each test at α / 5, a two-sample cell of horizon 4 at α / 5 — the levels
    the hand-kept splits gave."""
    assert registry.split(0.01, registry.EXACT, positions=3).per_test == 0.01 / (2 + 3)
    assert registry.split(0.01, registry.TWO_SAMPLE, positions=4).per_test == 0.01 / (4 + 1)
    with pytest.raises(LosscheckError, match="asserts once per tested position"):
        registry.budget_count(registry.EXACT)
