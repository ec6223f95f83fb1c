"""The draft-gaps axis: the cell's drafter proposes fewer than k tokens, or none, at some
positions (`losscheck.drafters.gapped`), as an n-gram drafter without a match does.

A row with no draft still goes through the round: the target scores its pending token alone
(and padding) and the row keeps one token. Engines that take another path for such a step have
shipped bugs there (a hybrid model's zero-draft step reading a stale state slot), and a verifier
that ignores the per-row counts keeps padding; both change greedy output, so the axis's greedy
cell catches them. The facts say how many row-rounds proposed nothing, so a PASS says whether the
path ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from losscheck.core.generation import Generation
from losscheck.drafters.gapped import Gapped
from losscheck.jsonrecord import Scalar
from losscheck.serving.axis import Axis, Call, Facts, ServeContext, Server, Wrapped

AXIS_NAME = "gaps"
PERIOD = 3  # a row proposes nothing at one committed length in three, half the block at another


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
        facts: dict[str, Scalar] = {"period": self.period, "zero_draft_rounds": self.zero, "row_rounds": self.rounds, "summary": summary}
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
