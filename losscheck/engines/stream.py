"""Timing an engine: requests added one by one and emitted as the engine emits them, with their
clock times (`losscheck perf --engine`).

The certificate's contract (`BlackBoxEngine.generate`) returns whole continuations, which is all a
correctness test needs and too little for latency: a perf run needs *when* each token left the
engine. An engine that can say so implements `Streams`: `stream(speculative)` gives a `Stream`, one
engine instance with drafting on or off, to which the perf driver (`losscheck.perf.engine_serving`)
adds requests as they arrive and which it steps until they finish. Terms:

emission   what one step of the engine gave one request: its new token ids (a speculative round
           gives several at once, a streaming client's chunk), the clock time it was read
           (`time.perf_counter()`), and whether the request finished.
concurrent whether requests added to the stream run together (continuous batching, vLLM) or one
           after another (HF assisted generation, batch size 1): a one-at-a-time stream is timed
           at concurrency 1 only.

An engine without `stream` is timed through `generate` (`CallStream`): one call per request, so
its only emission is the whole continuation when the call returns (TTFT = end-to-end latency,
stated so in the report), at concurrency 1.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from losscheck.engines.counters import EngineCounters
from losscheck.engines.request import GenerationRequest

if TYPE_CHECKING:
    from losscheck.core.sampling import SamplingParams
    from losscheck.engines import BlackBoxEngine


@dataclass(frozen=True)
class Emission:
    request: int  # the id the request was added with
    time: float  # time.perf_counter() when the tokens were read
    tokens: tuple[int, ...]  # new ids, in order
    finished: bool


@runtime_checkable
class Stream(Protocol):
    """One engine instance (drafting on or off) taking requests as they arrive."""

    concurrent: bool  # requests run together (True) or one after another (False)

    def add(
        self, request: int, prompt: tuple[int, ...], max_new_tokens: int, params: SamplingParams, seed: int
    ) -> None:
        """Queue a request: `prompt` ids, at most `max_new_tokens` new ids (fewer only at EOS),
        sampled with `params` from `seed`."""
        ...

    def step(self) -> list[Emission]:
        """Advance the engine by one step (a round of every running request, or one whole request
        for a one-at-a-time stream); what each request emitted in it."""
        ...

    def busy(self) -> bool:
        """Whether an added request has not finished."""
        ...

    def counters(self) -> EngineCounters | None:
        """The engine's speculative-decoding counts over this stream's requests so far; None where
        the engine keeps none (or drafting is off)."""
        ...


@runtime_checkable
class Streams(Protocol):
    """An engine that can be timed token by token (optional, beside `BlackBoxEngine`)."""

    def stream(self, speculative: bool) -> Stream:
        """A stream of the engine with drafting on or off. Streams of one engine are used one at
        a time; opening one may release the other side's instance (one GPU's memory)."""
        ...


@runtime_checkable
class Resizable(Protocol):
    """An engine that can be built again with another block length (a perf run's k sweep)."""

    def with_k(self, k: int) -> BlackBoxEngine:
        """The same engine and models drafting `k` tokens a round."""
        ...


class CallStream:
    """Any `BlackBoxEngine` as a one-at-a-time stream: each step is one `generate` call for the
    next queued request, and its emission the whole continuation (cut after EOS). Its counters are
    the engine's own (`counters()`, where it keeps them) since the stream opened."""

    concurrent = False
    counters_source = "the engine's counters() where it keeps them"

    def __init__(self, engine: BlackBoxEngine, speculative: bool, eos: int) -> None:
        from losscheck.engines import engine_counters

        self.engine, self.speculative, self.eos = engine, speculative, eos
        self._queue: deque[tuple[int, GenerationRequest]] = deque()
        self._before = engine_counters(engine) if speculative else None

    def add(
        self, request: int, prompt: tuple[int, ...], max_new_tokens: int, params: SamplingParams, seed: int
    ) -> None:
        call = GenerationRequest(
            prompts=(prompt,),
            n=1,
            params=params,
            seed=seed,
            max_new_tokens=max_new_tokens,
            speculative=self.speculative,
        )
        self._queue.append((request, call))

    def step(self) -> list[Emission]:
        if not self._queue:
            return []
        request, call = self._queue.popleft()
        ids = [int(t) for t in self.engine.generate(call)[0, 0]]
        now = time.perf_counter()
        if self.eos in ids:
            ids = ids[: ids.index(self.eos) + 1]
        return [Emission(request, now, tuple(ids), True)]

    def busy(self) -> bool:
        return bool(self._queue)

    def counters(self) -> EngineCounters | None:
        from losscheck.engines import engine_counters

        after = engine_counters(self.engine) if self.speculative else None
        if after is None:
            return None
        return after if self._before is None else after.since(self._before)


def open_stream(engine: BlackBoxEngine, speculative: bool, eos: int) -> Stream:
    """The engine's own stream where it has one, else `CallStream`."""
    if isinstance(engine, Streams):
        return engine.stream(speculative)
    return CallStream(engine, speculative, eos)
