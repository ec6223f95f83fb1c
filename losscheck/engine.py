"""The batched speculative loop: prefill, propose, score `k+1` positions in one target pass,
verify, commit, roll back per row. The baseline is the same loop with no drafter (`k = 0`), so
plain decoding goes through exactly the same sampling code.

Invariants, per row b: `lengths[b]` committed tokens (prompt + emitted); the target's cache holds
the first `lengths[b] - 1` of them (the last committed token is *pending*: it is the first input
of the next scoring pass). A round scores `[pending, d_1 .. d_k]` at slots `lengths-1 ..
lengths-1+k`; after `a` accepted drafts the row commits `a + 1` tokens, which leaves exactly the
pending token and the accepted drafts in the cache and everything after them stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from losscheck.contract import DraftContext, Drafter, Proposal, Target, validate_proposal
from losscheck.errors import LosscheckError
from losscheck.sampling import SamplingParams, process_logits
from losscheck.verify import Verdict, verify_greedy, verify_rejection


@dataclass
class LoopStats:
    """Acceptance and timing counters of one `generate` call (active rows only)."""

    k: int
    proposed: torch.Tensor  # [k] drafts proposed in slot j
    accepted: torch.Tensor  # [k] drafts accepted in slot j
    row_rounds: int = 0  # (row, round) pairs verified
    emitted: int = 0  # tokens emitted by verification, before EOS / budget truncation
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """τ: tokens emitted per round (accepted + recovered/bonus)."""
        return self.emitted / max(self.row_rounds, 1)

    @property
    def wasted_fraction(self) -> float:
        """Drafted tokens discarded after the first rejection, over all drafted tokens."""
        proposed = int(self.proposed.sum())
        return (proposed - int(self.accepted.sum())) / max(proposed, 1)

    def slot_acceptance(self) -> list[float]:
        """P(draft j accepted | drafts before it accepted), per slot."""
        return [a / p if p else float("nan") for a, p in zip(self.accepted.tolist(), self.proposed.tolist())]

    def to_dict(self) -> dict[str, object]:
        return {
            "k": self.k,
            "acceptance_length": self.acceptance_length,
            "slot_acceptance": self.slot_acceptance(),
            "proposed": self.proposed.tolist(),
            "accepted": self.accepted.tolist(),
            "wasted_fraction": self.wasted_fraction,
            "row_rounds": self.row_rounds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "total_seconds": self.total_seconds,
            "draft_time_fraction": self.draft_seconds / max(self.total_seconds, 1e-12),
        }


@dataclass
class Generation:
    """Generated ids for a batch. tokens [B, max_new] (0-padded after lengths[b]), lengths [B]."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    stats: LoopStats
    params: SamplingParams = field(default_factory=SamplingParams)

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.lengths[b])].tolist()

    def mask(self) -> torch.Tensor:
        """[B, max_new] bool, True where a token was generated."""
        return torch.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


def pad_prompts(prompts: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad prompts → ids [B, P] and lengths [B], validating them."""
    if not prompts:
        raise LosscheckError("no prompts given; pass at least one non-empty list of token ids")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise LosscheckError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise LosscheckError(f"prompt {i} has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = torch.tensor(prompt)
    return ids, lengths


class Engine:
    """Speculative decoding of a batch with `drafter` and block length `k`; `drafter=None` is the
    baseline. `width` is passed to drafters that truncate candidates.

    Subclasses (the mutant catalogue) override the small steps `verify`, `cache_start` and
    `positions`; the loop itself stays in `generate`.
    """

    def __init__(
        self, target: Target, drafter: Drafter | None = None, k: int = 4, width: int | None = None
    ) -> None:
        if drafter is not None and k < 1:
            raise LosscheckError(f"block length k must be >= 1 with a drafter, got {k}")
        self.target = target
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        self.width = width

    # --- the steps a mutant may replace -------------------------------------------------------
    def verify(
        self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams, gen: torch.Generator
    ) -> Verdict:
        """logits [B, k+1, V] raw target logits; the proposal's drafts [B, k]."""
        if params.greedy:
            return verify_greedy(logits, proposal.tokens)
        return verify_rejection(process_logits(logits, params), proposal.tokens, proposal.probs, gen)

    def cache_start(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B] first cache slot to write this round: the pending token's slot."""
        return lengths - 1

    def positions(self, start: torch.Tensor, width: int) -> torch.Tensor | None:
        """[B, width] rotary positions of the scored tokens; None = the slots themselves."""
        return None

    # --- the loop ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Generation:
        target, drafter = self.target, self.drafter
        if max_new_tokens < 0:
            raise LosscheckError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        prompt_ids, lengths = pad_prompts(prompts, target.vocab_size)
        batch, longest = prompt_ids.shape
        if longest + max_new_tokens > target.max_positions:
            raise LosscheckError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                f"target's {target.max_positions} positions; shorten the prompt or the budget"
            )
        capacity = longest + max_new_tokens + self.k + 1
        tokens = torch.zeros(batch, capacity, dtype=torch.long)
        tokens[:, :longest] = prompt_ids
        prompt_lengths = lengths.clone()
        hidden = None
        if drafter is not None and drafter.uses_hidden:
            hidden = torch.zeros(batch, capacity, target.hidden_size)

        stats = LoopStats(self.k, torch.zeros(self.k, dtype=torch.long), torch.zeros(self.k, dtype=torch.long))
        started = time.perf_counter()
        target.reset(batch, capacity)
        if drafter is not None:
            drafter.reset(batch, capacity)
        if longest > 1:  # prefill every prompt token but the pending last one
            t0 = time.perf_counter()
            _, states = target.forward(prompt_ids[:, :-1], torch.zeros(batch, dtype=torch.long))
            stats.target_seconds += time.perf_counter() - t0
            if hidden is not None:
                hidden[:, : longest - 1] = states.float()

        done = torch.full((batch,), max_new_tokens == 0)
        while not bool(done.all()):
            # Never score past the target's last position (context near the maximum).
            k = min(self.k, target.max_positions - int(lengths[~done].max()))
            proposal = Proposal(torch.zeros(batch, 0, dtype=torch.long))
            if k > 0 and drafter is not None:
                t0 = time.perf_counter()
                ctx = DraftContext(tokens, lengths, hidden, k, self.width, params, generator)
                proposal = validate_proposal(drafter.propose(ctx), drafter.name, batch, k, target.vocab_size)
                stats.draft_seconds += time.perf_counter() - t0
            k = proposal.tokens.shape[1]

            t0 = time.perf_counter()
            start = self.cache_start(lengths)
            pending = tokens.gather(1, (lengths - 1)[:, None])  # [B, 1]
            scored = torch.cat([pending, proposal.tokens], dim=1)  # [B, k+1]
            logits, states = target.forward(scored, start, self.positions(start, k + 1))
            verdict = self.verify(logits, proposal, params, generator)
            stats.target_seconds += time.perf_counter() - t0

            active = ~done
            accepted = torch.where(active, verdict.accepted, 0)  # [B]
            emit = self._truncate(verdict.tokens, accepted + 1, lengths - prompt_lengths, max_new_tokens)
            emit = torch.where(active, emit, 0)
            write = lengths[:, None] + torch.arange(k + 1)  # [B, k+1]; junk past emit is overwritten later
            keep = torch.arange(k + 1)[None, :] < emit[:, None]
            tokens.scatter_(1, write, torch.where(keep, verdict.tokens, tokens.gather(1, write)))
            if hidden is not None:
                slots = (start[:, None] + torch.arange(k + 1))[..., None].expand(-1, -1, hidden.shape[2])
                hidden.scatter_(1, slots, states.float())
            lengths = lengths + emit
            if drafter is not None:
                drafter.commit(accepted)

            n_active = int(active.sum())
            stats.row_rounds += n_active
            stats.emitted += int((accepted + 1)[active].sum())
            if k:
                slot = torch.arange(k)[None, :]
                stats.proposed[:k] += n_active
                stats.accepted[:k] += ((slot < accepted[:, None]) & active[:, None]).sum(0)
            done = done | self._finished(tokens, lengths, prompt_lengths, emit, max_new_tokens)
        stats.total_seconds = time.perf_counter() - started

        new = lengths - prompt_lengths
        out = torch.zeros(batch, max_new_tokens, dtype=torch.long)
        gather = (prompt_lengths[:, None] + torch.arange(max_new_tokens)).clamp_max(capacity - 1)
        out = torch.where(torch.arange(max_new_tokens)[None, :] < new[:, None], tokens.gather(1, gather), out)
        return Generation(out, new, stats, params)

    def _truncate(
        self, emitted: torch.Tensor, count: torch.Tensor, generated: torch.Tensor, budget: int
    ) -> torch.Tensor:
        """[B] tokens to commit: `count`, cut after the first EOS and at the token budget."""
        count = torch.minimum(count, budget - generated)
        eos = self.target.eos_id
        if eos is not None:
            slot = torch.arange(emitted.shape[1])[None, :]
            is_eos = (emitted == eos) & (slot < count[:, None])
            first = torch.where(is_eos, slot, emitted.shape[1]).min(1).values
            count = torch.minimum(count, first + 1)
        return count

    def _finished(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        prompt_lengths: torch.Tensor,
        emit: torch.Tensor,
        budget: int,
    ) -> torch.Tensor:
        out_of_budget = lengths - prompt_lengths >= budget
        eos = self.target.eos_id
        if eos is None:
            return out_of_budget
        last = tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
        return out_of_budget | ((emit > 0) & (last == eos))
