"""Mutant engines on a tiny random Llama: a plant with no bug to show (the oracle drafting) stays
lossless where it should, the greedy mutants really diverge, the wrappers refuse drafters and
targets they cannot plant a bug in."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.engine import Engine
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.core.target import HFTarget
from losscheck.core.verify import verify_block
from losscheck.errors import LosscheckError
from losscheck.run import factory
from losscheck.run.factory import planted_engine
from losscheck.selftest import catalogue, get_mutant
from tests.support import PROMPTS, noisy_drafter, tiny_target

MAX_NEW = 24
NOISE = 0.05  # the drafter's weight noise, relative to each weight tensor's std


@pytest.fixture(scope="module")
def target() -> HFTarget:
    """A tiny random Llama with sharp attention: at random-init scale attention is nearly uniform
    and position ids barely matter, which would hide the position mutant."""
    return tiny_target(attention_scale=8.0)


def run(engine: Engine, params: SamplingParams = GREEDY):
    return engine.generate(PROMPTS, MAX_NEW, params, make_generator(0, "mutant-test"))


def test_the_baseline_is_never_planted(target):
    from losscheck.plan.matrix import Cell
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    session = Session(Options(mutant="rows_mixed_up"))
    # The toy models in place of the fixtures, at the base precision.
    session.models._targets[("main", "fp32")] = target
    session.models._drafter_sets[("main", session.base_precision)] = {"A": noisy_drafter(target, NOISE)}
    cell = Cell("A", 3)
    assert factory.baseline_engine(session, cell).verifier is verify_block
    assert factory.engine(session, cell).verifier is get_mutant("rows_mixed_up").verifier


# The serving mutants plant a prefix cache or a scheduler, which only warm-cache and continuous-
# batching runs use: tests/cells/test_prefix_cache.py and tests/cells/test_batching.py show them changing output.
@pytest.mark.parametrize(
    "name",
    [m.name for m in catalogue() if m.kind == "greedy" and m.prefix_cache is None and m.scheduler is None]
    + ["recovered_after_rejected"],
)
def test_greedy_mutants_diverge_from_the_baseline(target, name):
    base = run(Engine(target))
    honest = run(Engine(target, noisy_drafter(target, NOISE), 3))
    assert torch.equal(honest.tokens, base.tokens)  # the toy loop is lossless without the bug
    planted = run(planted_engine(get_mutant(name), target, noisy_drafter(target, NOISE), 3))
    assert not torch.equal(planted.tokens, base.tokens), f"{name} left greedy output unchanged"


def test_stale_cache_gives_the_target_room_for_the_stale_entries(target):
    engine = planted_engine(get_mutant("stale_target_cache"), target, noisy_drafter(target, NOISE), 4)
    run(engine)  # stale entries pile up past the engine's capacity: this would overflow without them
    assert engine.target.inner.lm.cache.capacity >= MAX_NEW * 4


def test_the_cache_and_position_wrappers_read_the_first_block_honestly(target):
    """Before any rollback the wrappers must not change anything: one round of k = MAX_NEW - 1
    with the self-draft oracle (accepts every draft) is exactly plain decoding."""
    from losscheck.drafters.autoregressive import self_draft

    base = run(Engine(target))
    for name in ("stale_target_cache", "batch_max_positions"):
        planted = planted_engine(get_mutant(name), target, self_draft(target), MAX_NEW - 1)
        assert torch.equal(run(planted).tokens, base.tokens), name


def test_wrapping_mutants_refuse_a_drafter_that_is_not_family_a(target):
    class Other:
        name, block_lengths, widths, uses_hidden = "block", (4,), (), False

    with pytest.raises(LosscheckError, match="family-A"):
        planted_engine(get_mutant("greedy_draft_softmax_q"), target, Other(), 4)
