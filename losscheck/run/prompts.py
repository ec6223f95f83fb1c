"""Prompt sets: the bundled token-id tiers, or a user's JSONL file tokenised by the target's own
tokenizer and sorted into entropy tiers by the target itself.

`--losscheck-prompts=FILE` holds one JSON object per line: `{"text": "..."}` or `{"ids": [...]}`,
with an optional `"tier"` (low / mid / high). A prompt without a tier is placed by the target's
next-token entropy H after it (natural log, raw logits at T=1): low when H < `LOW_ENTROPY`, high
when H >= `HIGH_ENTROPY`, mid in between. The thresholds are fixed, not quantiles of the file, so
a prompt's tier does not depend on which other prompts came with it: 1 nat is about e ~ 2.7
equally likely continuations, 3 nats about 20.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.core.target import HFTarget
    from losscheck.plan.profiles import Profile

TIERS = ("low", "mid", "high")
LOW_ENTROPY = 1.0  # nats: below, a prompt is low-entropy
HIGH_ENTROPY = 3.0  # nats: at or above, high-entropy
# Messages name options as `prefix` + name: "--losscheck-" under pytest, "--" for `losscheck certify`.
PREFIX = "--losscheck-"


def read_jsonl(path: str | Path, prefix: str = PREFIX) -> list[dict[str, Any]]:
    """The prompt records of `path`, each checked: "text" (non-empty str) or "ids" (non-empty
    list of ints), optional "tier" in `TIERS`. Errors name the file and the line."""
    return [record for _, record in read_lines(path, prefix)]


def read_lines(path: str | Path, prefix: str = PREFIX) -> list[tuple[int, dict[str, Any]]]:
    """`read_jsonl`'s records, each with its line number in the file."""
    path, option = Path(path), f"{prefix}prompts"
    if not path.is_file():
        raise OptionError(
            f"{option}={str(path)!r}: no such file; give a JSONL file with one "
            '{"text": ...} or {"ids": [...]} object per line'
        )
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{option}={str(path)!r} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise OptionError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or ("text" in record) == ("ids" in record):
            raise OptionError(f'{where}: expected an object with exactly one of "text" or "ids"')
        text, ids = record.get("text"), record.get("ids")
        if text is not None and not (isinstance(text, str) and text):
            raise OptionError(f'{where}: "text" must be a non-empty string')
        if ids is not None and not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
            raise OptionError(f'{where}: "ids" must be a non-empty list of integers')
        if record.get("tier") not in (None, *TIERS):
            raise OptionError(f'{where}: "tier" must be one of {list(TIERS)}, got {record["tier"]!r}')
        records.append((number, record))
    if not records:
        raise OptionError(f"{option}={str(path)!r} holds no prompt")
    return records


def tokenize(
    records: list[dict[str, Any]], target_dir: str | Path | None, chat_template: bool, prefix: str = PREFIX
) -> list[list[int]]:
    """Token ids of every record: "ids" as given, "text" through the target directory's tokenizer
    (`AutoTokenizer`, offline), wrapped as a user turn by its chat template when `chat_template`."""
    if not any("text" in r for r in records):  # the chat template wraps text only
        return [list(r["ids"]) for r in records]
    if target_dir is None:
        raise OptionError(
            f"{prefix}prompts: text prompts need the target's tokenizer; the bundled target has none "
            f'(give {{"ids": [...]}} prompts, or a {prefix}target directory with a tokenizer)'
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many types; name the directory and the fix
        raise OptionError(
            f"{prefix}prompts: text prompts need a tokenizer in the target directory {str(target_dir)!r} "
            f'(tokenizer.json / tokenizer_config.json), or give {{"ids": [...]}} prompts: {exc}'
        ) from exc
    if chat_template and tokenizer.chat_template is None:
        raise OptionError(f"{prefix}chat-template: the tokenizer in {str(target_dir)!r} has no chat template")
    out = []
    for record in records:
        if "ids" in record:
            out.append(list(record["ids"]))
        elif chat_template:
            turn = [{"role": "user", "content": record["text"]}]
            out.append(
                list(tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True, return_dict=False))
            )
        else:
            out.append(list(tokenizer(record["text"])["input_ids"]))
    return out


def new_tokens(profile: Profile) -> int:
    """The most tokens a cell generates after one prompt under `profile`: a greedy cell's budget,
    or a sampled cell's horizon at the longest block length."""
    from losscheck.plan.tiers import GREEDY_KS

    return max(profile.greedy_max_new, profile.pit_horizon(max(GREEDY_KS)))


def check_prompts(
    path: str | Path,
    lines: list[int],
    prompts: list[list[int]],
    vocab_size: int | None,
    max_positions: int | None,
    room: int,
    prefix: str = PREFIX,
) -> None:
    """Each prompt (tokenised, from line `lines[i]` of `path`) has ids in the target's vocabulary
    and leaves `room` positions (`new_tokens`) before the target's `max_positions`: a prompt
    too long is one error naming its line at start-up, not an error in every cell."""
    where = f"{prefix}prompts={str(path)!r}"
    for number, ids in zip(lines, prompts):
        bad = [t for t in ids if not 0 <= t < vocab_size] if vocab_size is not None else []
        if bad:
            raise OptionError(
                f"{where} line {number}: the prompt has ids {bad[:5]} outside the target's vocabulary [0, {vocab_size})"
            )
        if max_positions is not None and len(ids) + room > max_positions:
            raise OptionError(
                f"{where} line {number}: the prompt is {len(ids)} tokens long; with the {room} tokens a cell "
                f"generates after it, that exceeds the target's {max_positions} positions "
                f"(max_position_embeddings): shorten it to at most {max(max_positions - room, 0)} tokens"
            )


def next_token_entropy(target: HFTarget, prompts: list[list[int]]) -> list[float]:
    """The target's next-token entropy (nats, T=1) after each prompt, one padded pass."""
    import torch

    from losscheck.core.engine import pad_prompts

    ids, lengths = pad_prompts(prompts, target.vocab_size, target.device)
    target.reset(len(prompts), ids.shape[1])
    logits, _ = target.forward(ids, torch.zeros_like(lengths))
    last = logits[torch.arange(len(prompts), device=ids.device), lengths - 1]  # [B, V]
    return torch.distributions.Categorical(logits=last.double()).entropy().tolist()


def tier_of(entropy: float) -> str:
    if entropy < LOW_ENTROPY:
        return "low"
    return "high" if entropy >= HIGH_ENTROPY else "mid"


def user_prompt_sets(
    path: str | Path,
    target: HFTarget,
    target_dir: str | Path | None,
    chat_template: bool,
    room: int = 1,
    prefix: str = PREFIX,
) -> dict[str, list[list[int]]]:
    """Tier -> prompts of the file at `path`, each tokenised and placed in its tier (empty tiers
    are left out). Ids outside the target's vocabulary, and a prompt that leaves fewer than `room`
    of its positions, are an error naming the line (`check_prompts`)."""
    lines = read_lines(path, prefix)
    records = [record for _, record in lines]
    prompts = tokenize(records, target_dir, chat_template, prefix)
    check_prompts(path, [n for n, _ in lines], prompts, target.vocab_size, target.max_positions, room, prefix)
    untiered = [i for i, r in enumerate(records) if "tier" not in r]
    tiers = {i: r["tier"] for i, r in enumerate(records) if "tier" in r}
    if untiered:
        entropies = next_token_entropy(target, [prompts[i] for i in untiered])
        tiers.update({i: tier_of(h) for i, h in zip(untiered, entropies)})
    sets = {tier: [prompts[i] for i in range(len(prompts)) if tiers[i] == tier] for tier in TIERS}
    return {tier: found for tier, found in sets.items() if found}
