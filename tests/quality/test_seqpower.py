"""The sequential-power table's machinery (`losscheck.selftest.seqpower`) on the bugtable chain:
an honest replicate stops early with every required member ruled out, a planted class keeps its
members from being ruled out and is rejected at the design's tokens."""

from __future__ import annotations

import functools
import math

import pytest

from losscheck.cells.sequential_design import SequentialDesign
from losscheck.selftest import bugtable, seqpower
from losscheck.stats.buglaws import BY_NAME

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _setup() -> tuple[SequentialDesign, seqpower.Tables]:
    chain = bugtable.make_chain(0.88, seed=0)
    plan = seqpower.plan(chain, 1)
    rows = math.ceil(max(plan.design.tokens, plan.fixed.tokens) / bugtable.LENGTH)
    return plan, seqpower.Tables.of(chain, bugtable.simulate(chain, rows, 2))


def test_the_plan_requires_each_reached_class_down_to_its_floor():
    plan, _ = _setup()
    assert plan.looks.tokens[-1] == plan.design.tokens and len(plan.looks.tokens) > 1
    for name, members in plan.grid.items():
        assert members[0] == 1.0 and all(0 < rho <= 1 for rho in members), name
    assert any(len(members) > 2 for members in plan.grid.values())


def test_an_honest_replicate_stops_early_and_passes():
    plan, tables = _setup()
    sequential_rejects, fixed_rejects, tokens = seqpower.replicate(plan, tables, None, seed=5)
    assert not sequential_rejects and not fixed_rejects
    assert tokens < plan.design.tokens


def test_a_planted_class_runs_to_the_last_look_and_is_rejected():
    plan, tables = _setup()
    bug = seqpower.Bug("stale_q", BY_NAME["stale_q"].law)
    sequential_rejects, fixed_rejects, tokens = seqpower.replicate(plan, tables, bug, seed=5)
    assert sequential_rejects and fixed_rejects
    assert tokens >= plan.design.tokens
