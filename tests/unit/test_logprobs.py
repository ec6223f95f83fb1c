"""The log-probabilities the loop reports (`losscheck.core.logprobs`) and the check that reads
them (`losscheck.cells.logprob_check`): exact against a teacher-forced pass, and each planted
reporting bug past the bound."""

from __future__ import annotations

import pytest
import torch

from losscheck.cells.logprob_check import ROUNDING, LogprobCheck, logprob_problems
from losscheck.cells.record import SampleFacts
from losscheck.cells.scoring import teacher_forced_probs
from losscheck.core.engine import Engine
from losscheck.core.generation import Generation
from losscheck.core.logprobs import LogprobRule
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.selftest import logprob_bugs
from losscheck.serving.batching import ContinuousBatcher
from tests.support import noisy_drafter, tiny_target

PROMPTS = [[2, 3, 4], [5, 6], [9, 10, 11, 12]] * 4
TOLERANCE = 4e-5  # fp32's logit tolerance (`losscheck.core.precision.LOGIT_TOLERANCE`)


@pytest.fixture(scope="module")
def pair():
    target = tiny_target()
    return target, noisy_drafter(target, 0.3)


def _checked(target, gen: Generation) -> LogprobCheck:
    """`gen`'s reported logprobs against a fresh teacher-forced pass of `target`."""
    assert gen.logprobs is not None
    forced = teacher_forced_probs(target, PROMPTS, gen.tokens, gen.params)
    check = LogprobCheck(TOLERANCE, gen.params.temperature)
    check.observe(gen.logprobs, gen.tokens, gen.mask() & ~forced.ambiguous, forced.probs)
    return check


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.6, top_k=20), SamplingParams(top_p=0.9)],
    ids=lambda p: p.label(),
)
def test_the_loop_reports_each_tokens_log_p_at_its_own_position(pair, params) -> None:
    target, drafter = pair
    spec, plain = (
        engine.generate(PROMPTS, 12, params, torch.Generator().manual_seed(0))
        for engine in (Engine(target, drafter, k=4), Engine(target))
    )
    assert 0 < int(spec.stats.accepted.sum()) < int(spec.stats.proposed.sum())  # accepted, recovered and bonus slots
    for gen in (spec, plain):
        check = _checked(target, gen)
        assert check.checked > 100 and check.off == 0, f"worst deviation {check.worst:.3g} nats"
        assert check.worst < TOLERANCE  # the same fp32 model in two batch shapes: far inside the bound
        assert logprob_problems(check.facts()) == []


def test_greedy_requests_report_no_logprobs(pair) -> None:
    target, drafter = pair
    assert Engine(target, drafter, k=4).generate(PROMPTS, 6, GREEDY, torch.Generator()).logprobs is None


def test_continuous_batching_carries_each_requests_logprobs(pair) -> None:
    target, drafter = pair
    batcher = ContinuousBatcher(Engine(target, drafter, k=4), rows=3)
    gen = batcher.generate(PROMPTS, 10, SamplingParams(), torch.Generator().manual_seed(1))
    check = _checked(target, gen)
    assert check.checked == int(gen.mask().sum()) and check.off == 0


@pytest.mark.parametrize(
    "rule", [logprob_bugs.logprobs_zero, logprob_bugs.logprobs_of_draft, logprob_bugs.logprobs_of_next_position]
)
def test_each_planted_reporting_bug_leaves_the_bound_while_the_tokens_stay_exact(pair, rule: LogprobRule) -> None:
    target, drafter = pair
    seed = torch.Generator().manual_seed(2)
    right = Engine(target, drafter, k=4).generate(PROMPTS, 12, SamplingParams(), seed)
    wrong = Engine(target, drafter, k=4, logprobs=rule).generate(
        PROMPTS, 12, SamplingParams(), torch.Generator().manual_seed(2)
    )
    assert torch.equal(right.tokens, wrong.tokens)  # the bug reports, it does not draw
    check = _checked(target, wrong)
    assert check.off > 10 and check.worst > 0.1
    (problem,) = logprob_problems(check.facts())
    assert problem.startswith(f"logprobs: {check.off} of {check.checked} reported log-probabilities differ")


def test_the_bound_is_two_tolerances_over_the_temperature() -> None:
    check = LogprobCheck(tolerance=0.3, temperature=0.5)
    assert check.bound == pytest.approx(1.2 + ROUNDING)
    p = torch.tensor([[[0.5, 0.25, 0.25]]])  # [1, 1, V]
    token = torch.tensor([[1]])
    inside, outside = torch.tensor([[-1.386 + 1.1]]), torch.tensor([[-1.386 - 1.3]])
    check.observe(inside, token, torch.tensor([[True]]), p)
    assert check.off == 0
    check.observe(outside, token, torch.tensor([[False]]), p)  # not read: not counted
    assert (check.checked, check.off) == (1, 0)
    check.observe(outside, token, torch.tensor([[True]]), p)
    assert (check.checked, check.off) == (2, 1) and check.worst == pytest.approx(1.3, abs=1e-3)
    assert LogprobCheck(4e-5).facts() == SampleFacts()  # nothing compared: nothing claimed
