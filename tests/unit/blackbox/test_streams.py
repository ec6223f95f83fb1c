"""`stream_check`: a black-box engine's streams across requests (losscheck's loop behind the
black-box interface, and HF assisted generation), with the planted stream bugs of
`losscheck.selftest.streams` wrapped around each. 4 requests x 4 rows of 4 tokens at T = 1 on the
tiny random Llama (vocabulary 32); α = 0.01 over three tests; each bug makes every row after the
first request repeat (12 of 16), against about 0.1 repeats expected."""

from __future__ import annotations

import dataclasses

import pytest

from losscheck.cells.engine.streams import stream_check
from losscheck.core.sampling import GREEDY, SamplingParams
from losscheck.engines.spec_loop import SpecLoopEngine
from losscheck.errors import LosscheckError
from losscheck.selftest.streams import SeedIgnoredWhenSpeculating, SharedStream
from tests.support import noisy_drafter, tiny_llama, tiny_target

PROMPT = [0, 5]
T1 = SamplingParams(temperature=1.0)
SIZE = {"requests": 4, "rows": 4, "horizon": 4, "alpha": 0.01, "power": 0.9}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The models are tiny; see tests/conftest.py."""


def _by_name(results):
    return {r.name: r for r in results}


@pytest.fixture(scope="module")
def loop():
    target = tiny_target()
    return target, SpecLoopEngine(target, noisy_drafter(target, 0.5), k=2)


def test_the_loop_passes_and_reproduces_its_seeds(loop):
    target, engine = loop
    results = _by_name(stream_check(engine, target, PROMPT, T1, 7, **SIZE))
    assert all(r.passed for r in results.values()), [r.message() for r in results.values()]
    assert results["streams.reproducible"].n == 2  # the loop declares reproducible seeds: both replays checked
    assert results["streams.repeats"].detectable["repeat_share"] < 0.5


@pytest.mark.parametrize("bug", [SeedIgnoredWhenSpeculating, SharedStream])
def test_a_stream_shared_across_requests_is_caught_by_the_repeats(loop, bug):
    """Every row after the first request repeats an earlier one (with the shared stream, every row
    after the very first)."""
    target, engine = loop
    results = _by_name(stream_check(bug(engine), target, PROMPT, T1, 7, **SIZE))
    caught = results["streams.repeats"]
    assert not caught.passed and caught.statistic >= 12, caught.message()


def test_a_seed_that_does_not_reproduce_fails_where_the_adapter_promises_it(loop):
    target, engine = loop

    class Unseeded:
        """Draws every call from a seed of its own, though it declares reproducible seeds."""

        name, k, precision, reproducible_seeds = "unseeded", engine.k, "fp32", True

        def __init__(self) -> None:
            self.calls = 0

        def generate(self, request):
            self.calls += 1
            return engine.generate(dataclasses.replace(request, seed=1000 + self.calls))

    result = _by_name(stream_check(Unseeded(), target, PROMPT, T1, 7, **SIZE))["streams.reproducible"]
    assert not result.passed and result.alpha == 0 and "the ids differ" in result.observed, result.message()


def test_hf_assisted_generation_passes_and_its_seed_ignored_twin_is_caught():
    """transformers' assisted generation seeds the global generator from the request's seed, and
    the adapter declares reproducible seeds: both replays are checked."""
    from losscheck.core.target import HFTarget
    from losscheck.engines.hf import HFAssistedEngine

    model, assistant = tiny_llama(), tiny_llama(seed=1)
    target = HFTarget(model, "toy", {"precision": "fp32"})
    engine = HFAssistedEngine(model, assistant, k=2, eos=1)
    size = SIZE | {"rows": 2}
    fine = _by_name(stream_check(engine, target, PROMPT, T1, 3, **size))
    assert all(r.passed for r in fine.values()), [r.message() for r in fine.values()]
    assert fine["streams.reproducible"].n == 2
    caught = _by_name(stream_check(SeedIgnoredWhenSpeculating(engine), target, PROMPT, T1, 3, **size))
    assert not caught["streams.repeats"].passed, caught["streams.repeats"].message()


def test_a_greedy_request_or_a_single_request_is_refused(loop):
    target, engine = loop
    with pytest.raises(LosscheckError, match="needs a sampled request"):
        stream_check(engine, target, PROMPT, GREEDY, 7)
    with pytest.raises(LosscheckError, match="at least 2 requests"):
        stream_check(engine, target, PROMPT, T1, 7, requests=1)
