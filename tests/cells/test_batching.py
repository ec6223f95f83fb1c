"""Continuous batching: staggered arrivals admitted into rows freed mid-generation give every
request exactly the output it gets alone (greedy), and the planted row leak does not."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.errors import LosscheckError
from losscheck.selftest.serving import RetiredRowLeak
from losscheck.serving.batching import ContinuousBatcher, staggered_arrivals
from losscheck.serving.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_arrivals_start_with_a_full_batch_then_stagger_deterministically():
    arrivals = staggered_arrivals(40, 8, 16, make_generator(0, "a"))
    assert arrivals[:8] == [0] * 8 and arrivals == sorted(arrivals)
    assert len(set(arrivals[8:])) > 5  # spread over many rounds, not one wave
    assert arrivals == staggered_arrivals(40, 8, 16, make_generator(0, "a"))


@pytest.fixture(scope="module")
def bundled(session):
    prompts = session.prompts("high")[:6] + session.prompts("low")[:6]
    return session, session.target(), prompts


def served(engine, prompts, batcher=ContinuousBatcher, rows=3, params=GREEDY, new=24):
    arrivals = staggered_arrivals(len(prompts), rows, new, make_generator(0, "arrivals"))
    return batcher(engine, rows).generate(prompts, new, params, make_generator(0, "x"), arrivals)


@pytest.mark.parametrize("drafter", ["A", "B", "eagle3"])
def test_each_request_gets_its_output_alone(bundled, drafter):
    session, target, prompts = bundled
    engine = Engine(target, session.drafters()[drafter], 4)
    gen = served(engine, prompts)
    alone = Engine(target).generate(prompts, 24, GREEDY, make_generator(0, "x"))
    assert torch.equal(gen.tokens, alone.tokens) and torch.equal(gen.lengths, alone.lengths)
    assert gen.stats.row_rounds > 0 and gen.slots is not None and int(gen.slots.max()) > 0


def test_continuous_batching_with_a_prefix_cache_stays_exact(bundled):
    session, target, prompts = bundled
    cache = PrefixCache(block=4)
    engine = Engine(target, session.drafters()["A"], 4, prefix_cache=cache)
    served(engine, prompts)
    again = served(engine, prompts)  # admissions now hit the blocks the first pass stored
    alone = Engine(target).generate(prompts, 24, GREEDY, make_generator(0, "x"))
    assert cache.stats.hits > 0 and torch.equal(again.tokens, alone.tokens)


def test_sampled_rows_are_complete_and_valid(bundled):
    session, target, prompts = bundled
    gen = served(Engine(target, session.drafters()["A"], 4), prompts, params=SamplingParams())
    ended = gen.tokens.gather(1, (gen.lengths - 1).clamp_min(0)[:, None]).squeeze(1)
    assert bool(((gen.lengths == 24) | (ended == target.eos_id)).all())  # budget or EOS, nothing else
    assert int(gen.tokens.max()) < target.vocab_size


def test_the_planted_row_leak_changes_the_output(bundled):
    session, target, prompts = bundled
    gen = served(Engine(target, session.drafters()["A"], 4), prompts, RetiredRowLeak)
    alone = Engine(target).generate(prompts, 24, GREEDY, make_generator(0, "x"))
    assert not torch.equal(gen.tokens, alone.tokens)


def test_bad_requests_are_named(bundled):
    session, target, prompts = bundled
    batcher = ContinuousBatcher(Engine(target), 2)
    with pytest.raises(LosscheckError, match="max_new_tokens >= 1"):
        batcher.generate(prompts, 0, GREEDY, make_generator(0), [0] * len(prompts))
    with pytest.raises(LosscheckError, match="arrival rounds"):
        batcher.generate(prompts, 4, GREEDY, make_generator(0), [0])
    with pytest.raises(LosscheckError, match="at least one row"):
        ContinuousBatcher(Engine(target), 0)
