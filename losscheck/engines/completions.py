"""The OpenAI completions API over HTTP, as the served adapters speak it (`vllm-serve`, which starts
its own vLLM server, and `openai`, any running OpenAI-compatible server).

One request is one row: `/v1/completions` with the prompt as token ids (or text, where a server
takes no ids), `n` 1 and the row's own seed. The sampling fields are vLLM's `SamplingParams`
names (`losscheck.engines.vllm.sampling_kwargs`), which vLLM and SGLang read under these names in
the request body; an HTTP 400 is the server refusing the request's parameters
(`UnsupportedParameter`: the cell is not run, with the server's words). Only the standard library
speaks HTTP here.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines.counters import EngineCounters

# what a completion request passes to the server (`losscheck.engines.served`: the rest is refused)
COMPLETIONS_SERVES = frozenset(
    {
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "banned_ids",
        "min_tokens",
        "stop_ids",  # `stop_token_ids` beside EOS: vLLM's server ends the row at one and keeps it in `token_ids`
    }
)
# what a completion request takes of `sampling_kwargs` (the others are the offline API's)
REQUEST_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "allowed_token_ids",
    "stop_token_ids",
)


class Endpoint(Protocol):
    """A completions server as a stream reads it (`vllm_server.ServerStream`)."""

    def body(self, prompt: Sequence[int], params: SamplingParams, seed: int, max_new: int, stream: bool) -> bytes: ...

    def post(self, body: bytes) -> Any: ...

    def counters(self) -> EngineCounters | None: ...


def sampling_fields(
    params: SamplingParams,
    seed: int,
    max_new: int,
    eos: int | None,
    vocab: int | None,
    engine: str,
) -> dict[str, Any]:
    """The request's sampling as completion fields (a logit bias keyed by the ids as strings, as
    JSON and the OpenAI API have it); a grammar refused (the HTTP API takes it another way). Every
    knob is sent, neutral ones too, so that no default of the server's (a model's generation
    config: vLLM applies it to the fields a request leaves out) can creep in."""
    from losscheck.engines.served import GRAMMAR_UNSUPPORTED, refuse
    from losscheck.engines.vllm import sampling_kwargs

    refuse(params, engine, COMPLETIONS_SERVES, GRAMMAR_UNSUPPORTED, eos)
    kwargs = sampling_kwargs(params, seed, max_new, eos, vocab)
    fields = {key: kwargs[key] for key in REQUEST_FIELDS}
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = {str(i): bias for i, bias in fields["logit_bias"].items()}
    return fields


def post(url: str, body: bytes, engine: str, timeout: float) -> Any:
    """The server's answer to the POST of `body` (JSON) to `url`, an open response; its refusal of
    the request (HTTP 400) as `UnsupportedParameter`, with the server's words."""
    from losscheck.engines.served import UnsupportedParameter

    request = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code != 400:
            raise
        answer = exc.read().decode(errors="replace")
        raise UnsupportedParameter(f"engine {engine!r} refuses the request: {answer}") from exc


def post_json(url: str, request: dict[str, Any], engine: str, timeout: float) -> Any:
    """`post` of `request`, its answer parsed."""
    with post(url, json.dumps(request).encode(), engine, timeout) as answer:
        return json.loads(answer.read())


def get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())


@dataclass(frozen=True)
class _Completion:
    token_ids: list[int]


@dataclass(frozen=True)
class RowOutput:
    """A row's ids in the shape `losscheck.engines.vllm.to_tensor` reads (vLLM's
    `RequestOutput.outputs[0].token_ids`)."""

    ids: list[int]

    @property
    def outputs(self) -> list[_Completion]:
        return [_Completion(self.ids)]
