"""The speedup's decomposition against Leviathan et al.'s closed form."""

from __future__ import annotations

import pytest

from losscheck.perf.model import Decomposition


def test_prediction_is_leviathans_improvement_factor_with_measured_costs():
    # An autoregressive drafter with per-slot acceptance a, block k, each draft forward costing
    # c baseline steps, verification of k + 1 positions costing one step: Leviathan et al. (2023),
    # eq. 1 and Theorem 3.8: (1 - a^(k+1)) / ((1 - a)(k c + 1)).
    a, k, c, step = 0.8, 4, 0.1, 0.02
    tau = (1 - a ** (k + 1)) / (1 - a)
    d = Decomposition(tau, step, draft_s=k * c * step, verify_s=step)
    assert d.predicted == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))
    assert d.draft_cost == pytest.approx(k * c) and d.verify_cost == pytest.approx(1.0)


def test_free_drafting_and_verification_give_tau():
    assert Decomposition(3.2, 0.01, 0.0, 0.01).predicted == pytest.approx(3.2)


@pytest.mark.parametrize("bad", [{"tau": 0.5}, {"step_s": 0.0}, {"verify_s": 0.0}, {"draft_s": -1.0}])
def test_impossible_figures_are_refused(bad):
    args = {"tau": 2.0, "step_s": 0.01, "draft_s": 0.01, "verify_s": 0.01} | bad
    with pytest.raises(ValueError, match="decomposition"):
        Decomposition(**args)
