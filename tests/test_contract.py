"""Malformed drafter output fails with a message naming the drafter and the problem."""

from __future__ import annotations

import pytest
import torch

from losscheck.core.contract import Proposal, validate_proposal
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
