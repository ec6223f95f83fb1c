"""An engine's own speculative-decoding counters, as the certificate records them.

The numbers the engines export: vLLM's `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
`spec_decode_num_accepted_tokens` and `spec_decode_num_accepted_tokens_per_pos`; SGLang's accept
length; llama.cpp's and OpenVINO GenAI's draft and accept counts. Terms:

drafts                 drafting rounds: one proposal and one verification of one request.
drafted                drafted tokens over those rounds.
accepted               drafted tokens kept by verification.
accepted_per_position  [k]: rounds whose draft j was accepted. Verification stops at the first
                       rejection, so draft j counts only when drafts 0..j-1 were accepted too:
                       position j / drafts is the *cumulative* rate (at least j + 1 drafts
                       accepted), position j / position j-1 the *conditional* one.
emitted                tokens those rounds emitted (accepted + one recovered or bonus token each),
                       where the engine counts tokens rather than accepted drafts.

Imports nothing heavy: the certificate's records read it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from losscheck import acceptance
from losscheck.jsonrecord import JsonRecord


@dataclass(frozen=True)
class EngineCounters(JsonRecord):
    """Counters summed over the speculative calls they cover; None where the engine keeps no such count."""

    OMIT_NONE: ClassVar[bool] = True

    drafts: int
    drafted: int | None = None
    accepted: int | None = None
    accepted_per_position: tuple[int, ...] | None = None
    emitted: int | None = None

    def problems(self) -> list[str]:
        """What makes these counters inconsistent (negative, more accepted than drafted, a
        per-position count that grows with the position or does not add up to `accepted`)."""
        found = [f"{name} = {value} < 0" for name, value in self._counts() if value < 0]
        if self.drafted is not None and self.accepted is not None and self.accepted > self.drafted:
            found.append(f"accepted {self.accepted} > drafted {self.drafted}")
        per = self.accepted_per_position
        if per is not None:
            if any(later > earlier for earlier, later in zip((self.drafts, *per), per)):
                found.append(f"accepted_per_position {list(per)} grows with the position (or exceeds drafts)")
            if self.accepted is not None and sum(per) != self.accepted:
                found.append(f"accepted_per_position sums to {sum(per)}, accepted is {self.accepted}")
        return found

    def _counts(self) -> list[tuple[str, int]]:
        named = [("drafts", self.drafts), ("drafted", self.drafted), ("accepted", self.accepted)]
        named += [("emitted", self.emitted)]
        named += [(f"accepted_per_position[{j}]", n) for j, n in enumerate(self.accepted_per_position or ())]
        return [(name, value) for name, value in named if value is not None]

    def plus(self, other: EngineCounters) -> EngineCounters:
        """The counts of both sets of calls; a count either side lacks is None."""
        return self._combine(other, 1)

    def since(self, before: EngineCounters) -> EngineCounters:
        """The counts of the calls made after `before` was read (the engine's counters only grow)."""
        return self._combine(before, -1)

    def _combine(self, other: EngineCounters, sign: int) -> EngineCounters:
        def add(mine: int | None, theirs: int | None) -> int | None:
            return None if mine is None or theirs is None else mine + sign * theirs

        per = None
        if self.accepted_per_position is not None and other.accepted_per_position is not None:
            width = max(len(self.accepted_per_position), len(other.accepted_per_position))
            mine, theirs = (
                t + (0,) * (width - len(t)) for t in (self.accepted_per_position, other.accepted_per_position)
            )
            per = tuple(a + sign * b for a, b in zip(mine, theirs))
        return EngineCounters(
            drafts=self.drafts + sign * other.drafts,
            drafted=add(self.drafted, other.drafted),
            accepted=add(self.accepted, other.accepted),
            accepted_per_position=per,
            emitted=add(self.emitted, other.emitted),
        )

    @property
    def tau(self) -> float | None:
        """Tokens emitted per round: emitted / drafts where counted, else 1 + accepted / drafts."""
        if not self.drafts:
            return None
        if self.emitted is not None:
            return self.emitted / self.drafts
        return None if self.accepted is None else 1 + self.accepted / self.drafts

    def cumulative_acceptance(self) -> tuple[float | None, ...]:
        """[k] `acceptance.CUMULATIVE` per round: position j / drafts (every round counted as
        proposing all k drafts, as the engines' per-position counters assume)."""
        if not self.drafts or self.accepted_per_position is None:
            return ()
        per = self.accepted_per_position
        return acceptance.cumulative(per, (self.drafts,) * len(per))

    def conditional_acceptance(self) -> tuple[float | None, ...]:
        """[k] `acceptance.CONDITIONAL`: position j / position j-1 (drafts for j = 1); None where
        no round reached the position."""
        if self.accepted_per_position is None:
            return ()
        per = self.accepted_per_position
        return acceptance.conditional(per, acceptance.reached_at_fixed_k(per, self.drafts))
