"""The batched loop against its own baseline on tiny random Llamas (fast, no fixtures).

A noisy copy of the target as drafter makes rows accept different counts every round, which
exercises the ragged cache rollback and position bookkeeping.
"""

from __future__ import annotations

import copy

import pytest
import torch

from losscheck.core.contract import Proposal
from losscheck.core.engine import Engine, emit_counts, reported_q
from losscheck.core.generation import DraftQ
from losscheck.core.sampling import GREEDY, SamplingParams, make_generator
from losscheck.core.target import HFTarget
from losscheck.drafters.autoregressive import AutoregressiveDrafter, self_draft
from losscheck.errors import DrafterOutputError, LosscheckError
from tests.support import PROMPTS, noisy_drafter, tiny_target

NOISE = 0.6  # the drafter's weight noise, relative to each weight tensor's std


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return tiny_target()


def greedy(engine: Engine, prompts=PROMPTS, max_new: int = 24):
    return engine.generate(prompts, max_new, GREEDY, make_generator(0, "g"))


@pytest.mark.parametrize("k", [1, 3, 8])
def test_ragged_greedy_spec_equals_baseline(target, k):
    base = greedy(Engine(target))
    spec = greedy(Engine(target, noisy_drafter(target, NOISE), k))
    assert torch.equal(spec.tokens, base.tokens) and torch.equal(spec.lengths, base.lengths)
    accepted = spec.stats.accepted.sum()
    assert 0 < accepted < spec.stats.proposed.sum()  # rows really did accept different counts


def test_each_row_decodes_as_if_alone(target):
    batch = greedy(Engine(target, noisy_drafter(target, NOISE), 4))
    for b, prompt in enumerate(PROMPTS):
        alone = greedy(Engine(target, noisy_drafter(target, NOISE), 4), [prompt])
        assert alone.row(0) == batch.row(b)


def test_self_draft_is_always_accepted(target):
    out = greedy(Engine(target, self_draft(target), 4))
    assert torch.equal(out.stats.accepted, out.stats.proposed)


@pytest.mark.parametrize("max_new", [0, 1])
def test_tiny_budgets(target, max_new):
    base = greedy(Engine(target), max_new=max_new)
    spec = greedy(Engine(target, noisy_drafter(target, NOISE), 4), max_new=max_new)
    assert spec.lengths.tolist() == [max_new] * len(PROMPTS)
    assert torch.equal(spec.tokens, base.tokens)


def test_eos_mid_block_stops_the_row_there(target):
    plain = greedy(Engine(target))
    eos = plain.row(2)[5]  # a token row 2 emits at its 6th step
    target_eos = copy.copy(target)
    target_eos.eos_id = eos
    base = greedy(Engine(target_eos))
    spec = greedy(Engine(target_eos, self_draft(target), 8))  # k=8: EOS lands mid-block
    assert torch.equal(spec.tokens, base.tokens) and torch.equal(spec.lengths, base.lengths)
    assert spec.row(2)[-1] == eos and spec.lengths[2] <= 6


def test_context_near_the_maximum_position():
    small = tiny_target(max_positions=24)
    prompt = [[0] + list(range(2, 18))]  # 17 tokens + 7 new = 24 positions
    base = greedy(Engine(small), prompt, max_new=7)
    spec = greedy(Engine(small, noisy_drafter(small, NOISE), 8), prompt, max_new=7)
    assert torch.equal(spec.tokens, base.tokens)
    with pytest.raises(LosscheckError, match="exceeds the target's 24 positions"):
        greedy(Engine(small), prompt, max_new=8)


def test_sampling_is_reproducible_from_the_seed(target):
    engine = Engine(target, noisy_drafter(target, NOISE), 4)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    a = engine.generate(PROMPTS * 20, 16, params, make_generator(3, "s"))
    b = engine.generate(PROMPTS * 20, 16, params, make_generator(3, "s"))
    c = engine.generate(PROMPTS * 20, 16, params, make_generator(4, "s"))
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


def test_bad_prompts_are_named(target):
    with pytest.raises(LosscheckError, match="prompt 1 is empty"):
        greedy(Engine(target), [[0], []])
    with pytest.raises(LosscheckError, match="outside the vocabulary"):
        greedy(Engine(target), [[0, 999]])


class NaNDrafter(AutoregressiveDrafter):
    def propose(self, ctx):
        proposal = super().propose(ctx)
        return Proposal(proposal.tokens, torch.full_like(proposal.probs, float("nan")))


def test_malformed_drafter_output_fails_naming_the_drafter(target):
    engine = Engine(target, NaNDrafter(target.model, "nan-drafter"), 2)
    with pytest.raises(DrafterOutputError, match="drafter 'nan-drafter'.*NaN"):
        engine.generate(PROMPTS, 4, SamplingParams(), make_generator(0, "n"))


def test_a_malformed_verifier_outcome_is_named(target):
    from losscheck.core.verify import BlockOutcome, verify_block

    def drops_a_row(logits, drafts, q, params, generator):
        outcome = verify_block(logits, drafts, q, params, generator)
        return BlockOutcome(outcome.accepted[1:], outcome.tokens[1:])

    def accepts_too_many(logits, drafts, q, params, generator):
        outcome = verify_block(logits, drafts, q, params, generator)
        return BlockOutcome(outcome.accepted + drafts.shape[1] + 1, outcome.tokens)

    with pytest.raises(LosscheckError, match=r"verifier .*drops_a_row returned accepted \(5,\)"):
        greedy(Engine(target, noisy_drafter(target, NOISE), 2, verifier=drops_a_row))
    with pytest.raises(LosscheckError, match=r"accepts_too_many accepted counts outside \[0, 2\]"):
        greedy(Engine(target, noisy_drafter(target, NOISE), 2, verifier=accepts_too_many))


def test_a_pass_from_slot_0_computes_repeated_rows_once_and_gives_every_row_its_own():
    """Rows that repeat a prompt (a sampled cell cycles over a few) are computed once from slot 0:
    logits, states and the cache rows equal a pass over the distinct rows one at a time."""
    model = tiny_target()
    rows = torch.tensor([[1, 5, 7, 2], [3, 4, 4, 0], [1, 5, 7, 2], [3, 4, 4, 0], [9, 8, 7, 6]])  # [5, 4]
    model.reset(len(rows), 8)
    logits, hidden = model.forward(rows, torch.zeros(len(rows), dtype=torch.long))
    shared = model.lm.cache
    assert shared is not None
    for b, row in enumerate(rows):
        model.reset(1, 8)
        alone_logits, alone_hidden = model.forward(row[None], torch.zeros(1, dtype=torch.long))
        assert torch.allclose(logits[b], alone_logits[0], atol=1e-5)
        assert torch.allclose(hidden[b], alone_hidden[0], atol=1e-5)
        alone = model.lm.cache
        assert alone is not None
        for layer, keys in alone.keys.items():
            assert torch.allclose(shared.keys[layer][b, :, :4], keys[0, :, :4], atol=1e-5)
            assert torch.allclose(shared.values[layer][b, :, :4], alone.values[layer][0, :, :4], atol=1e-5)
    # a later pass reads the copied cache rows like its own
    model.reset(len(rows), 8)
    model.forward(rows, torch.zeros(len(rows), dtype=torch.long))
    after, _ = model.forward(torch.tensor([[2], [0], [2], [0], [6]]), torch.full((len(rows),), 4))
    assert torch.allclose(after[0], after[2]) and torch.allclose(after[1], after[3])


def test_emit_counts_stop_at_the_budget_and_after_the_first_eos():
    eos = 9
    emitted = torch.tensor([[1, 9, 2, 9], [1, 2, 3, 4], [9, 1, 2, 3], [1, 2, 9, 3]])  # [B, k+1]
    count = torch.tensor([4, 4, 4, 2])  # accepted + 1
    room = torch.tensor([5, 2, 5, 5])  # budget left
    emit, ended = emit_counts(emitted, count, room, eos)
    # row 0: EOS at slot 1; row 1: the budget; row 2: EOS first; row 3: its EOS lies past its count
    assert emit.tolist() == [2, 2, 1, 2]
    assert ended is not None and ended.tolist() == [True, False, True, False]
    emit, ended = emit_counts(emitted, count, room, None)
    assert emit.tolist() == [4, 2, 4, 2] and ended is None


@pytest.mark.parametrize("entries", [3, 8, 16])
def test_reported_q_keeps_the_largest_entries_of_each_draft(entries):
    """Each slot's sparse q holds the `entries` largest of the drafter's q (all of them when
    entries >= V), so its dense form is q itself, or q cut to its top entries; the bonus slot
    holds nothing. A point mass for a drafter without probs."""
    B, k, V = 2, 3, 8
    q = torch.softmax(torch.randn(B, k, V, generator=torch.Generator().manual_seed(1)), -1)
    ids, probs = reported_q(Proposal(q.argmax(-1), q), entries)  # [B, k+1, M]
    dense = DraftQ(ids, probs).dense(V)  # [B, k+1, V]
    kept = q.topk(min(entries, V), -1)
    expected = torch.zeros(B, k, V, dtype=torch.float64).scatter_(-1, kept.indices, kept.values.double())
    assert torch.equal(dense[:, :k], expected) and not dense[:, k].any()
    ids, probs = reported_q(Proposal(q.argmax(-1)), entries)
    assert torch.equal(DraftQ(ids, probs).dense(V)[:, :k], torch.nn.functional.one_hot(q.argmax(-1), V).double())


def test_stop_strings_end_greedy_rows_where_plain_decoding_does(session):
    """A stop string spans tokens and rounds (`losscheck.core.stops`); with the bundled target's
    five most frequent bigrams, the speculative loop ends each row exactly where the baseline
    does, at the token that completes the first string, many of them inside an accepted block."""
    from losscheck.cells.ends import end_problems, ends_in_blocks
    from losscheck.core.stops import StopStrings
    from losscheck.plan.tiers import STOP_STRINGS

    target = session.target()  # the bundled main target, whose ids spell characters
    params = SamplingParams(temperature=0, stop_strings=StopStrings(STOP_STRINGS))
    prompts = [list(range(2 + i, 8 + i)) for i in range(0, 48, 3)]
    run = lambda engine: engine.generate(prompts, 24, params, torch.Generator())  # noqa: E731
    base, spec = run(Engine(target)), run(Engine(target, noisy_drafter(target, 0.05), 4))
    assert torch.equal(spec.lengths, base.lengths) and torch.equal(spec.tokens, base.tokens)
    assert end_problems(spec, target.eos_id, target.vocab_size) == []
    counts = ends_in_blocks(spec, target.eos_id, target.vocab_size)
    assert counts is not None and int((base.lengths < 24).sum()) >= 4 and counts.string_ends_in_block >= 2, counts
