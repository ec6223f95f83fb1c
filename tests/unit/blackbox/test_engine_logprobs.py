"""`engine_logprob_check`: Hugging Face assisted generation's reported logprobs (its processed
scores) against the reference target, speculation on and off, and a planted reporting bug."""

from __future__ import annotations

import pytest

from losscheck.cells.engine.logprobs import engine_logprob_check
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


def test_assisted_generation_reports_the_top_ids_of_the_processed_law_on_both_sides(pair) -> None:
    """Hugging Face's top 5 at each position (the top of its processed scores) are the reference
    target's five most probable ids with their log p, in rounds and in plain decoding."""
    target, engine = pair
    params = SamplingParams(temperature=0.7, top_k=8)
    checks = engine_logprob_check(engine, target, PROMPTS, params, seed=3, rows=3, horizon=12, top=5)
    for side, check in checks.items():
        assert check.top == 5 and check.top_checked > 40 and check.top_off == 0, f"{side}: {check.top_worst:.3g}"
        assert logprob_problems(check.facts()) == []


def test_top_ids_read_from_the_next_position_are_caught_on_that_side_only(pair) -> None:
    from losscheck.selftest.logprob_bugs import TopLogprobsOfNextPosition

    target, engine = pair
    checks = engine_logprob_check(TopLogprobsOfNextPosition(engine), target, PROMPTS, SamplingParams(), 3, top=5)
    assert checks["plain"].top_off == 0 and checks["speculative"].off == 0  # the sampled tokens' are right
    assert checks["speculative"].top_off > 20
    (problem,) = logprob_problems(checks["speculative"].facts())
    assert "reported top 5 ids are not the target's most probable" in problem


def test_the_top_check_reads_values_sets_and_repeats() -> None:
    """A hand-made law over 6 ids: right top 3; a wrong value; an id outside the top 3; an id
    twice; a near-tie swapped within the bound (not off); -inf for an id the processing removed."""
    import math

    import torch

    from losscheck.cells.logprob_check import LogprobCheck

    p = torch.tensor([[[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]]]).repeat(1, 5, 1)  # [1, 5, 6]
    log = p.log()
    ids = torch.tensor([[[0, 1, 2], [0, 1, 2], [0, 1, 3], [0, 0, 1], [0, 1, 4]]])  # [1, 5, 3]
    values = log.gather(-1, ids).clone()
    values[0, 1, 2] += 0.01  # a value off by 0.01 nats
    check = LogprobCheck(tolerance=0.0)
    check.observe_top(ids, values, torch.ones(1, 5, dtype=torch.bool), p)
    # rows 1 (value), 2 (id 3 outside the top 3), 3 (id 0 twice), 4 (id 4: -inf where the 3rd is 0.2)
    assert (check.top_checked, check.top_off) == (5, 4)
    assert math.isclose(check.top_worst, 0.01, rel_tol=1e-3)
    tied = torch.tensor([[[0.4, 0.3, 0.15, 0.15, 0.0, 0.0]]])
    swap = LogprobCheck(tolerance=0.0)
    swap.observe_top(
        torch.tensor([[[0, 1, 3]]]),
        tied.log().gather(-1, torch.tensor([[[0, 1, 3]]])),
        torch.ones(1, 1, dtype=torch.bool),
        tied,
    )
    assert swap.top_off == 0  # the 3rd and 4th tie: either is a top 3
    gone = LogprobCheck(tolerance=0.0)
    two = torch.tensor([[[0.6, 0.4, 0.0, 0.0, 0.0, 0.0]]])  # top-k 2 left two: the 3rd reported is -inf
    reported = torch.tensor([[[0.6, 0.4, 0.0]]]).log()
    gone.observe_top(torch.tensor([[[0, 1, 5]]]), reported, torch.ones(1, 1, dtype=torch.bool), two)
    assert gone.top_off == 0


class PromptScorer:
    """An engine reporting its prompts' logprobs from `model` (the reference's own: right), or
    each one shifted by `shift` nats on the speculative side (wrong)."""

    name, k, precision = "prompt-scorer", 4, "fp32"

    def __init__(self, model, shift: float = 0.0) -> None:
        self.model, self.shift = model, shift

    def generate(self, request):  # pragma: no cover - the prompt check draws nothing
        raise AssertionError("not called")

    def prompt_logprobs(self, prompts, speculative):
        import torch

        out = []
        for prompt in prompts:
            with torch.no_grad():
                logp = self.model(torch.tensor([prompt])).logits[0, :-1].double().log_softmax(-1)
            values = logp.gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
            out.append(values + (self.shift if speculative else 0.0))
        return out


def test_prompt_logprobs_are_checked_on_both_sides_and_a_shift_is_caught(pair) -> None:
    from losscheck.cells.engine.logprobs import engine_prompt_logprob_check

    target, _ = pair
    right = engine_prompt_logprob_check(PromptScorer(target.model), target, PROMPTS)
    assert all(c.checked == 5 and c.off == 0 for c in right.values())  # 2 + 3 prompt tokens after the first
    wrong = engine_prompt_logprob_check(PromptScorer(target.model, shift=0.01), target, PROMPTS)
    assert wrong["plain"].off == 0 and wrong["speculative"].off == 5


def test_malformed_prompt_logprobs_are_engine_output_errors(pair) -> None:
    from losscheck.cells.engine.logprobs import engine_prompt_logprob_check
    from losscheck.engines import EngineOutputError

    target, engine = pair

    class Short(PromptScorer):
        def prompt_logprobs(self, prompts, speculative):
            return [values[:-1] for values in super().prompt_logprobs(prompts, speculative)]

    with pytest.raises(EngineOutputError, match=r"prompt 0's logprobs have shape \(1,\), expected \(2,\)"):
        engine_prompt_logprob_check(Short(target.model), target, PROMPTS)
    with pytest.raises(LosscheckError, match="reports no prompt logprobs"):
        engine_prompt_logprob_check(engine, target, PROMPTS)
