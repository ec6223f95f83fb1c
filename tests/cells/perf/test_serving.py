"""Continuous batching over `Engine.step`: requests admitted into finished rows decode exactly as
they would alone, admission does not wait for a batch to drain, bad input is named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from losscheck import bundled
from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, make_generator
from losscheck.errors import LosscheckError
from losscheck.perf.serving import forget_rows, serve, trace_problems
from losscheck.perf.workload import Request, make_workload
from losscheck.run import drafters as registry
from tests.support import run_shipped

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def drafters(target):
    return registry.bundled("main", target)


@pytest.fixture(scope="module")
def requests_() -> list[Request]:
    sets = {tier: bundled.load_prompts(tier) for tier in bundled.PROMPT_TIERS}
    return make_workload(sets, 7, 24, seed=3)


@pytest.mark.parametrize("name", [None, "A", "E"])
def test_admitted_requests_decode_as_they_would_alone(target, drafters, requests_, name):
    # Greedy, fp32: every request's tokens equal a batch-of-one Engine.generate of it, so prefill
    # into reused rows, per-row budgets and the drafter forgetting rows leave outputs unchanged
    # (A keeps a per-row draft cache, E reads the target's hidden states of the prefilled rows).
    drafter = drafters[name] if name else None
    alone = [Engine(target).generate([r.prompt], r.max_new, GREEDY, make_generator(0)).row(0) for r in requests_]
    trace = serve(target, drafter, 4, requests_, 3, GREEDY, make_generator(0))
    assert [t.tokens for t in trace.requests] == alone
    assert trace_problems(trace, 4, target.eos_id) == []
    if name:
        assert trace.stats.acceptance_length > 1.5  # the drafter's state survived admission


def test_a_finished_row_takes_the_next_request_before_the_others_finish(target, drafters):
    prompt = bundled.load_prompts("low")[0]
    reqs = [Request(prompt, b, "low") for b in (2, 20, 2, 2)]
    trace = serve(target, drafters["A"], 4, reqs, 2, GREEDY, make_generator(0))
    first, long, third = trace.requests[0], trace.requests[1], trace.requests[2]
    assert third.admitted >= first.finished and third.admitted < long.finished  # no waves
    assert [t.output_tokens for t in trace.requests] == [2, 20, 2, 2]


def test_trace_problems_catch_broken_accounting(target, requests_):
    trace = serve(target, None, 4, requests_[:2], 2, GREEDY, make_generator(0))
    trace.requests[0].tokens = trace.requests[0].tokens[:-1]  # as if a row stopped early
    found = trace_problems(trace, 4, target.eos_id)
    assert any("without EOS" in p for p in found) and any("emission events" in p for p in found)
    trace.draft_s = trace.round_s
    assert any("exceed the rounds" in p for p in trace_problems(trace, 4, target.eos_id))


def test_bad_input_is_named(target, requests_):
    with pytest.raises(LosscheckError, match="concurrency must be >= 1"):
        serve(target, None, 4, requests_, 0, GREEDY, make_generator(0))
    with pytest.raises(LosscheckError, match="outside the vocabulary"):
        serve(target, None, 4, [Request([0, 999], 4, "low")], 1, GREEDY, make_generator(0))
    with pytest.raises(LosscheckError, match="positions"):
        serve(target, None, 4, [Request([0, 5], target.max_positions, "low")], 1, GREEDY, make_generator(0))
    with pytest.raises(LosscheckError, match="budget >= 1"):
        serve(target, None, 4, [dataclasses.replace(requests_[0], max_new=0)], 1, GREEDY, make_generator(0))


def test_a_drafter_with_unknown_row_state_must_offer_forget_rows(drafters):
    class Stateful:
        name = "stateful"

    with pytest.raises(LosscheckError, match="forget_rows"):
        forget_rows(Stateful(), torch.tensor([1]))  # type: ignore[arg-type]

    class Forgets(Stateful):
        def __init__(self) -> None:
            self.forgotten: list[int] = []

        def forget_rows(self, rows: torch.Tensor) -> None:
            self.forgotten += rows.tolist()

    drafter = Forgets()
    forget_rows(drafter, torch.tensor([0, 2]))  # type: ignore[arg-type]
    assert drafter.forgotten == [0, 2]


@pytest.mark.e2e
def test_the_perf_tier_refuses_to_time_under_xdist(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    select = "compare or (test_rung and baseline and c32)"
    result = run_shipped(pytester, "-m", "perf", "-rs", "-k", select, module="losscheck.plugin.certify.test_perf")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*does not time under pytest-xdist (this is worker gw3)*"])
