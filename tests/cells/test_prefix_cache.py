"""The block-hashed prefix cache: block identity, what is stored, eviction, and the engine with a
cache giving exactly the output of the engine without one (and the planted bugs not)."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.engine import Engine
from losscheck.core.ragged import RaggedKVCache
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.errors import LosscheckError
from losscheck.selftest.serving import hash_without_last_token, partial_hash_cache, stale_cache
from losscheck.serving.prefix_cache import PrefixCache, block_hash, second_turn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens)


def test_a_block_is_known_by_every_token_of_it_and_of_the_prefix_before_it():
    root = block_hash(b"", ids(1, 2, 3, 4))
    assert block_hash(b"", ids(1, 2, 3, 4)) == root
    for changed in (ids(9, 2, 3, 4), ids(1, 2, 3, 9)):
        assert block_hash(b"", changed) != root
    assert block_hash(root, ids(5, 6, 7, 8)) != block_hash(block_hash(b"", ids(1, 2, 3, 9)), ids(5, 6, 7, 8))
    # the planted bug: blind to the block's last token
    assert hash_without_last_token(b"", ids(1, 2, 3, 4)) == hash_without_last_token(b"", ids(1, 2, 3, 9))


def filled_cache(rows: int = 2, capacity: int = 12) -> RaggedKVCache:
    """A one-layer cache whose entry at (row b, slot s) is 100·b + s."""
    cache = RaggedKVCache(rows, capacity)
    entries = (100 * torch.arange(rows)[:, None] + torch.arange(capacity)).float()  # [B, S]
    cache.keys[0] = entries[:, None, :, None].clone()  # [B, 1, S, 1]
    cache.values[0] = -cache.keys[0]
    return cache


def test_only_blocks_complete_within_the_valid_tokens_are_stored_and_found_again():
    cache, tokens = filled_cache(), torch.arange(24).reshape(2, 12) % 5
    pc = PrefixCache(block=4, capacity=8)
    pc.reset(2)
    pc.store(cache, tokens, torch.tensor([7, 8]), [0, 1], None)  # row 0: one block (slot 7 not valid), row 1: two
    assert pc.stats.stored == 3
    fresh = RaggedKVCache(2, 12)
    pc.reset(2)
    matched = pc.load(fresh, tokens.flip(0), torch.tensor([11, 11]), [0, 1], None)  # rows swapped
    assert matched.tolist() == [8, 4]  # row 0 now holds old row 1's tokens: both blocks; row 1 one
    assert fresh.keys[0][0, 0, :8, 0].tolist() == [100.0 + s for s in range(8)]
    assert fresh.values[0][1, 0, :4, 0].tolist() == [-float(s) for s in range(4)]
    assert fresh.keys[0][1, 0, 4:, 0].abs().sum() == 0  # the miss stops the copy
    assert (pc.stats.lookups, pc.stats.hits) == (4, 3)


def test_the_least_recently_used_block_is_evicted_first():
    cache, tokens = filled_cache(rows=3), torch.tensor([[1] * 12, [2] * 12, [3] * 12])
    pc = PrefixCache(block=4, capacity=2)
    pc.reset(3)
    pc.store(cache, tokens, torch.tensor([4, 4, 0]), [0, 1], None)
    pc.load(RaggedKVCache(3, 12), tokens, torch.tensor([4, 0, 0]), [0], None)  # row 0's block used again
    pc.store(cache, tokens, torch.tensor([0, 0, 4]), [2], None)  # a third block: evicts row 1's
    assert pc.stats.evictions == 1
    pc.reset(3)
    assert pc.load(RaggedKVCache(3, 12), tokens, torch.tensor([4, 4, 4]), [0, 1, 2], None).tolist() == [4, 0, 4]


def test_bad_sizes_and_targets_without_a_ragged_cache_are_named():
    with pytest.raises(LosscheckError, match="block >= 1"):
        PrefixCache(block=0)

    class Opaque:
        name = "opaque"

    from losscheck.serving.prefix_cache import ragged_cache

    with pytest.raises(LosscheckError, match="'opaque' has none"):
        ragged_cache(Opaque())


def test_second_turn_continues_each_prompt_and_adds_a_sibling_differing_in_one_block_end():
    turns = second_turn([[0, 1, 2], [0, 5]], [[3, 4, 5, 6, 7], [6]], block=4, vocab=8, room=7)
    assert turns[:2] == [[0, 1, 2, 3, 4, 5, 6], [0, 5, 6]]
    assert turns[2:] == [[0, 1, 2, 4, 4, 5, 6]]  # token 3 (block 0's last) changed; row 2 has no complete block


@pytest.fixture(scope="module")
def bundled(session):
    return session, session.target()


def warm_run(session, target, drafter, cache, tier="mid", n=8, new=24):
    """A first turn of `n` prompts of `tier` through `cache`, then its second turn; → (second-turn
    output, plain decoding's output of the second turn)."""
    prompts = session.prompts(tier)[:n]
    engine = Engine(target, drafter, 4, prefix_cache=cache)
    first = engine.generate(prompts, new, GREEDY, make_generator(0, "first"))
    requests = second_turn(prompts, [first.row(i) for i in range(len(prompts))], cache.block, target.vocab_size, 200)
    spec = engine.generate(requests, new, GREEDY, make_generator(0, "second"))
    return spec, Engine(target).generate(requests, new, GREEDY, make_generator(0, "second"))


@pytest.mark.parametrize("drafter", ["A", "eagle3", "self"])
def test_a_warm_cache_gives_exactly_the_uncached_output(bundled, drafter):
    session, target = bundled
    cache = PrefixCache(block=4)
    spec, plain = warm_run(session, target, session.drafters()[drafter], cache)
    assert torch.equal(spec.tokens, plain.tokens) and torch.equal(spec.lengths, plain.lengths)
    assert cache.stats.hit_rate > 0.5  # the second turn read most of its blocks from the cache


def test_a_small_cache_evicts_and_stays_exact(bundled):
    session, target = bundled
    cache = PrefixCache(block=4, capacity=6)
    spec, plain = warm_run(session, target, session.drafters()["A"], cache)
    assert cache.stats.evictions > 0 and torch.equal(spec.tokens, plain.tokens)


def test_the_same_seed_samples_the_same_tokens_with_and_without_the_cache(bundled):
    session, target = bundled
    prompts = session.prompts("low")[:8] * 2
    outputs = []
    for cache in (None, PrefixCache(block=4)):
        engine = Engine(target, session.drafters()["A"], 4, prefix_cache=cache)
        engine.generate(prompts, 8, SamplingParams(), make_generator(0, "warm-up"))
        outputs.append(engine.generate(prompts, 16, SamplingParams(), make_generator(0, "x")).tokens)
    assert torch.equal(*outputs)


@pytest.mark.parametrize("plant", [stale_cache, partial_hash_cache])
def test_the_planted_cache_bugs_change_the_output(bundled, plant):
    session, target = bundled
    # the high-entropy tier: rejections (and so stale slots) are common, outputs not repetitive
    spec, plain = warm_run(session, target, session.drafters()["A"], plant(PrefixCache(block=4)), "high", 16, 48)
    assert not torch.equal(spec.tokens, plain.tokens)
