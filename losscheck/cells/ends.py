"""Where each sequence ended, checked exactly: the structural half of a stop's correctness.

A speculative round can emit an EOS or a stop id in the middle of its accepted block; the tokens
after it must not be emitted (engines shipped that leak: SGLang #33758, vLLM #47616, transformers
#47912), and a sequence must not run past its budget. Each token's law is the sampled tests'
business; this is the part no law shows (a leaked token after a stop is drawn from the target's
law all the same). For every row of a generation:

- no more tokens than the budget;
- nothing after the first end: an end token (EOS or a stop id) — which must not come before
  `min_tokens`, where the processing masks it — or the token that completes a stop string;
- a row shorter than the budget ends with an end.

`ends_in_blocks` counts how often the cell put that to the test: the rows that ended on an end
token, and those that ended on a stop string, with drafted positions after the end in its round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from losscheck.core.generation import Generation
from losscheck.core.sampling import SamplingParams
from losscheck.core.stops import first_stop

SHOWN = 3  # rows quoted per problem


def end_problems(gen: Generation, eos: int | None, vocab: int | None = None) -> list[str]:
    """What is wrong with where `gen`'s rows ended (empty: nothing); `eos` the target's EOS id,
    `vocab` its vocabulary size (what stop strings decode; needed when `gen` has them)."""
    tokens, lengths = gen.tokens, gen.lengths  # [B, T], [B]
    budget = tokens.shape[1]
    params = gen.params
    problems = []
    over = (lengths > budget).nonzero().squeeze(1).tolist()
    if over:
        problems.append(f"{len(over)} rows longer than the budget of {budget} tokens (rows {over[:SHOWN]})")
    if not _end_ids(params, eos) and params.stop_strings is None:
        short = (lengths < budget).nonzero().squeeze(1).tolist()
        if short:
            problems.append(f"{len(short)} rows stopped before their budget with no end token (rows {short[:SHOWN]})")
        return problems
    first, by_id = first_ends(gen, eos, vocab)
    ended = first < budget
    leaked = ended & (lengths > first + 1)  # tokens after the first end
    early = ended & by_id & (first < params.min_tokens)
    silent = ~ended & (lengths < budget)  # stopped early with no end token
    strings = " or a completed stop string" if params.stop_strings else ""
    for rows, what in (
        (leaked, f"emitted tokens after an end token (EOS or a stop id){strings} inside the output"),
        (early, f"ended before min_tokens={params.min_tokens}, where the end tokens are masked"),
        (silent, f"stopped before their budget with no end token{strings}"),
    ):
        found = rows.nonzero().squeeze(1).tolist()
        if found:
            quoted = ", ".join(
                f"row {b}: {int(lengths[b])} tokens, first end at {int(first[b]) if ended[b] else 'none'}"
                for b in found[:SHOWN]
            )
            problems.append(f"{len(found)} of {len(lengths)} rows {what} ({quoted})")
    return problems


def first_ends(gen: Generation, eos: int | None, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] the index of each row's first end within its length, the budget T where it has none;
    [B] bool whether that end is an end token rather than a stop string). An end token is EOS or
    a stop id; a stop string ends a row at the token that completes it (`losscheck.core.stops`),
    searched here over the row's whole output (a Python loop over the rows)."""
    tokens, lengths = gen.tokens, gen.lengths  # [B, T], [B]
    budget = tokens.shape[1]
    slot = torch.arange(budget, device=tokens.device)[None, :]  # [1, T]
    ends = _end_ids(gen.params, eos)
    is_end = torch.isin(tokens, torch.tensor(ends, dtype=tokens.dtype, device=tokens.device)) & (
        slot < lengths[:, None]
    )
    first = torch.where(is_end, slot, budget).amin(1)  # [B] first end token, budget: none
    by_id = first < budget
    stops = gen.params.stop_strings
    if stops is None:
        return first, by_id
    if vocab is None:
        raise ValueError("a generation with stop strings needs the target's vocabulary size to decode them")
    decode = stops.decode(vocab)
    for b, (row, length) in enumerate(zip(tokens.tolist(), lengths.tolist(), strict=True)):
        at = first_stop(decode, row[: min(length, int(first[b]))], 0, stops.strings, gen.params.min_tokens)
        if at is not None:
            first[b], by_id[b] = at, False
    return first, by_id


def _end_ids(params: SamplingParams, eos: int | None) -> list[int]:
    return ([eos] if eos is not None else []) + list(params.stop_ids)


@dataclass(frozen=True)
class EndCounts:
    """How often a loop generation put a stop inside a block to the test: the rows that ended on
    an end token (EOS or a stop id) and on a stop string, and of each those whose end came at a
    slot before its round's last, with drafted positions after it (where a stop leaks)."""

    ends: int
    ends_in_block: int
    string_ends: int
    string_ends_in_block: int


def ends_in_blocks(gen: Generation, eos: int | None, vocab: int | None = None) -> EndCounts | None:
    """`EndCounts` of a loop generation; None without slots or drafts (a baseline, an engine that
    reports none)."""
    if gen.slots is None or gen.stats.k < 1:
        return None
    if not _end_ids(gen.params, eos) and gen.params.stop_strings is None:
        return EndCounts(0, 0, 0, 0)
    first, by_id = first_ends(gen, eos, vocab)
    ended = (gen.lengths > 0) & (first == gen.lengths - 1)  # [B] the row's last token ended it
    last = (gen.lengths - 1).clamp(min=0)[:, None]  # [B, 1] each row's last token
    inside = gen.slots.to(gen.tokens.device).gather(1, last).squeeze(1) < gen.stats.k  # [B]
    by_id = by_id.to(ended.device)
    return EndCounts(
        int((ended & by_id).sum()),
        int((ended & by_id & inside).sum()),
        int((ended & ~by_id).sum()),
        int((ended & ~by_id & inside).sum()),
    )
