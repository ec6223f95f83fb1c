"""Planted bugs in where a sequence ends (`losscheck.core.engine.emit_counts` is the correct rule,
and `losscheck.core.stops.first_stop` the correct stop-string rule)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from losscheck.core.engine import emit_counts
from losscheck.core.stops import Decode, first_stop


def stop_checked_on_last_token(
    emitted: torch.Tensor, count: torch.Tensor, room: torch.Tensor, eos: int | None, stop_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stop condition read on the last token a round commits, not on each of them: an EOS or
    stop id inside an accepted block is committed with the tokens after it, and the row runs on
    (the shape of SGLang #33758 and vLLM #47616: stop checked once per step)."""
    count = torch.minimum(count, room)
    ends = ([eos] if eos is not None else []) + list(stop_ids)
    if not ends:
        return count, None
    rows = torch.arange(len(count), device=count.device)
    last = emitted[rows, (count - 1).clamp(min=0)]  # [B]
    return count, torch.isin(last, torch.tensor(ends, device=emitted.device)) & (count > 0)


def budget_checked_before_stop(
    emitted: torch.Tensor, count: torch.Tensor, room: torch.Tensor, eos: int | None, stop_ids: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The budget checked before the stop condition: a round that fills a row's `max_new_tokens`
    commits up to the budget, an EOS or stop id earlier in it not honoured (the shape of
    transformers #47912). Shows only in a row's last round, where an end token and the budget meet."""
    emit, ended = emit_counts(emitted, count, room, eos, stop_ids)
    return torch.where(count >= room, room, emit), ended  # BUG: the budget cut wins over the end token


def stop_string_at_round_end(
    decode: Decode, output: Sequence[int], start: int, strings: tuple[str, ...], min_tokens: int
) -> int | None:
    """A stop string matched only where the round's text ends (transformers' `StopStringCriteria`,
    run once per assisted-generation round): one completed by a token inside the block is missed."""
    last = len(output) - 1
    if last < max(start, min_tokens):
        return None
    return last if decode(output).endswith(strings) else None


def stop_string_tokens_kept(
    decode: Decode, output: Sequence[int], start: int, strings: tuple[str, ...], min_tokens: int
) -> int | None:
    """A stop string found in the round's tokens ends the row after the round's last token: the
    tokens after the completing one are kept."""
    at = first_stop(decode, output, start, strings, min_tokens)
    return None if at is None else len(output) - 1
