"""`Gapped`: a drafter that proposes fewer than k tokens, or none, at some positions.

Real drafters do: an n-gram (prompt-lookup) drafter proposes nothing when the context has no
match and fewer than k tokens when the match ends early, and engines skip speculation for a
request under load. A step with zero drafts is a different path through an engine (vLLM and
SGLang shipped hybrid-model bugs on it: the state slot such a step reads was stale), so the
matrix serves the reference drafter gapped (`losscheck.serving.gaps`).

Which rows propose how many is a fixed function of each row's committed length, so every run
and every rank sees the same gaps: at length ≡ 0 (mod `period`) none, at ≡ 1 half the block
(rounded down), else all k. The inner drafter still drafts the whole block (its state stays what
it would be, and it is told the true accepted counts); the tokens past a row's count are padding
the engine must never keep.
"""

from __future__ import annotations

from typing import Any

import torch

from losscheck.core.contract import DraftContext, Drafter, Proposal


class Gapped:
    """`inner`, proposing `gap_counts(ctx.lengths, k, period)` drafts per row."""

    def __init__(self, inner: Drafter, period: int = 3) -> None:
        if period < 2:
            raise ValueError(f"a gapped drafter needs a period of at least 2, got {period}")
        self.inner = inner
        self.__wrapped__ = inner  # the per-row state is the inner drafter's (`inspect.unwrap`)
        self.period = period
        self.name = f"{inner.name}+gaps{period}"

    def __getattr__(self, name: str) -> Any:  # block lengths, widths, uses_hidden, reset, commit, ...
        return getattr(self.inner, name)

    def propose(self, ctx: DraftContext) -> Proposal:
        proposal = self.inner.propose(ctx)
        counts = gap_counts(ctx.lengths, ctx.k, self.period)
        if proposal.counts is not None:
            counts = torch.minimum(counts, proposal.counts.to(counts.device))
        return Proposal(proposal.tokens, proposal.probs, proposal.vocab_map, counts)


def gap_counts(lengths: torch.Tensor, k: int, period: int) -> torch.Tensor:
    """[B] drafts proposed at committed `lengths` [B]: 0 at ≡ 0 (mod period), k // 2 at ≡ 1, else k."""
    phase = lengths % period
    half = torch.full_like(lengths, k // 2)
    return torch.where(phase == 0, 0, torch.where(phase == 1, half, k))
