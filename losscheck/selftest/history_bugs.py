"""Planted bugs in the engine's history-dependent processing (`losscheck.core.history`): each
stands in for `adjust_logits` on the target's side of a round, modelled on a shipped bug.

A round scores `[pending, d_1 .. d_k]`; position j must read the committed tokens and drafts
`d_1 .. d_j`. The drafter keeps processing its q correctly, so each bug shows as a target law
that differs from plain decoding's (the drafter-less baseline runs the correct step).
"""

from __future__ import annotations

import dataclasses

import torch

from losscheck.core.history import History, adjust_logits
from losscheck.core.sampling import SamplingParams


def penalties_ignored(
    logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
) -> torch.Tensor:
    """The penalties skipped while speculating (vLLM #18902, TRT-LLM #17701, SGLang #28180)."""
    neutral = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    return adjust_logits(logits, neutral, history, continuation)


def one_state_per_round(
    logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
) -> torch.Tensor:
    """One `[B, V]` adjustment broadcast over every position of the round: position j does not
    see drafts 1..j (SGLang PR #40244)."""
    rows, m, vocab = logits.shape
    tokens, lengths, prompts = (
        t.repeat_interleave(m, 0) for t in (history.tokens, history.lengths, history.prompt_lengths)
    )
    each = History(tokens, lengths, prompts, history.eos_id)  # every position read as the round's first
    flat = adjust_logits(logits.reshape(rows * m, 1, vocab), params, each, continuation.new_zeros(rows * m, 0))
    return flat.reshape(rows, m, vocab)


def first_position_only(
    logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
) -> torch.Tensor:
    """The history steps applied at the round's first position alone: the draft positions' logits
    left raw (SGLang #10617: logit bias and bans not applied to drafted positions)."""
    if not params.reads_history:
        return logits
    first = adjust_logits(logits[:, :1], params, history, continuation[:, :0])
    return torch.cat([first, logits[:, 1:].float()], dim=1)


class PerRoundState:
    """A planted step with state kept across the rounds of one batch: it counts, per row, the
    rounds and one token per round (the last committed), as an engine whose penalty and
    min-tokens state is updated once per step does (SGLang PR #33643). A new batch starts it
    afresh."""

    def __init__(self, counts_tokens: bool, counts_rounds: bool) -> None:
        self.counts_tokens, self.counts_rounds = counts_tokens, counts_rounds
        self._buffer: int | None = None
        self._seen = torch.zeros(0, dtype=torch.long)  # [B] committed length last round
        self._rounds = torch.zeros(0, dtype=torch.long)  # [B] rounds so far
        self._recorded = torch.zeros(0, 0, dtype=torch.long)  # [B, T] the tokens recorded, right-padded

    def _update(self, history: History) -> None:
        rows, width = history.tokens.shape
        # a new batch: another buffer, another row count, or every row at its prompt's end (a
        # batch's first round; a freed buffer's address may be reused by the next batch's)
        first_round = bool((history.lengths == history.prompt_lengths).all())
        if self._buffer != history.tokens.data_ptr() or len(self._seen) != rows or first_round:
            self._buffer = history.tokens.data_ptr()
            self._seen = history.prompt_lengths.clone()
            self._rounds = torch.zeros_like(self._seen)
            self._recorded = history.tokens.clone()
        grew = history.lengths > self._seen  # [B] rows that committed since the last round
        last = history.tokens.gather(1, (history.lengths - 1)[:, None])  # [B, 1]
        slot = (history.prompt_lengths + self._rounds).clamp_max(width - 1)[:, None]  # [B, 1] the next record
        self._recorded.scatter_(1, slot, torch.where(grew[:, None], last, self._recorded.gather(1, slot)))
        self._rounds = self._rounds + grew.long()
        self._seen = torch.where(grew, history.lengths, self._seen)

    def __call__(
        self, logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
    ) -> torch.Tensor:
        if not params.reads_history:
            return logits
        self._update(history)
        tokens, lengths = history.tokens, history.lengths
        if self.counts_tokens:  # BUG: the output holds one token per round
            tokens, lengths = self._recorded, history.prompt_lengths + self._rounds
        if self.counts_rounds:  # BUG: min tokens compares rounds, not tokens, with min_tokens
            lengths = history.prompt_lengths + self._rounds
        return adjust_logits(
            logits, params, History(tokens, lengths, history.prompt_lengths, history.eos_id), continuation
        )
