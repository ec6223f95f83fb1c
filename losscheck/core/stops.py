"""Stop strings: a row ends at the first token whose text completes one of the request's strings.

A stop string is text, not an id, so it can span tokens and a round's boundary: "ab" completes
when "b" follows an "a" the round before. Where a row ends is a function of its tokens alone
(the law of each token is unchanged: nothing is masked), which makes the structural check exact:
the row keeps the token that completed the string and nothing after it (vLLM's `token_ids` and
transformers' `stop_strings` keep it too; vLLM cuts the *text* before the string).

Semantics, those of vLLM V1's detokenizer (`vllm/v1/engine/detokenizer.py`, `update` and
`check_stop_strings`): the output's text (not the prompt's) is searched; a string counts when it
ends inside the text of output token t with t >= min_tokens (vLLM PR 22014: no stop before min
tokens); the first such token ends the row. The text is the tokenizer's decoding of the output
ids, special tokens skipped; the bundled main target's ids spell `BUNDLED_TEXTS`.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from losscheck.core.grammar import BUNDLED, BUNDLED_TEXTS, write_bundled_tokenizer
from losscheck.errors import OptionError

Decode = Callable[[Sequence[int]], str]  # output ids -> their text
# (decode, output ids, first index not yet searched, strings, min tokens) -> the index of the
# token that completes a stop string, or None: `first_stop` is the correct rule, a plant point
StopRule = Callable[[Decode, Sequence[int], int, tuple[str, ...], int], "int | None"]


@dataclass(frozen=True)
class StopStrings:
    """strings: the stop strings (non-empty, distinct); vocabulary: `BUNDLED` (the bundled main
    target's `BUNDLED_TEXTS`) or a Hugging Face tokenizer directory, whose decoding gives the text."""

    strings: tuple[str, ...]
    vocabulary: str = BUNDLED

    def __post_init__(self) -> None:
        strings = tuple(self.strings) if not isinstance(self.strings, str) else (self.strings,)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise OptionError(f"stop_strings must be non-empty strings, got {self.strings!r}")
        object.__setattr__(self, "strings", tuple(dict.fromkeys(strings)))

    def label(self) -> str:
        return "stopstr_" + "_".join(s.encode().hex() if not s.isalnum() else s for s in self.strings)

    def decode(self, vocab: int) -> Decode:
        """The text of output ids of a target with `vocab` ids."""
        return decoder(self.vocabulary, vocab)

    def check(self, vocab: int) -> None:
        """`OptionError` naming a string the vocabulary cannot spell (it could never end a row), or
        the vocabulary when it cannot be read or does not fit a target of `vocab` ids."""
        self.decode(vocab)
        if self.vocabulary == BUNDLED:
            spelled = set("".join(BUNDLED_TEXTS))
            unspelled = [s for s in self.strings if not set(s) <= spelled]
        else:
            tokenizer = hf_tokenizer(self.vocabulary)
            unspelled = [
                s for s in self.strings if tokenizer.decode(tokenizer.encode(s, add_special_tokens=False)) != s
            ]
        if unspelled:
            raise OptionError(
                f"stop_strings {unspelled!r}: the target's vocabulary cannot spell them, so they could never end "
                "a row; use text the tokenizer encodes and decodes back as it is"
            )


def parse_stop_strings(text: str) -> StopStrings:
    """ "ab,cd" (comma-separated) or a JSON list '["a,b", "c d"]' → `StopStrings` over the bundled
    vocabulary."""
    if text.lstrip().startswith("["):
        try:
            strings = json.loads(text)
        except ValueError as exc:
            raise OptionError(f"stop_strings {text!r}: not a JSON list ({exc})") from None
        return StopStrings(tuple(strings))  # a JSON text opening with "[" is a list
    return StopStrings(tuple(part for part in text.split(",") if part))


@cache
def decoder(vocabulary: str, vocab: int) -> Decode:
    """`vocabulary`'s decoding of output ids of a target with `vocab` ids; `OptionError` when the
    tokenizer cannot be read or the bundled vocabulary does not fit the target."""
    if vocabulary == BUNDLED:
        if vocab != len(BUNDLED_TEXTS):
            raise OptionError(
                f"stop strings over the bundled vocabulary need the bundled main target's {len(BUNDLED_TEXTS)} ids, "
                f"this target has {vocab}; name the target's tokenizer directory"
            )
        return lambda ids: "".join(BUNDLED_TEXTS[i] for i in ids)
    tokenizer = hf_tokenizer(vocabulary)
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True))


@cache
def hf_tokenizer(vocabulary: str) -> Any:
    """A transformers tokenizer for `vocabulary`: the bundled one written to a temporary directory
    (`write_bundled_tokenizer`), or the directory's; `OptionError` naming the directory otherwise."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(vocabulary)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise OptionError(f"stop strings need the target's tokenizer: {str(path)!r} has none (tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise OptionError(f"stop strings: no tokenizer in {str(path)!r} ({exc}); name a tokenizer directory") from None


@cache
def tokenizer_dir(vocabulary: str) -> Path:
    """A directory holding `vocabulary`'s tokenizer (the bundled one written once per process)."""
    if vocabulary == BUNDLED:
        return write_bundled_tokenizer(tempfile.mkdtemp(prefix="losscheck-tokenizer-"))
    return Path(vocabulary)


def first_stop(
    decode: Decode, output: Sequence[int], start: int, strings: tuple[str, ...], min_tokens: int
) -> int | None:
    """The index t of the first token of `output` whose text completes one of `strings`, with
    t >= `start` (tokens before it were searched already) and t >= `min_tokens`; None: none does."""
    first = max(start, min_tokens)
    seen = len(decode(output[:first]))
    for t in range(first, len(output)):
        text = decode(output[: t + 1])
        # a string completed by token t ends after the text before it
        if any(text.find(s, max(0, seen - len(s) + 1)) != -1 for s in strings):
            return t
        seen = len(text)
    return None
