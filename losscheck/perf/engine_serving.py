"""Requests handed to an engine's `Stream` as they arrive, the engine stepped until they finish,
every emission timed: one timed run of an engine perf rung (`losscheck.perf.engine_suite`).

A request is admitted when it has arrived (`losscheck.plan.arrivals`) and fewer than
`concurrency` are in flight; its latencies count from then (`losscheck.perf.metrics.Latencies`,
the same terms as losscheck's own loop). Arrivals are checked between engine steps, so an open
loop's admission is late by at most one step. Nothing in flight and the next arrival ahead: the
driver sleeps until it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from losscheck.core.sampling import SamplingParams
from losscheck.engines.counters import EngineCounters
from losscheck.engines.stream import Stream
from losscheck.errors import LosscheckError
from losscheck.perf.serving import RequestTrace, request_problems
from losscheck.perf.workload import Request


@dataclass
class EngineTrace:
    """What one run of a workload through an engine measured."""

    concurrency: int
    requests: list[RequestTrace]
    wall_s: float  # first admission to last completion
    counters: EngineCounters | None  # the engine's own, over this run's requests (speculation on)
    peak_memory_mib: float | None = None  # over this run (`losscheck.perf.memory`); None: not read
    memory_source: str | None = None  # what `peak_memory_mib` measured


def drive(
    stream: Stream,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    concurrency: int,
    params: SamplingParams,
    seeds: Sequence[int],
) -> EngineTrace:
    """Run `requests` (arriving at `arrivals`, seconds from the start; sampled from `seeds`)
    through `stream` with at most `concurrency` in flight."""
    if concurrency < 1:
        raise LosscheckError(f"concurrency must be >= 1, got {concurrency}")
    if concurrency > 1 and not stream.concurrent:
        raise LosscheckError(f"this engine's stream runs one request at a time; it cannot be timed at {concurrency}")
    if not len(requests) == len(arrivals) == len(seeds):
        raise LosscheckError(f"{len(requests)} requests, {len(arrivals)} arrival times, {len(seeds)} seeds")
    traces: dict[int, RequestTrace] = {}
    waiting, in_flight = deque(range(len(requests))), set[int]()
    started = time.perf_counter()
    while waiting or in_flight:
        now = time.perf_counter() - started
        while waiting and len(in_flight) < concurrency and arrivals[waiting[0]] <= now:
            i = waiting.popleft()
            r = requests[i]
            stream.add(i, tuple(r.prompt), r.max_new, params, seeds[i])
            traces[i] = RequestTrace(r, now)
            in_flight.add(i)
        if not in_flight:
            time.sleep(max(0.0, arrivals[waiting[0]] - now))
            continue
        emissions = stream.step()
        if not emissions and not stream.busy():
            raise LosscheckError(f"the engine finished with requests {sorted(in_flight)} unanswered")
        for e in emissions:
            trace = traces.get(e.request)
            if trace is None or e.request not in in_flight:
                raise LosscheckError(f"the engine emitted for request {e.request}, which is not in flight")
            if e.tokens:
                trace.events.append((e.time - started, len(e.tokens)))
                trace.tokens += e.tokens
            if e.finished:
                trace.finished = e.time - started
                in_flight.discard(e.request)
    ordered = [traces[i] for i in range(len(requests))]
    wall = max(t.finished for t in ordered) - min(t.admitted for t in ordered)
    return EngineTrace(concurrency, ordered, wall, stream.counters())


def engine_trace_problems(trace: EngineTrace, eos: int | None, k: int) -> list[str]:
    """What is inconsistent in an engine run (empty when nothing): every request emitted within
    its budget, stopping short only at EOS, and its events add up to its tokens; the engine's
    counters are consistent and their τ lies in [1, k + 1]."""
    problems = request_problems(trace.requests, eos)
    counters = trace.counters
    if counters is not None:
        problems += [f"engine counters: {p}" for p in counters.problems()]
        tau = counters.tau
        if tau is not None and not 1 <= tau <= k + 1:
            problems.append(f"acceptance length {tau:.3f} from the engine's counters outside [1, {k + 1}]")
    return problems
