"""The sampling parameters an engine serves beyond temperature, top-k and top-p, and how an adapter
refuses one it cannot serve as losscheck defines it (`losscheck.core.history`).

An adapter passes each such parameter through to its engine's own mechanism, or refuses the
request before any row is drawn: the cell is then not run, with the reason, never run with the
parameter neutral (which would certify a request nobody asked for). Stop ids: a row ends at its
first EOS or stop id, which it keeps, and is padded with EOS after it (`losscheck.engines.lengths`);
an adapter whose engine stops there says so (`refuse(..., stops=True)`: vLLM's offline API, SGLang,
Hugging Face), the others refuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING

from losscheck.errors import CellUnavailable

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams

# the fields of `SamplingParams` beyond temperature, top-k and top-p, in its order
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
)
ENDS_AT_EOS = "the adapter passes no stop ids to its engine (vLLM, SGLang and Hugging Face's take them)"
# a grammar reaches vLLM's structured outputs (offline API) only; the other adapters refuse it
NO_GRAMMAR = "the adapter passes no grammar to its engine; certify structured output with vLLM or losscheck's loop"
GRAMMAR_UNSUPPORTED = {"grammar": NO_GRAMMAR}


class UnsupportedParameter(CellUnavailable):
    """An engine cannot serve a sampling parameter of a request as losscheck defines it."""


def served(params: SamplingParams) -> list[str]:
    """The fields of `SERVED` that `params` sets away from their neutral value, in order."""
    from losscheck.core.sampling import SamplingParams

    neutral = {f.name: f.default for f in fields(SamplingParams)}
    return [name for name in SERVED if getattr(params, name) != neutral[name]]


def refuse(
    params: SamplingParams, engine: str, unsupported: Mapping[str, str], eos: int | None = None, stops: bool = False
) -> None:
    """Raise `UnsupportedParameter` for the first parameter `params` sets that `unsupported` names
    (parameter -> why the engine cannot serve it), and, unless the adapter passes them on
    (`stops`), for stop ids other than `eos`."""
    for name in served(params):
        if name in unsupported:
            value = params.grammar.label() if name == "grammar" and params.grammar else getattr(params, name)
            raise UnsupportedParameter(f"engine {engine!r} cannot serve {name}={value!r}: {unsupported[name]}")
    others = [i for i in params.stop_ids if i != eos]
    if others and not stops:
        raise UnsupportedParameter(f"engine {engine!r} cannot serve stop_ids={others!r}: {ENDS_AT_EOS}")
