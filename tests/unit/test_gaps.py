"""Rows that propose fewer than k drafts, or none (`Proposal.counts`): validation, the capped
verification's law, the loop's counters, and greedy output through the gapped drafter."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.contract import Proposal, validate_proposal
from losscheck.core.sampling import GREEDY, SamplingParams, process_logits
from losscheck.core.verify import capped, verify_block
from losscheck.errors import DrafterOutputError
from losscheck.serving.gaps import Gapped, gap_counts
from tests.support import assert_follows, noisy_drafter, tiny_target

B, K, V = 3, 4, 16


@pytest.mark.parametrize(
    ("counts", "problem"),
    [
        (torch.tensor([0, 1]), r"counts has shape \(2,\), expected \(3,\)"),
        (torch.tensor([0, 5, 1]), r"counts span \[0, 5\], outside \[0, 4\]"),
        (torch.tensor([0.0, 1.0, 2.0]), "counts must be an integer tensor"),
    ],
)
def test_malformed_counts_are_named(counts: torch.Tensor, problem: str) -> None:
    with pytest.raises(DrafterOutputError, match=problem):
        validate_proposal(Proposal(torch.zeros(B, K, dtype=torch.long), counts=counts), "d", B, K, V)


def test_the_padding_of_a_row_needs_no_valid_q() -> None:
    tokens = torch.randint(V, (B, K))
    probs = torch.softmax(torch.randn(B, K, V), -1)
    probs[0, 2:] = 0.0  # row 0 proposes two drafts: its padding's q is never read
    out = validate_proposal(Proposal(tokens, probs, counts=torch.tensor([2, 4, 0])), "d", B, K, V)
    assert out.probs is not None and float(out.probs[0, 2, tokens[0, 2]]) == 1.0  # a point mass
    assert out.counts is not None and out.counts.tolist() == [2, 4, 0]


def test_greedy_keeps_no_padding_and_emits_the_argmax_after_the_proposed_drafts() -> None:
    logits = torch.randn(B, K + 1, V)
    drafts = logits[:, :K].argmax(-1)  # every draft would be accepted
    counts = torch.tensor([0, 2, 4])
    gen = torch.Generator()
    out = capped(verify_block(logits, drafts, None, GREEDY, gen), counts, logits, GREEDY, gen)
    assert out.accepted.tolist() == [0, 2, 4]
    assert out.tokens[torch.arange(B), counts].tolist() == logits[torch.arange(B), counts].argmax(-1).tolist()


def test_a_row_without_drafts_emits_exactly_the_targets_law() -> None:
    """20,000 rows drafting nothing, their padding the target's most likely tokens (a verifier
    reading the padding keeps it ~p_max of the time): the emitted token follows p at slot 0,
    Pearson χ² at α = 1e-3 (detects a TV of ~0.03 at power > 0.99 over 16 ids)."""
    rows, params = 20_000, SamplingParams(temperature=1.0)
    logits = torch.randn(1, K + 1, V, generator=torch.Generator().manual_seed(0)).expand(rows, -1, -1) * 2
    drafts = logits[:, :K].argmax(-1)
    q = torch.nn.functional.one_hot(drafts, V).float()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(rows, dtype=torch.long)
    out = capped(verify_block(logits, drafts, q, params, gen), counts, logits, params, gen)
    assert int(out.accepted.max()) == 0
    assert_follows(out.tokens[:, 0], process_logits(logits[0, 0], params).double(), alpha=1e-3, what="zero-draft token")


def test_gap_counts_cycle_through_none_half_and_all() -> None:
    assert gap_counts(torch.arange(6), 4, 3).tolist() == [0, 2, 4, 0, 2, 4]


def test_gapped_greedy_equals_plain_and_counts_what_it_proposed() -> None:
    from losscheck.core.engine import Engine

    target = tiny_target()
    drafter = noisy_drafter(target, 0.3)
    prompts = [[2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    plain = Engine(target, None, k=0).generate(prompts, 24, GREEDY, torch.Generator())
    spec = Engine(target, Gapped(drafter), k=K).generate(prompts, 24, GREEDY, torch.Generator())
    assert torch.equal(spec.tokens, plain.tokens)
    stats = spec.stats
    assert stats.zero_drafts > 0 and stats.row_rounds > stats.zero_drafts
    assert int(stats.proposed[0]) == stats.row_rounds - stats.zero_drafts  # slot 0: every row with a draft
    assert int(stats.proposed[-1]) < int(stats.proposed[0])  # half-block rows never reach the last slot
