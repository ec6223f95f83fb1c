"""The draft-gaps axis: the cell's drafter proposes fewer than k tokens, or none, at some
positions (`Gapped`), as an n-gram drafter without a match does, or an engine that skips
speculation for a request under load.

A row with no draft still goes through the round: the target scores its pending token alone
(and padding) and the row keeps one token. Engines that take another path for such a step have
shipped bugs there (a hybrid model's zero-draft step reading a stale state slot), and a verifier
that ignores the per-row counts keeps padding; both change greedy output, so the axis's greedy
cell catches them. The facts say how many row-rounds proposed nothing, so a PASS says whether the
path ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from losscheck.core.contract import DraftContext, Drafter, Proposal
from losscheck.core.generation import Generation
from losscheck.jsonrecord import Scalar
from losscheck.serving.axis import Axis, Call, Facts, ServeContext, Server, Wrapped

AXIS_NAME = "gaps"
PERIOD = 3  # a row proposes nothing at one committed length in three, half the block at another


class Gapped:
    """`inner`, proposing `gap_counts(ctx.lengths, k, period)` drafts per row."""

    def __init__(self, inner: Drafter, period: int = PERIOD) -> None:
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


class GappedServer(Wrapped):
    """The inner server, whose engine's drafter the axis gapped where the engine was built
    (`Axis.drafter`: in a split cell's ranks too), counting the row-rounds that drafted nothing."""

    def __init__(self, period: int, inner: Server, context: ServeContext) -> None:
        super().__init__(inner)
        self.period = period
        self.zero, self.rounds = 0, 0

    def generate(self, calls: Sequence[Call]) -> list[Generation]:
        out = self.inner.generate(calls)
        self.zero += sum(g.stats.zero_drafts for g in out)
        self.rounds += sum(g.stats.row_rounds for g in out)
        return out

    def facts(self) -> Facts:
        rounds = f"{self.zero:,} of {self.rounds:,} row-rounds drafted nothing"
        summary = f"draft gaps every {self.period} positions: {rounds}"
        facts: dict[str, Scalar] = {
            "period": self.period,
            "zero_draft_rounds": self.zero,
            "row_rounds": self.rounds,
            "summary": summary,
        }
        return {**self.inner.facts(), AXIS_NAME: facts}


AXIS = Axis(
    name=AXIS_NAME,
    off=0,
    values=(PERIOD,),
    suffix=lambda period: f"gaps{period}",
    serve=GappedServer,
    order=4,  # outermost: it counts what the servers inside it ran
    doc="draft gaps: rows propose no draft at one position in three and half a block at another (n-gram misses)",
    pairs=({"prefix": "warm"}, {"batching": "continuous"}),
    drafter=lambda period, drafter: Gapped(drafter, period),
)
