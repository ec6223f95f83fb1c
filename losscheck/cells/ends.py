"""Where each sequence ended, checked exactly: the structural half of a stop's correctness.

A speculative round can emit an EOS or a stop id in the middle of its accepted block; the tokens
after it must not be emitted (engines shipped that leak: SGLang #33758, vLLM #47616, transformers
#47912), and a sequence must not run past its budget. Each token's law is the sampled tests'
business; this is the part no law shows (a leaked token after a stop is drawn from the target's
law all the same). For every row of a generation:

- no more tokens than the budget;
- nothing after the first end token (EOS or a stop id) — which must not come before
  `min_tokens`, where the processing masks it;
- a row shorter than the budget ends with an end token.

`ends_in_blocks` counts how often the cell put that to the test: the rows that ended on an end
token with drafted positions after it in its round.
"""

from __future__ import annotations

import torch

from losscheck.core.generation import Generation

SHOWN = 3  # rows quoted per problem


def end_problems(gen: Generation, eos: int | None) -> list[str]:
    """What is wrong with where `gen`'s rows ended (empty: nothing); `eos` the target's EOS id."""
    tokens, lengths = gen.tokens, gen.lengths  # [B, T], [B]
    budget = tokens.shape[1]
    ends = ([eos] if eos is not None else []) + list(gen.params.stop_ids)
    problems = []
    over = (lengths > budget).nonzero().squeeze(1).tolist()
    if over:
        problems.append(f"{len(over)} rows longer than the budget of {budget} tokens (rows {over[:SHOWN]})")
    if not ends:
        short = (lengths < budget).nonzero().squeeze(1).tolist()
        if short:
            problems.append(f"{len(short)} rows stopped before their budget with no end token (rows {short[:SHOWN]})")
        return problems
    slot = torch.arange(budget, device=tokens.device)[None, :]  # [1, T]
    is_end = torch.isin(tokens, torch.tensor(ends, device=tokens.device)) & (slot < lengths[:, None])  # [B, T]
    first = torch.where(is_end, slot, budget).amin(1)  # [B] first end token, budget: none
    ended = first < budget
    leaked = ended & (lengths > first + 1)  # tokens after the first end
    early = ended & (first < gen.params.min_tokens)
    silent = ~ended & (lengths < budget)  # stopped early with no end token
    for rows, what in (
        (leaked, "emitted tokens after an end token (EOS or a stop id) inside the output"),
        (early, f"ended before min_tokens={gen.params.min_tokens}, where the end tokens are masked"),
        (silent, "stopped before their budget with no end token"),
    ):
        found = rows.nonzero().squeeze(1).tolist()
        if found:
            quoted = ", ".join(
                f"row {b}: {int(lengths[b])} tokens, first end at {int(first[b]) if ended[b] else 'none'}"
                for b in found[:SHOWN]
            )
            problems.append(f"{len(found)} of {len(lengths)} rows {what} ({quoted})")
    return problems


def ends_in_blocks(gen: Generation, eos: int | None) -> tuple[int, int] | None:
    """(rows ending on an end token, of them those whose end came at a slot before its round's last,
    with drafted positions after it in the block: where a stop leaks) of a loop generation; None
    without slots or drafts (a baseline, an engine that reports none)."""
    if gen.slots is None or gen.stats.k < 1:
        return None
    ends = ([eos] if eos is not None else []) + list(gen.params.stop_ids)
    if not ends:
        return 0, 0
    last = (gen.lengths - 1).clamp(min=0)[:, None]  # [B, 1] each row's last token
    token = gen.tokens.gather(1, last).squeeze(1)  # [B]
    slot = gen.slots.to(gen.tokens.device).gather(1, last).squeeze(1)  # [B]
    ended = (gen.lengths > 0) & torch.isin(token, torch.tensor(ends, device=token.device))
    return int(ended.sum()), int((ended & (slot < gen.stats.k)).sum())
