"""Workloads: seeded, prompts without replacement until the pool runs out, budgets in range."""

from __future__ import annotations

import pytest

from losscheck.errors import LosscheckError
from losscheck.perf.workload import distinct_prompts, make_workload

SETS = {"low": [[0, 2, 5], [0, 2, 6]], "high": [[0, 4, 9], [0, 4, 10], [0, 4, 11]]}


def test_prompts_repeat_only_after_the_pool_is_used_up():
    reqs = make_workload(SETS, 5, 16, seed=1)
    assert distinct_prompts(reqs) == 5
    assert distinct_prompts(make_workload(SETS, 12, 16, seed=1)) == 5
    assert {r.tier for r in reqs} == {"low", "high"}


def test_budgets_are_in_range_and_the_workload_is_seeded():
    reqs = make_workload(SETS, 200, 16, 7, "c4")
    assert {r.max_new for r in reqs} == set(range(8, 17))
    assert reqs == make_workload(SETS, 200, 16, 7, "c4")
    assert reqs != make_workload(SETS, 200, 16, 7, "c8")


@pytest.mark.parametrize(
    "n, max_new, sets, says",
    [(0, 8, SETS, "at least one request"), (2, 0, SETS, "max_new"), (2, 8, {"low": []}, "prompt sets are empty")],
)
def test_bad_workloads_are_named(n, max_new, sets, says):
    with pytest.raises(LosscheckError, match=says):
        make_workload(sets, n, max_new, 1)
