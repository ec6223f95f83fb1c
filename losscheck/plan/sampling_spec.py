"""`--losscheck-sampling SPEC`: a request's sampling parameters as text, one extra sampled cell each.

SPEC is `NAME=VALUE` pairs separated by spaces (a value with spaces quoted, shell-style), NAME a
`SamplingParams` field; what is not named
keeps its neutral value (temperature 1). Lists are comma-separated: `banned_ids=3,7`,
`stop_ids=2`, `logit_bias=5:2.0,7:-1.5` (id:bias); `grammar=regex:PATTERN` or `grammar=json:SCHEMA`
(over the bundled target's `losscheck.core.grammar.BUNDLED_TEXTS`, or the `--target`'s tokenizer;
`"grammar='regex:[a-z]+( [a-z]+)*'"`); `stop_strings=ab,cd` or a JSON list
(`'stop_strings=["a,b"]'`), decoded with the same vocabulary. For example
`--losscheck-sampling "repetition_penalty=1.2 min_p=0.05"`.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from typing import Any

from losscheck.core.grammar import parse_grammar
from losscheck.core.sampling import SamplingParams
from losscheck.core.stops import parse_stop_strings
from losscheck.errors import OptionError, flag

EXAMPLE = '"repetition_penalty=1.2 min_p=0.05"'


def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _bias(text: str) -> tuple[tuple[int, float], ...]:
    pairs = []
    for part in text.split(","):
        token, sep, value = part.partition(":")
        if not sep:
            raise ValueError(f"{part!r} is not ID:BIAS")
        pairs.append((int(token), float(value)))
    return tuple(pairs)


PARSERS: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "logit_bias": _bias,
    "banned_ids": _ids,
    "min_tokens": int,
    "stop_ids": _ids,
    "grammar": parse_grammar,
    "stop_strings": parse_stop_strings,
}
assert set(PARSERS) == {f.name for f in dataclasses.fields(SamplingParams)}, "a SamplingParams field has no parser"


def parse_sampling(text: str, tokenizer: str | None = None) -> SamplingParams:
    """`SamplingParams` from a SPEC (module docstring); `OptionError` naming the bad part. A
    grammar is over the bundled target's vocabulary, or over `tokenizer`'s (a tokenizer directory,
    the run's `--target`) when given."""
    where = f"{flag('sampling')}={text!r}"
    values: dict[str, Any] = {}
    try:
        pairs = shlex.split(text)
    except ValueError as exc:
        raise OptionError(f"{where}: {exc}; quote a value with spaces as NAME='VALUE'") from None
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in PARSERS:
            raise OptionError(
                f"{where}: {pair!r} is not NAME=VALUE with NAME one of {', '.join(PARSERS)}; e.g. {EXAMPLE}"
            )
        if name in values:
            raise OptionError(f"{where}: {name} is given twice")
        try:
            values[name] = PARSERS[name](value)
        except ValueError as exc:
            raise OptionError(f"{where}: {name}={value!r} does not parse ({exc})") from None
        except OptionError as exc:  # a grammar that does not compile
            raise OptionError(f"{where}: {exc}") from None
    if not values:
        raise OptionError(f"{where}: name at least one parameter, e.g. {EXAMPLE}")
    try:
        params = SamplingParams(**values)
    except OptionError as exc:
        raise OptionError(f"{where}: {exc}") from None
    if params.greedy:
        raise OptionError(f"{where}: temperature 0 is greedy; the sampled cells need temperature > 0")
    return with_vocabulary(params, tokenizer) if tokenizer is not None else params


def with_vocabulary(params: SamplingParams, vocabulary: str) -> SamplingParams:
    """`params` with its grammar and stop strings over `vocabulary` (a tokenizer directory, or
    `BUNDLED`)."""
    changes = {
        name: dataclasses.replace(value, vocabulary=vocabulary)
        for name in ("grammar", "stop_strings")
        if (value := getattr(params, name)) is not None
    }
    return dataclasses.replace(params, **changes) if changes else params
