"""History-dependent logits processing: what a request's penalties, logit bias, banned ids and
min tokens do to a block of positions, each seeing the tokens before it.

A speculative round scores `[pending, d_1 .. d_k]`: position j's distribution must read the
prompt, the tokens committed before the round **and** the drafts `d_1 .. d_j`, exactly as plain
decoding would have read them had it emitted those drafts. That is the whole of losslessness for
these processors, and where engines have broken it (one penalty state broadcast over a block;
penalties counted once per round; min tokens counted in rounds).

Order, that of vLLM's V1 sampler (`vllm/v1/sample/sampler.py`, `Sampler.forward`): the grammar's
mask (`losscheck.core.grammar`; vLLM applies it to the logits before the sampler) and banned ids;
min tokens (EOS and the stop ids masked while the output is shorter than `min_tokens`); logit
bias; then the penalties — repetition over prompt and output (a positive logit divided by the
penalty, a negative one multiplied), frequency (minus `frequency_penalty` × the token's count in
the output) and presence (minus `presence_penalty` once a token is in the output), the OpenAI
definitions. Temperature, min-p, top-k and top-p follow, in `process_logits`. Hugging Face applies
the logit bias (`sequence_bias`) and then the repetition penalty too; masks commute with both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from losscheck.core.grammar import mask_logits
from losscheck.core.sampling import SamplingParams


@dataclass(frozen=True)
class History:
    """The committed tokens of each row a block of positions follows.

    tokens: [B, T] long, prompt + emitted ids, right-padded; row b is valid below lengths[b].
    lengths: [B] long, committed tokens per row.
    prompt_lengths: [B] long, how many of them are prompt (the rest is output).
    eos_id: the target's EOS id, masked with the stop ids under `min_tokens`; None: none.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    eos_id: int | None = None

    def extended(self, tokens: torch.Tensor) -> History:
        """This history with `tokens [B, j]` committed after each row's last token."""
        rows, j = tokens.shape
        grown = torch.nn.functional.pad(self.tokens, (0, j))  # [B, T + j]
        at = self.lengths[:, None] + torch.arange(j, device=tokens.device)  # [B, j]
        grown.scatter_(1, at, tokens)
        return History(grown, self.lengths + j, self.prompt_lengths, self.eos_id)


class HistoryStep(Protocol):
    """How the engine processes a round's target logits with the history (`adjust_logits`; a
    planted bug may stand in for it)."""

    def __call__(
        self, logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
    ) -> torch.Tensor: ...


def adjust_logits(
    logits: torch.Tensor, params: SamplingParams, history: History, continuation: torch.Tensor
) -> torch.Tensor:
    """`logits [B, m, V]` of m consecutive positions after `history`, processed as the request's
    history-dependent steps ask: position i reads the history and `continuation [B, m-1]`'s first
    i tokens (a round's drafts; the generated tokens of a teacher-forced pass). Returns float32
    logits [B, m, V]; the input itself when `params` reads no history."""
    if not params.reads_history:
        return logits
    rows, m, vocab = logits.shape
    logits = logits.float().clone()
    if params.banned_ids:
        logits[..., list(params.banned_ids)] = -math.inf
    stops = ((history.eos_id,) if history.eos_id is not None else ()) + params.stop_ids  # what ends an output
    if params.grammar is not None:
        mask_logits(logits, params.grammar, outputs(history), continuation, stops)
    generated = history.lengths - history.prompt_lengths  # [B] output tokens before position 0
    if params.min_tokens:
        early = (generated[:, None] + torch.arange(m, device=logits.device)) < params.min_tokens  # [B, m]
        if stops:
            stop_cols = logits[..., list(stops)]  # [B, m, S]
            logits[..., list(stops)] = stop_cols.masked_fill(early[..., None], -math.inf)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        logits[..., list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if params.penalised:
        counts = output_counts(history, continuation, vocab)  # [B, m, V]
        logits = apply_penalties(logits, params, counts, prompt_seen(history, vocab))
    return logits


def outputs(history: History) -> list[list[int]]:
    """Each row's committed output (its tokens past the prompt), as ids."""
    tokens, starts, ends = history.tokens.tolist(), history.prompt_lengths.tolist(), history.lengths.tolist()
    return [row[start:end] for row, start, end in zip(tokens, starts, ends, strict=True)]


def output_counts(history: History, continuation: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, m, V] float32: how often each id is in the output position i follows — the committed
    output plus `continuation [B, m-1]`'s first i tokens."""
    rows, width = history.tokens.shape
    slot = torch.arange(width, device=history.tokens.device)[None, :]  # [1, T]
    is_output = (slot >= history.prompt_lengths[:, None]) & (slot < history.lengths[:, None])  # [B, T]
    base = torch.zeros(rows, vocab, device=history.tokens.device)
    base.scatter_add_(1, history.tokens, is_output.float())  # [B, V]
    drafted = torch.nn.functional.one_hot(continuation, vocab).float().cumsum(1)  # [B, m-1, V]
    return torch.cat([base[:, None], base[:, None] + drafted], dim=1)


def prompt_seen(history: History, vocab: int) -> torch.Tensor:
    """[B, V] bool: the ids in each row's prompt."""
    rows, width = history.tokens.shape
    in_prompt = torch.arange(width, device=history.tokens.device)[None, :] < history.prompt_lengths[:, None]
    seen = torch.zeros(rows, vocab, device=history.tokens.device)
    return seen.scatter_add_(1, history.tokens, in_prompt.float()) > 0


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor, in_prompt: torch.Tensor
) -> torch.Tensor:
    """The repetition, frequency and presence penalties on `logits [B, m, V]`, given each
    position's output `counts [B, m, V]` and the prompt's ids `in_prompt [B, V]`."""
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | in_prompt[:, None]  # [B, m, V]
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (counts > 0).float()
    return logits
