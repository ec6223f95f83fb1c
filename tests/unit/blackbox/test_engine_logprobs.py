"""`engine_logprob_check`: Hugging Face assisted generation's reported logprobs (its processed
scores) against the reference target, speculation on and off, and a planted reporting bug."""

from __future__ import annotations

import pytest

from losscheck.cells.engine_logprobs import engine_logprob_check
from losscheck.cells.logprob_check import logprob_problems
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.hf import HFAssistedEngine
from losscheck.errors import LosscheckError
from losscheck.selftest.logprob_bugs import LogprobsZeroWhenSpeculating
from tests.support import tiny_llama

PROMPTS = [[2, 3, 4], [5, 6, 7, 8]]


@pytest.fixture(scope="module")
def pair():
    from losscheck.core.target import HFTarget

    model, assistant = tiny_llama(), tiny_llama(seed=1)  # an unrelated assistant: many rejections
    return HFTarget(model, "toy", {"precision": "fp32"}), HFAssistedEngine(model, assistant, 4, eos=1)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.7, top_k=8), SamplingParams(top_p=0.9)],
    ids=lambda p: p.label(),
)
def test_assisted_generation_reports_the_processed_log_p_on_both_sides(pair, params) -> None:
    target, engine = pair
    checks = engine_logprob_check(engine, target, PROMPTS, params, seed=3, rows=3, horizon=12)
    for side, check in checks.items():
        assert check.checked > 40 and check.off == 0, f"{side}: worst {check.worst:.3g} nats"
        assert check.worst < 1e-5  # the same fp32 model, in one pass and in rounds


def test_zero_logprobs_when_speculating_are_caught_on_that_side_only(pair) -> None:
    target, engine = pair
    checks = engine_logprob_check(LogprobsZeroWhenSpeculating(engine), target, PROMPTS, SamplingParams(), 3, rows=3)
    assert checks["plain"].off == 0
    (problem,) = logprob_problems(checks["speculative"].facts())
    assert checks["speculative"].off > 30 and problem.startswith("logprobs:")


def test_a_greedy_request_or_an_engine_without_logprobs_is_refused(pair) -> None:
    target, engine = pair
    with pytest.raises(LosscheckError, match="needs a sampled request"):
        engine_logprob_check(engine, target, PROMPTS, GREEDY, 3)

    class Silent:
        name, k, precision = "silent", 4, "fp32"

    with pytest.raises(LosscheckError, match="reports no logprobs"):
        engine_logprob_check(Silent(), target, PROMPTS, SamplingParams(), 3)  # type: ignore[arg-type]
