"""The sampling parameters an engine serves beyond temperature, top-k and top-p, and how an adapter
refuses one it cannot serve as losscheck defines it (`losscheck.core.history`).

Fail closed: an adapter declares the parameters it passes through to its engine's own mechanism
(`serves`, a class attribute any `BlackBoxEngine` may carry) and every other field a request sets
away from neutral is refused by name before any row is drawn — a field added to `SamplingParams`
later included. The cell is then not run, with the reason, never run with the parameter neutral
(which would certify a request nobody asked for: a one-sample cell would FAIL blaming
speculation, a two-sample cell PASS). An engine that declares nothing serves none of them. Stop
ids: a row ends at its first EOS or stop id, which it keeps, and is padded with EOS after it
(`losscheck.engines.lengths`); an adapter whose engine stops there serves `stop_ids` (vLLM's
offline API and server, an OpenAI-compatible server, SGLang, Hugging Face), the others refuse any
but EOS. Stop strings: a row ends at the token that completes one (`losscheck.core.stops`), kept,
EOS after it; Hugging Face (`stop_strings`) and vLLM (`stop`, with a tokenizer) take them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING

from losscheck.errors import CellUnavailable

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams

CORE = ("temperature", "top_k", "top_p")  # every engine serves these
# the fields of `SamplingParams` beyond `CORE`, in its order (a test keeps the two in step)
SERVED = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "banned_ids",
    "min_tokens",
    "stop_ids",
    "grammar",
    "stop_strings",
)
ENDS_AT_EOS = (
    "the adapter passes no stop ids to its engine "
    "(vLLM, SGLang, OpenAI-compatible servers and Hugging Face's take them)"
)
# a grammar reaches vLLM's structured outputs (offline API) only; the other adapters refuse it
NO_GRAMMAR = "the adapter passes no grammar to its engine; certify structured output with vLLM or losscheck's loop"
GRAMMAR_UNSUPPORTED = {"grammar": NO_GRAMMAR}
UNDECLARED = (
    "the engine does not declare it among the parameters it passes to its engine (its `serves`), "
    "so losscheck would certify it at its neutral value"
)


class UnsupportedParameter(CellUnavailable):
    """An engine cannot serve a sampling parameter of a request as losscheck defines it."""


def served(params: SamplingParams) -> list[str]:
    """The fields of `params` beyond `CORE` that it sets away from their neutral value, in order
    (every field of its class: one added later is named too)."""
    return [f.name for f in fields(params) if f.name not in CORE and getattr(params, f.name) != f.default]


def refuse(
    params: SamplingParams,
    engine: str,
    serves: Collection[str],
    why: Mapping[str, str] | None = None,
    eos: int | None = None,
) -> None:
    """Raise `UnsupportedParameter` for the first field `params` sets away from neutral that the
    engine does not declare in `serves`, with the reason `why` gives for it (else `UNDECLARED`).
    Stop ids that are all `eos` need no declaring: EOS ends every row."""
    for name in served(params):
        if name == "stop_ids" and all(i == eos for i in params.stop_ids):
            continue
        if name in serves:
            continue
        value = getattr(params, name)
        if name == "grammar" and params.grammar is not None:
            value = params.grammar.label()
        elif name == "stop_strings" and params.stop_strings is not None:
            value = list(params.stop_strings.strings)
        elif name == "stop_ids":
            value = [i for i in params.stop_ids if i != eos]
        reason = (why or {}).get(name) or (ENDS_AT_EOS if name == "stop_ids" else UNDECLARED)
        raise UnsupportedParameter(f"engine {engine!r} cannot serve {name}={value!r}: {reason}")


def declared(engine: object) -> frozenset[str]:
    """The parameters `engine` declares it serves beyond `CORE` (its `serves`; none if it declares none)."""
    return frozenset(getattr(engine, "serves", ()))
