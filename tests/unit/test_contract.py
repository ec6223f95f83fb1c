"""Malformed drafter output fails with a message naming the drafter and the problem."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from losscheck.core.contract import PROB_SUM_TOLERANCE, Proposal, validate_proposal
from losscheck.errors import DrafterOutputError

B, K, V = 2, 3, 5


def good_probs() -> torch.Tensor:
    return torch.full((B, K, V), 1.0 / V)


def test_a_valid_proposal_passes_through():
    tokens = torch.zeros(B, K, dtype=torch.long)
    assert validate_proposal(Proposal(tokens, good_probs()), "d", B, K, V).probs is not None
    assert validate_proposal(Proposal(tokens.int(), None), "d", B, K, V).tokens.dtype == torch.long


def _zero_prob_on_draft() -> torch.Tensor:
    probs = torch.zeros(B, K, V)
    probs[..., 1] = 1.0
    return probs


@pytest.mark.parametrize(
    "proposal, problem",
    [
        ((torch.zeros(B, K, dtype=torch.long),), "not losscheck.Proposal"),
        (Proposal(torch.zeros(B, K + 1, dtype=torch.long)), "shape"),
        (Proposal(torch.zeros(B, K)), "integer tensor"),
        (Proposal(torch.full((B, K), V, dtype=torch.long)), "outside the vocabulary"),
        (Proposal(torch.full((B, K), -1, dtype=torch.long)), "outside the vocabulary"),
        (Proposal(torch.zeros(B, K, dtype=torch.long), torch.full((B, K, V), float("nan"))), "NaN"),
        (Proposal(torch.zeros(B, K, dtype=torch.long), torch.full((B, K, V), 0.5)), "do not sum to 1"),
        (Proposal(torch.zeros(B, K, dtype=torch.long), good_probs()[..., :-1]), "shape"),
        (
            Proposal(
                torch.zeros(B, K, dtype=torch.long),
                good_probs() - 0.3 * (torch.arange(V) == 0) + 0.3 * (torch.arange(V) == 1),
            ),
            "negative",
        ),
        (Proposal(torch.zeros(B, K, dtype=torch.long), _zero_prob_on_draft()), "zero probability"),
    ],
)
def test_malformed_proposals_are_named(proposal, problem):
    with pytest.raises(DrafterOutputError, match="drafter 'my-drafter'") as err:
        validate_proposal(proposal, "my-drafter", B, K, V)
    assert problem in str(err.value)


def _one_entry(value: float, row: int = 1) -> torch.Tensor:
    """good_probs() with entry [row, 0, 2] set to `value` (one bad entry among good rows)."""
    probs = good_probs()
    probs[row, 0, 2] = value
    return probs


@pytest.mark.parametrize(
    "tokens, probs, problem",
    [
        (torch.full((B, K), V, dtype=torch.long), good_probs(), "outside the vocabulary"),
        (torch.zeros(B, K, dtype=torch.long), _one_entry(float("nan")), "NaN"),
        (torch.zeros(B, K, dtype=torch.long), _one_entry(float("inf")), "inf"),
        (torch.zeros(B, K, dtype=torch.long), _one_entry(float("-inf")), "inf"),
        (torch.zeros(B, K, dtype=torch.long), _one_entry(1.0 / V + 2e-3), "do not sum to 1"),
    ],
)
def test_one_bad_entry_among_good_rows_is_named(tokens, probs, problem):
    """The every-round check is one fused reduction; a single bad entry in one row of one slot
    still fails it, and the message names that entry's problem."""
    with pytest.raises(DrafterOutputError, match=problem):
        validate_proposal(Proposal(tokens, probs), "d", B, K, V)


def _accepted_by_rule(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """The contract, checked one property at a time (the reference the fused check must match)."""
    return bool(
        tokens.min() >= 0
        and tokens.max() < V
        and torch.isfinite(probs).all()
        and (probs >= 0).all()
        and ((probs.sum(-1) - 1).abs() <= PROB_SUM_TOLERANCE).all()
        and (probs.gather(-1, tokens.clamp(0, V - 1)[..., None]) > 0).all()
    )


# changes to one entry: none, moving 0.2 (= 1/V, a whole entry) or 0.201 in or out (pairs keep a
# row's sum while making an entry zero or negative), just inside and outside the sum tolerance,
# subnormal, NaN, inf
DELTAS = [0.0, 0.2, -0.2, 0.201, -0.201, -0.2 + 1e-45, 4e-4, 3e-3, float("nan"), float("inf")]


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, V - 1), min_size=B * K, max_size=B * K),
    bad_id=st.sampled_from([None, -1, V]),
    deltas=st.lists(st.sampled_from(DELTAS), min_size=3, max_size=3),
    where=st.lists(st.integers(0, V - 1), min_size=3, max_size=3),
    row=st.integers(0, B * K - 1),
)
# what a row sum cannot see: an entry made negative, the drafted token's made zero, ids one out
@example(ids=[1] * (B * K), bad_id=V, deltas=[0.0, 0.0, 0.0], where=[0, 0, 0], row=0)
@example(ids=[1] * (B * K), bad_id=-1, deltas=[0.0, 0.0, 0.0], where=[0, 0, 0], row=0)
@example(ids=[1] * (B * K), bad_id=None, deltas=[-0.201, 0.201, 0.0], where=[0, 2, 0], row=3)
@example(ids=[1] * (B * K), bad_id=None, deltas=[-0.2, 0.2, 0.0], where=[1, 2, 0], row=3)
def test_the_fused_check_accepts_exactly_what_the_contract_accepts(ids, bad_id, deltas, where, row):
    """validate_proposal passes a block iff every property of the contract holds, on blocks whose
    row `row` has up to three entries changed (to zero, negative with the row's sum kept, just
    inside or outside the sum tolerance, subnormal, NaN, inf), some with an id one past either
    end of the vocabulary."""
    tokens = torch.tensor(ids).view(B, K)
    if bad_id is not None:
        tokens[0, 0] = bad_id
    probs = good_probs().view(B * K, V)
    for delta, at in zip(deltas, where):
        probs[row, at] += delta
    probs = probs.view(B, K, V)
    expected = _accepted_by_rule(tokens, probs)
    try:
        validate_proposal(Proposal(tokens, probs), "d", B, K, V)
        passed = True
    except DrafterOutputError:
        passed = False
    assert passed == expected


def test_a_truncated_draft_q_is_read_as_its_kept_entries_renormalised():
    """The loop keeps a drafted q's M largest entries; a wide q of a large vocabulary keeps under
    all its mass, and what reads q as a law (the bug classes, which refuse a q not summing to 1)
    reads the kept entries renormalised — q itself where nothing was cut, zeros where no draft."""
    import torch

    from losscheck.core.generation import DraftQ

    ids = torch.tensor([[[3, 1], [0, 2], [0, 0]]])  # [1, 3, M=2]
    probs = torch.tensor([[[0.3, 0.1], [0.75, 0.25], [0.0, 0.0]]])
    law = DraftQ(ids, probs).law(4)  # [1, 3, 4]
    assert torch.allclose(law[0, 0], torch.tensor([0.0, 0.25, 0.0, 0.75], dtype=torch.float64))
    assert torch.allclose(law[0, 1], torch.tensor([0.75, 0.0, 0.25, 0.0], dtype=torch.float64))
    assert not law[0, 2].any()
