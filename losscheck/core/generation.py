"""What one `Engine.generate` call returns: the generated ids and the loop's counters."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch

from losscheck import acceptance
from losscheck.core.precision import synchronize
from losscheck.core.sampling import SamplingParams


@dataclass
class LoopStats:
    """Acceptance and timing counters of the speculative loop (active rows only); per-position
    terms as `losscheck.acceptance` defines them."""

    k: int
    proposed: torch.Tensor  # [k] long, rounds that proposed a draft at slot j
    accepted: torch.Tensor  # [k] long, rounds whose draft j was accepted (and every draft before it)
    reached: torch.Tensor  # [k] long, rounds that proposed slot j with every draft before it accepted
    row_rounds: int = 0  # (row, round) pairs verified
    zero_drafts: int = 0  # of them, rounds whose row proposed no draft (`Proposal.counts` 0)
    emitted: int = 0  # tokens emitted by verification, before EOS / budget truncation
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0

    @classmethod
    def empty(cls, k: int) -> LoopStats:
        def zeros() -> torch.Tensor:
            return torch.zeros(k, dtype=torch.long)

        return cls(k, proposed=zeros(), accepted=zeros(), reached=zeros())

    def record_round(
        self, accepted: torch.Tensor, active: torch.Tensor, k: int, counts: torch.Tensor | None = None
    ) -> None:
        """One verified round of `k` drafts: accepted [B] drafts kept, active [B] rows that took
        part, counts [B] drafts each row proposed (None: k each)."""
        slot = torch.arange(k, device=accepted.device)[None, :]  # [1, k]
        proposed = active[:, None] if counts is None else active[:, None] & (slot < counts[:, None])  # [B, k]
        per_slot = ((slot < accepted[:, None]) & active[:, None]).sum(0)  # [k] accepted at slot j
        reached = ((slot <= accepted[:, None]) & proposed).sum(0)  # [k] slot j proposed, 0..j-1 accepted
        idle = active & (counts == 0) if counts is not None and k else torch.zeros_like(active)  # [B] no draft
        summed = torch.cat([active.sum()[None], idle.sum()[None], per_slot, reached, proposed.expand(-1, k).sum(0)])
        counted = summed.tolist()  # one host sync per round
        n_active, kept = counted[0], counted[2 : k + 2]
        self.row_rounds += n_active
        self.zero_drafts += counted[1]
        self.emitted += n_active + sum(kept)  # each active row: its accepted drafts + 1
        if k:
            self.proposed[:k] += torch.tensor(counted[2 * k + 2 :])
            self.accepted[:k] += torch.tensor(kept)
            self.reached[:k] += torch.tensor(counted[k + 2 : 2 * k + 2])

    @contextmanager
    def clock(self, part: Literal["draft", "target"], device: torch.device) -> Iterator[None]:
        """Add the wall time of the block to `draft_seconds` or `target_seconds`, including the
        kernels it queued on `device` (synchronised before both clock reads)."""
        synchronize(device)
        started = time.perf_counter()
        yield
        synchronize(device)
        elapsed = time.perf_counter() - started
        if part == "draft":
            self.draft_seconds += elapsed
        else:
            self.target_seconds += elapsed

    def __add__(self, other: LoopStats) -> LoopStats:
        """Counters of two runs of the same block length, summed."""
        if other.k != self.k:
            raise ValueError(f"cannot add LoopStats of block lengths {self.k} and {other.k}")
        return LoopStats(
            self.k,
            self.proposed + other.proposed,
            self.accepted + other.accepted,
            self.reached + other.reached,
            self.row_rounds + other.row_rounds,
            self.zero_drafts + other.zero_drafts,
            self.emitted + other.emitted,
            self.draft_seconds + other.draft_seconds,
            self.target_seconds + other.target_seconds,
            self.total_seconds + other.total_seconds,
        )

    @property
    def acceptance_length(self) -> float:
        """τ: tokens emitted per round (accepted + recovered/bonus)."""
        return self.emitted / max(self.row_rounds, 1)

    @property
    def wasted_fraction(self) -> float:
        """Drafted tokens discarded after the first rejection, over all drafted tokens."""
        proposed = int(self.proposed.sum())
        return (proposed - int(self.accepted.sum())) / max(proposed, 1)

    @property
    def all_accepted(self) -> bool:
        return bool(torch.equal(self.proposed, self.accepted))

    def cumulative_acceptance(self) -> list[float]:
        """[k] P(drafts 1..j all accepted) per slot; NaN for a slot never proposed."""
        return _nan_for_none(acceptance.cumulative(self.accepted.tolist(), self.proposed.tolist()))

    def conditional_acceptance(self) -> list[float]:
        """[k] P(draft j accepted | drafts 1..j-1 accepted) per slot; NaN for a slot never reached."""
        return _nan_for_none(acceptance.conditional(self.accepted.tolist(), self.reached.tolist()))

    def slot_acceptance(self) -> list[float]:
        """Deprecated: the cumulative rate, always, though it was documented as the conditional one."""
        import warnings

        warnings.warn(
            "LoopStats.slot_acceptance() is the cumulative rate P(drafts 1..j all accepted): call "
            "cumulative_acceptance(), or conditional_acceptance() for P(draft j accepted | drafts 1..j-1 accepted)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.cumulative_acceptance()

    def to_dict(self) -> dict[str, object]:
        return {
            "k": self.k,
            "acceptance_length": self.acceptance_length,
            "slot_acceptance": self.cumulative_acceptance(),
            "conditional_acceptance": self.conditional_acceptance(),
            "proposed": self.proposed.tolist(),
            "accepted": self.accepted.tolist(),
            "reached": self.reached.tolist(),
            "wasted_fraction": self.wasted_fraction,
            "row_rounds": self.row_rounds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "total_seconds": self.total_seconds,
            "draft_time_fraction": self.draft_seconds / max(self.total_seconds, 1e-12),
        }


# Entries of each drafted q the loop keeps per emitted token: all of them at the bundled
# fixtures' vocabularies, the top ones of a large vocabulary. Any q fixed before the token is drawn
# orders the conditional tests validly (`losscheck.stats.conditional`); the top entries carry
# nearly all of their power.
DRAFT_Q_ENTRIES = 64


@dataclass(frozen=True)
class DraftQ:
    """The distribution q the drafter *reported* for the slot that emitted each token, kept
    sparse: ids [B, L, M] long and probs [B, L, M] float (its M largest entries; all zero for a
    bonus token, which no draft stands behind)."""

    ids: torch.Tensor
    probs: torch.Tensor

    def dense(self, vocab: int, rows: slice = slice(None)) -> torch.Tensor:
        """q [b, L, V] float64 of `rows`, zero outside the kept entries."""
        ids, probs = self.ids[rows], self.probs[rows]
        return torch.zeros(*ids.shape[:2], vocab, dtype=torch.float64, device=ids.device).scatter_add_(
            -1, ids, probs.double()
        )

    def law(self, vocab: int, rows: slice = slice(None)) -> torch.Tensor:
        """q [b, L, V] float64 of `rows` as a distribution: the kept entries renormalised (q itself
        where every entry with mass is kept: V <= M), zeros where no draft. A wide q of a large
        vocabulary keeps under all its mass in M entries; what reads q as a law (the bug classes'
        laws, the order of the conditional tests) then reads this truncation of it."""
        q = self.dense(vocab, rows)
        total = q.sum(-1, keepdim=True)  # [b, L, 1]
        return torch.where(total > 0, q / total.clamp_min(1e-300), q)

    def cpu(self) -> DraftQ:
        return DraftQ(self.ids.cpu(), self.probs.cpu())

    @staticmethod
    def concat(parts: list[DraftQ]) -> DraftQ:
        return DraftQ(torch.cat([d.ids for d in parts]), torch.cat([d.probs for d in parts]))


@dataclass
class Generation:
    """Generated ids for a batch. tokens [B, max_new] (0-padded after lengths[b]), lengths [B]."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    stats: LoopStats
    params: SamplingParams = field(default_factory=SamplingParams)
    slots: torch.Tensor | None = None  # [B, max_new] long, each token's slot in its round (engine runs)
    draft_q: DraftQ | None = None  # each token's reported q (sampled engine runs with a drafter)
    # [B, max_new] float, each token's reported log-probability under the target's processed law
    # (`losscheck.core.logprobs`; sampled runs of an engine that reports them)
    logprobs: torch.Tensor | None = None
    # [B, max_new, N] long and float: the N most probable ids an engine reported at each position and
    # their log-probabilities (`losscheck.engines.ReportsTopLogprobs`; black-box cells that ask)
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.lengths[b])].tolist()

    def mask(self) -> torch.Tensor:
        """[B, max_new] bool, True where a token was generated."""
        return torch.arange(self.tokens.shape[1], device=self.tokens.device)[None, :] < self.lengths[:, None]

    @staticmethod
    def concat(parts: list[Generation]) -> Generation:
        """Several batches of the same request, one after another."""
        stats = parts[0].stats
        for part in parts[1:]:
            stats = stats + part.stats
        known = [g.slots for g in parts if g.slots is not None]
        slots = torch.cat(known) if len(known) == len(parts) else None
        drafted = [g.draft_q for g in parts if g.draft_q is not None]
        draft_q = DraftQ.concat(drafted) if len(drafted) == len(parts) else None
        reported = [g.logprobs for g in parts if g.logprobs is not None]
        return Generation(
            torch.cat([g.tokens for g in parts]),
            torch.cat([g.lengths for g in parts]),
            stats,
            parts[0].params,
            slots,
            draft_q,
            torch.cat(reported) if len(reported) == len(parts) else None,
        )


def _nan_for_none(rates: tuple[float | None, ...]) -> list[float]:
    return [float("nan") if r is None else r for r in rates]
