"""The batched speculative loop: draft, score `k+1` positions in one target pass, verify, commit
(rolling each row back to what it accepted). The baseline is the same loop with no drafter
(`k = 0`), so plain decoding goes through exactly the same sampling code.

Invariants, per row b: `lengths[b]` committed tokens (prompt + emitted); the target's cache holds
the first `lengths[b] - 1` of them (the last committed token is *pending*: it is the first input
of the next scoring pass). A round scores `[pending, d_1 .. d_k]` at slots `lengths-1 ..
lengths-1+k`; after `a` accepted drafts the row commits `a + 1` tokens, which leaves exactly the
pending token and the accepted drafts in the cache and everything after them stale.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from losscheck.core.contract import (
    DraftContext,
    Drafter,
    Proposal,
    StatefulTarget,
    Target,
    expect_rows,
    hidden_layers,
    validate_proposal,
)
from losscheck.core.generation import DRAFT_Q_ENTRIES, DraftQ, Generation, LoopStats
from losscheck.core.history import History, HistoryStep, adjust_logits
from losscheck.core.logprobs import LogprobRule, emitted_logprobs
from losscheck.core.ragged import RaggedKVCache, RaggedLM, forward_rows, ragged_cache
from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.core.stops import StopRule, first_stop
from losscheck.core.verify import BlockOutcome, Verifier, capped, checked_outcome, verify_block
from losscheck.errors import LosscheckError

W = TypeVar("W", bound=Verifier)  # a verifier that wraps the engine's (`Engine.verifier_wrapped`)


class KVReuse(Protocol):
    """Keys and values shared across requests (a prefix cache, `losscheck.serving.prefix_cache`).

    The engine asks it, before prefilling rows, how much of each row it can copy into the
    target's cache (`load`), and hands it every row's verified slots after prefill and after
    every commit (`store`); `valid [B]` is `lengths - 1`, the slots the target's cache holds.
    """

    block: int  # tokens per stored block

    def reset(self, rows: int) -> None: ...

    def load(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        readable: torch.Tensor,
        rows: list[int],
        hidden: torch.Tensor | None,
    ) -> torch.Tensor:
        """Copy stored prefixes of `rows` into `cache` → tokens matched per row [len(rows)]."""
        ...

    def store(
        self,
        cache: RaggedKVCache,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        rows: list[int],
        hidden: torch.Tensor | None,
    ) -> None: ...


def pad_prompts(
    prompts: list[list[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad prompts → ids [B, P] and lengths [B] on `device`, validating them."""
    if not prompts:
        raise LosscheckError("no prompts given; pass at least one non-empty list of token ids")
    lengths = torch.tensor([len(p) for p in prompts])
    if not bool(lengths.all()):
        i = int((lengths == 0).nonzero()[0])
        raise LosscheckError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
    flat = torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.long)  # every prompt's ids, in order
    outside = (flat < 0) | (flat >= vocab_size)
    if bool(outside.any()):
        i = int(torch.searchsorted(lengths.cumsum(0), outside.nonzero()[0], right=True))
        bad = [t for t in prompts[i] if not 0 <= int(t) < vocab_size]
        raise LosscheckError(f"prompt {i} has ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    ids[torch.arange(int(lengths.max()))[None, :] < lengths[:, None]] = flat  # row-major, as `flat`
    return ids.to(device), lengths.to(device)


@dataclass
class Batch:
    """The rows of one `generate` call while it runs."""

    tokens: torch.Tensor  # [B, capacity] long, committed ids (prompt + emitted), right-padded
    lengths: torch.Tensor  # [B] long, committed tokens per row
    prompt_lengths: torch.Tensor  # [B] long
    hidden: torch.Tensor | None  # [B, capacity, H] target states for drafters that read them
    done: torch.Tensor  # [B] bool, rows past EOS or their budget
    budget: int | torch.Tensor  # max_new_tokens; or [B] long per row (a scheduler's, `Engine.step`)
    # [B, capacity] long, each committed token's slot in the round that emitted it (0 = the round's
    # first token; a round of a accepted drafts emits slots 0..a); None: not kept
    slot_of: torch.Tensor | None = None
    # [B, capacity, M] each committed token's reported q (`DraftQ`: ids and probs); None: not
    # kept (greedy requests, the baseline)
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    # [B, capacity] float, each committed token's reported log-probability (`losscheck.core.logprobs`);
    # None: not kept (greedy requests)
    logprob_of: torch.Tensor | None = None

    def _width(self) -> int:
        """Generated slots an output holds: the budget (the largest, with per-row budgets)."""
        return self.budget if isinstance(self.budget, int) else int(self.budget.max())

    def pending(self) -> torch.Tensor:
        """[B, 1] the last committed token of each row, not yet read by the target."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(generated ids [B, budget], 0 after each row's end; generated counts [B])."""
        return self._generated(self.tokens), self.lengths - self.prompt_lengths

    def output_slots(self) -> torch.Tensor | None:
        """[B, budget] each generated token's slot in its round (0 after the row's end), like `output`."""
        return None if self.slot_of is None else self._generated(self.slot_of)

    def output_logprobs(self) -> torch.Tensor | None:
        """[B, budget] each generated token's reported log-probability (0 after the row's end)."""
        return None if self.logprob_of is None else self._generated(self.logprob_of)

    def output_q(self) -> DraftQ | None:
        """Each generated token's reported q [B, budget, M], like `output` (zero after the row's end)."""
        if self.q_ids is None or self.q_probs is None:
            return None
        return DraftQ(self._generated(self.q_ids), self._generated(self.q_probs))

    def _generated(self, buffer: torch.Tensor) -> torch.Tensor:
        """`buffer` [B, capacity, ...] at each row's generated slots [B, budget, ...], zero after its end."""
        new = self.lengths - self.prompt_lengths
        slot = torch.arange(self._width(), device=self.tokens.device)[None, :]  # [1, budget]
        at = (self.prompt_lengths[:, None] + slot).clamp_max(self.tokens.shape[1] - 1)  # [B, budget]
        keep = slot < new[:, None]  # [B, budget]
        for _ in buffer.shape[2:]:
            at, keep = at[..., None], keep[..., None]
        return torch.where(keep, buffer.gather(1, at.expand(-1, -1, *buffer.shape[2:])), 0)


def reported_q(proposal: Proposal, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q each slot of a round's output stands on, sparse: (ids [B, k+1, M], probs [B, k+1, M])
    with the `entries` (M) largest of each draft's reported q (all of them, in id order, when
    M >= V), a point mass for a deterministic drafter, and zeros at the bonus slot k."""
    tokens = proposal.tokens  # [B, k]
    rows, k = tokens.shape
    if proposal.probs is None:
        ids, probs = tokens[..., None], torch.ones(rows, k, 1, device=tokens.device)  # [B, k, 1]
    elif entries >= proposal.probs.shape[-1]:  # every entry: no need to rank them
        vocab = proposal.probs.shape[-1]
        ids, probs = torch.arange(vocab, device=tokens.device).expand(rows, k, vocab), proposal.probs.float()
    else:
        probs, ids = proposal.probs.float().topk(entries, dim=-1)  # [B, k, M]
    if proposal.counts is not None:  # a row's slots from its `counts` on hold its bonus: no q
        proposed = torch.arange(k, device=tokens.device)[None, :] < proposal.counts[:, None]  # [B, k]
        probs = probs * proposed[..., None]
    pad = (0, entries - ids.shape[-1], 0, 1)  # zero entries up to M, and the bonus slot
    return torch.nn.functional.pad(ids, pad), torch.nn.functional.pad(probs, pad)


def parked(batch: Batch, k: int, max_positions: int) -> torch.Tensor:
    """[B] the lengths a round drafts and scores rows at: a finished row moved back so that its
    k + 1 junk slots stay inside the target's positions (`k` fits the longest *active* row only;
    a finished row's drafts are discarded and its cache never read again)."""
    return torch.where(batch.done, batch.lengths.clamp(max=max_positions - k).clamp(min=1), batch.lengths)


def emit_counts(
    emitted: torch.Tensor, count: torch.Tensor, room: torch.Tensor, eos: int | None, stop_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B] tokens a row commits, [B] bool whether they end with EOS or a stop id, None with
    neither): `count` (accepted + 1), at most `room` (budget left), and none after the first EOS
    or stop id among them. emitted [B, k+1] the verified tokens."""
    count = torch.minimum(count, room)
    ends = ([eos] if eos is not None else []) + list(stop_ids)
    if not ends:
        return count, None
    width = emitted.shape[1]
    slot = torch.arange(width, device=emitted.device)[None, :]  # [1, k+1]
    is_end = torch.isin(emitted, torch.tensor(ends, device=emitted.device))  # [B, k+1]
    first_eos = torch.where(is_end & (slot < count[:, None]), slot, width).amin(1)  # [B]; width: none
    ended = first_eos < width
    return torch.where(ended, first_eos + 1, count), ended


# Where a round's rows end (`emit_counts`): (emitted [B, k+1], count [B], room [B], eos, stop ids)
# -> (tokens each row commits [B], whether they end the row [B] or None)
EndRule = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "int | None", tuple[int, ...]],
    tuple[torch.Tensor, "torch.Tensor | None"],
]


class Engine:
    """Speculative decoding of a batch with `drafter` and block length `k`; `drafter=None` is the
    baseline. `width` is passed to drafters that truncate candidates. `verifier` decides each
    block: by default the drafter's own `verifier` when it declares one (a checkpoint configured
    with a relaxed acceptance rule is run as configured), else `losscheck.core.verify.verify_block`,
    the correct one; a caller may plant another.
    """

    round_slots = True  # each committed token's slot in its round is kept (`Batch.slot_of`)

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        k: int = 4,
        width: int | None = None,
        verifier: Verifier | None = None,
        prefix_cache: KVReuse | None = None,
        history: HistoryStep | None = None,
        ends: EndRule | None = None,
        logprobs: LogprobRule | None = None,
        stop_rule: StopRule | None = None,
    ) -> None:
        if drafter is not None and k < 1:
            raise LosscheckError(f"block length k must be >= 1 with a drafter, got {k}")
        self.target = target
        self.drafter = drafter
        self.k = k if drafter is not None else 0
        self.width = width
        self.verifier: Verifier = verifier or getattr(drafter, "verifier", None) or verify_block
        self.prefix_cache = prefix_cache  # shared by every request this engine runs
        self.history: HistoryStep = history or adjust_logits  # a planted bug may replace it
        self.ends: EndRule = ends or emit_counts  # likewise
        self.logprobs: LogprobRule = logprobs or emitted_logprobs  # likewise
        self.stop_rule: StopRule = stop_rule or first_stop  # likewise
        # the target layers whose states the drafter reads; only named layers are asked for by
        # id, so a Target without `layers=` still serves drafters of the last layer
        self.layers = hidden_layers(drafter, target) if drafter is not None else None
        self._by_id = drafter is not None and not isinstance(drafter.uses_hidden, bool)
        # a target with recurrent layers is told what each row kept after every forward
        self._keep = target.keep if isinstance(target, StatefulTarget) and target.stateful else None

    @contextmanager
    def verifier_wrapped(self, wrap: Callable[[Verifier], W]) -> Iterator[W]:
        """Blocks decided by `wrap(verifier)` inside the `with` — a recorder that watches the
        engine's verifier (`losscheck.cells.conformance.Recorder`) — and by the verifier alone
        again after it."""
        own = self.verifier
        self.verifier = wrapped = wrap(own)
        try:
            yield wrapped
        finally:
            self.verifier = own

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> Generation:
        """Up to `max_new_tokens` tokens for every prompt, stopping a row at EOS."""
        started = time.perf_counter()
        batch = self._start(prompts, max_new_tokens, params)
        stats = LoopStats.empty(self.k)
        with stats.clock("target", self.target.device):
            self.prefill(batch)
        while not bool(batch.done.all()):
            self.step(batch, params, generator, stats)
        stats.total_seconds = time.perf_counter() - started
        tokens, lengths = batch.output()
        return Generation(
            tokens,
            lengths,
            stats,
            params,
            slots=batch.output_slots(),
            draft_q=batch.output_q(),
            logprobs=batch.output_logprobs(),
        )

    def step(self, batch: Batch, params: SamplingParams, generator: torch.Generator, stats: LoopStats) -> None:
        """One round over the rows of `batch` not done: draft, score, verify, commit.

        `generate` loops over it; it is public so that a scheduler can run the rounds itself and
        admit new requests into finished rows between them (`losscheck.serving.batching`, which also
        sets `batch.budget` to per-row budgets [B]). Needs at least one row not done.
        """
        device = self.target.device
        k = self._block(batch)
        at = parked(batch, k, self.target.max_positions)  # [B] where each row drafts and is scored
        with stats.clock("draft", device):
            proposal = self._draft(batch, at, k, params, generator)
        with stats.clock("target", device):
            logits, states = self._score(batch, at, proposal)
            seen = History(batch.tokens, at, batch.prompt_lengths, self.target.eos_id)
            logits = self.history(logits, params, seen, proposal.tokens)  # [B, k+1, V]
            outcome = self.verifier(logits, proposal.tokens, proposal.probs, params, generator)
            outcome = checked_outcome(outcome, self.verifier, *proposal.tokens.shape)
            if proposal.counts is not None:  # rows that proposed fewer than k: a shorter block each
                outcome = capped(outcome, proposal.counts, logits, params, generator)
            reported = None  # [B, k+1] each verified token's log-probability, kept for sampled requests
            if batch.logprob_of is not None:
                reported = self.logprobs(process_logits(logits, params), outcome.tokens, proposal.probs)
        self._commit(batch, outcome, states, stats, proposal, params, reported)

    def q_buffers(self, rows: int, capacity: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Zeroed `Batch.q_ids`, `Batch.q_probs` [rows, capacity, M] for a sampled request with a
        drafter (the conditional tests order each token's vocabulary by p − q); None otherwise."""
        if self.drafter is None or params.greedy:
            return None
        entries = min(DRAFT_Q_ENTRIES, self.target.vocab_size)
        ids = torch.zeros(rows, capacity, entries, dtype=torch.long, device=self.target.device)
        return ids, torch.zeros(rows, capacity, entries, device=self.target.device)

    def _start(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams) -> Batch:
        """Validate the request, allocate the rows and reset the target's and drafter's state."""
        if max_new_tokens < 0:
            raise LosscheckError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        params.check_vocab(self.target.vocab_size, f"target {self.target.name!r}")
        device = self.target.device
        prompt_ids, lengths = pad_prompts(prompts, self.target.vocab_size, device)
        rows, longest = prompt_ids.shape
        if longest + max_new_tokens > self.target.max_positions:
            raise LosscheckError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                f"target's {self.target.max_positions} positions; shorten the prompt or the budget"
            )
        capacity = longest + max_new_tokens + self.k + 1
        if self.prefix_cache is not None:  # rows prefilled from a prefix hit write junk up to 2·longest
            capacity += longest
        tokens = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        tokens[:, :longest] = prompt_ids
        done = torch.full((rows,), max_new_tokens == 0, device=device)
        return self.new_batch(tokens, lengths, done, max_new_tokens, params)

    def new_batch(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        done: torch.Tensor,
        budget: int | torch.Tensor,
        params: SamplingParams,
    ) -> Batch:
        """A batch of the rows `tokens` [B, capacity] with `lengths` [B] committed (all of them
        prompt), `done` [B] and `budget`, with its hidden-state and q buffers, and the target's,
        drafter's and prefix cache's per-row state reset: the one way a batch starts (`generate`,
        and a scheduler's empty batch before its first admission)."""
        rows, capacity = tokens.shape
        hidden = None
        if self.drafter is not None and self.drafter.uses_hidden is not False:
            width = self.target.hidden_size * (len(self.layers) if self.layers else 1)
            hidden = torch.zeros(rows, capacity, width, device=tokens.device)
        self.target.reset(rows, capacity)
        if self.drafter is not None:
            self.drafter.reset(rows, capacity)
        if self.prefix_cache is not None:
            self.prefix_cache.reset(rows)
        q_ids, q_probs = self.q_buffers(rows, capacity, params) or (None, None)
        logprob_of = None if params.greedy else torch.zeros(rows, capacity, device=tokens.device)
        slot_of = torch.zeros_like(tokens) if self.round_slots else None
        return Batch(tokens, lengths, lengths.clone(), hidden, done, budget, slot_of, q_ids, q_probs, logprob_of)

    def prefill(self, batch: Batch, rows: torch.Tensor | None = None) -> None:
        """Read the committed tokens of `rows` [n] (default: every row) but the pending last one
        into the target's cache (and `batch.hidden`), from the prefix cache as far as it holds
        them. A scheduler admitting requests into finished rows calls it for those rows alone
        (`losscheck.serving.batching`); the other rows keep their state."""
        every = rows is None
        rows = torch.arange(len(batch.lengths), device=batch.lengths.device) if rows is None else rows
        readable = batch.lengths[rows] - 1  # [n]
        start = torch.zeros_like(readable)  # [n] first slot each row reads
        reuse = self.prefix_cache
        cache = ragged_cache(self.target) if reuse is not None else None
        if reuse is not None and cache is not None:
            start = reuse.load(cache, batch.tokens, batch.lengths - 1, rows.tolist(), batch.hidden)
        width = int((readable - start).max())
        if width > 0:
            at = start[:, None] + torch.arange(width, device=start.device)  # [n, width] slots read
            ids = batch.tokens[rows].gather(1, at)  # past a row's readable: junk, overwritten later
            if every:
                kept = readable - start  # [B]
                expect_rows(self.target, kept)  # a recurrent state: record only from the shortest row on
                _, states = self._forward(ids, start)
            elif _allocated(self.target):  # an HFTarget, or a proxy of one (the perf tier's timed target)
                layers = self.layers if self._by_id else None
                lm, checked = self.target.lm, self.target.checked  # type: ignore[attr-defined]  # see _allocated
                _, states = checked(forward_rows(lm, rows, ids, start, layers))
                kept = readable - start  # [n]
            else:  # one pass over every row: the others read junk from their pending slot on
                all_ids = batch.tokens.new_zeros(len(batch.lengths), width).index_copy(0, rows, ids)
                _, states = self._forward(all_ids, (batch.lengths - 1).index_copy(0, rows, start))
                states = states[rows]
                kept = torch.zeros_like(batch.lengths).index_copy(0, rows, readable - start)  # the others: 0
            if batch.hidden is not None:
                batch.hidden[rows[:, None], at] = states.float()
        if reuse is not None and cache is not None:  # before `keep`: a recurrent state's checkpoints
            reuse.store(cache, batch.tokens, batch.lengths - 1, rows.tolist(), batch.hidden)
        if width > 0 and self._keep is not None:
            self._keep(kept)

    def _block(self, batch: Batch) -> int:
        """The round's block length: `k`, fewer at the target's last positions, 0 without a drafter."""
        if self.drafter is None:
            return 0
        longest = int(torch.where(batch.done, 0, batch.lengths).amax())  # the longest active row
        return max(0, min(self.k, self.target.max_positions - longest))

    def _draft(
        self, batch: Batch, at: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        """The drafter's block of `k` for every row, drafted at lengths `at` [B]."""
        rows = batch.tokens.shape[0]
        if k == 0 or self.drafter is None:
            return Proposal(batch.tokens.new_zeros(rows, 0))
        ctx = DraftContext(
            batch.tokens, at, batch.hidden, k, self.width, params, generator, batch.prompt_lengths, self.target.eos_id
        )
        proposal = self.drafter.propose(ctx)
        return validate_proposal(proposal, self.drafter.name, rows, k, self.target.vocab_size, self.target.device)

    def _score(self, batch: Batch, at: torch.Tensor, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """One target pass over `[pending, d_1 .. d_k]` at lengths `at` [B] → logits [B, k+1, V],
        states [B, k+1, n·H]."""
        pending = at - 1  # [B] the slot of each row's last committed token
        scored = torch.cat([batch.tokens.gather(1, pending[:, None]), proposal.tokens], dim=1)  # [B, k+1]
        return self._forward(scored, pending)

    def _forward(self, tokens: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's pass, with the states of the drafter's layers when it names them."""
        if self._by_id:
            return self.target.forward(tokens, start, layers=self.layers)  # type: ignore[call-arg]
        return self.target.forward(tokens, start)

    def _commit(
        self,
        batch: Batch,
        outcome: BlockOutcome,
        states: torch.Tensor,
        stats: LoopStats,
        proposal: Proposal,
        params: SamplingParams,
        reported: torch.Tensor | None = None,
    ) -> None:
        """Append each active row's emitted tokens (up to its budget, EOS, a stop id or a stop
        string) and roll the drafter back to what was kept."""
        width = outcome.tokens.shape[1]  # k + 1
        active = ~batch.done
        accepted = torch.where(active, outcome.accepted, 0)  # [B]
        room = batch.budget - (batch.lengths - batch.prompt_lengths)  # [B] budget left
        emit, ended = self.ends(outcome.tokens, accepted + 1, room, self.target.eos_id, params.stop_ids)
        emit = torch.where(active, emit, 0)
        if params.stop_strings is not None:
            emit, ended = self._stop_strings(batch, outcome.tokens, emit, ended, params)
        slot = torch.arange(width, device=emit.device)[None, :]  # [1, k+1]
        # every slot of the round is written, the kept ones and junk past a row's emit (and a
        # finished row's): nothing reads a row past its length, and the next round overwrites it
        slots = batch.lengths[:, None] + slot  # [B, k+1]
        batch.tokens.scatter_(1, slots, outcome.tokens)
        if batch.slot_of is not None:
            batch.slot_of.scatter_(1, slots, slot.expand_as(slots))
        if batch.logprob_of is not None and reported is not None:
            batch.logprob_of.scatter_(1, slots, reported.to(batch.logprob_of.dtype))
        if batch.q_ids is not None and batch.q_probs is not None:
            ids, probs = reported_q(proposal, batch.q_ids.shape[2])  # [B, k+1, M]
            at = slots[..., None].expand_as(ids)
            batch.q_ids.scatter_(1, at, ids)
            batch.q_probs.scatter_(1, at, probs)
        if batch.hidden is not None:
            read = (slots - 1)[..., None].expand(-1, -1, batch.hidden.shape[2])  # the scored slots
            batch.hidden.scatter_(1, read, states.float())
        batch.lengths = batch.lengths + emit  # a new tensor: drafters may hold the old one
        if self.prefix_cache is not None:  # blocks completed by this round's tokens, before `keep`
            rows = active.nonzero().squeeze(1).tolist()
            self.prefix_cache.store(ragged_cache(self.target), batch.tokens, batch.lengths - 1, rows, batch.hidden)
        if self._keep is not None:  # the scored block's pending token and accepted drafts: `emit`
            self._keep(emit)
        if self.drafter is not None:
            self.drafter.commit(accepted)
        stats.record_round(accepted, active, width - 1, proposal.counts)
        finished = emit >= room  # spent its budget (a row already done stays done)
        batch.done = batch.done | (finished if ended is None else finished | ended)

    def _stop_strings(
        self, batch: Batch, tokens: torch.Tensor, emit: torch.Tensor, ended: torch.Tensor | None, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`emit` [B] and `ended` [B] cut at the first token of each row's round `tokens` [B, k+1]
        that completes a stop string (`losscheck.core.stops`), searched over the row's output so
        far: a string may span the round's boundary. A Python loop over the rows that emit, in
        the cells that set stop strings alone."""
        assert params.stop_strings is not None
        decode = params.stop_strings.decode(self.target.vocab_size)
        emit, ended = emit.clone(), torch.zeros_like(emit, dtype=torch.bool) if ended is None else ended.clone()
        for b in emit.nonzero().squeeze(1).tolist():
            start, before = int(batch.prompt_lengths[b]), int(batch.lengths[b])
            output = batch.tokens[b, start:before].tolist() + tokens[b, : int(emit[b])].tolist()
            at = self.stop_rule(decode, output, before - start, params.stop_strings.strings, params.min_tokens)
            if at is not None:
                emit[b], ended[b] = at - (before - start) + 1, True
        return emit, ended


def _allocated(target: Target) -> bool:
    """The target runs a ragged LM whose cache holds its buffers (allocated by the batch's first
    forward), so rows can be prefilled alone (`forward_rows`)."""
    lm = getattr(target, "lm", None)
    return isinstance(lm, RaggedLM) and lm.cache is not None and bool(lm.cache.keys) and hasattr(target, "checked")
