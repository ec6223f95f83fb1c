"""The measurements of one engine perf run (`losscheck perf --engine ...`), memoised like
`losscheck.perf.suite`'s: any subset of the engine perf tests measures only what it needs.

A *rung* is the engine at one concurrency, on one workload, with one arrival process: one warm-up
run a side, then `repeats` pairs of timed runs of the same requests and seeds, speculation off then
on (`losscheck.perf.engine_serving.drive`); the speedup is taken over the pairs. Workloads:
`ladder` (the prompt sets, the profile's output budgets), `long-input` (prompts repeated to
`EngineSizes.long_input` tokens) and `long-output` (budgets of `EngineSizes.long_output`), the
two length tiers at the lowest concurrency. The plain side is opened first, so the speculative
instance is the last one built (vLLM's counters belong to the last `LLM` of the process).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from losscheck.core.sampling import GREEDY, SamplingParams, derive_seed
from losscheck.engines.counters import EngineCounters
from losscheck.engines.pool import instances_of, one_at_a_time
from losscheck.engines.stream import Resizable, Stream, Streams, open_stream
from losscheck.errors import OptionError, flag
from losscheck.perf.engine_serving import EngineTrace, drive
from losscheck.perf.memory import peak_memory
from losscheck.perf.metrics import Latencies, speedup, throughput
from losscheck.perf.workload import Request, distinct_prompts, make_workload
from losscheck.plan.arrivals import CLOSED, Arrivals, parse_arrivals, parse_block_lengths, parse_concurrency
from losscheck.plan.perf_profiles import ENGINE_SIZES, PerfProfile
from losscheck.report.engine_perf_record import (
    LADDER,
    LONG_INPUT,
    LONG_OUTPUT,
    SCHEMA,
    EnginePerfFile,
    EngineRung,
    Side,
)

if TYPE_CHECKING:
    from losscheck.engines import BlackBoxEngine
    from losscheck.run.session import Session

WORKLOADS = (LADDER, LONG_INPUT, LONG_OUTPUT)
WARMUP_MAX_NEW = 8
Key = tuple[str, str, int, int]  # workload, arrivals label, concurrency, block length


class EnginePerfRun:
    def __init__(self, session: Session, profile: PerfProfile) -> None:
        engine = session.blackbox
        if engine is None:
            raise OptionError(f"an engine perf run needs {flag('engine')}")
        self.memory_source: str | None = None  # what the runs' peak memory measured (`losscheck.perf.memory`)
        self.session, self.profile, self.engine = session, profile, engine
        self.engines: dict[int, BlackBoxEngine] = {engine.k: engine}  # by block length (`--perf-k`)
        self.sizes = ENGINE_SIZES.get(profile.name, ENGINE_SIZES["quick"])
        opts = session.options
        self.concurrency = parse_concurrency(opts.perf_concurrency) if opts.perf_concurrency else self.sizes.concurrency
        self.arrivals = parse_arrivals(opts.perf_arrivals)
        self.ks = parse_block_lengths(opts.perf_k) if opts.perf_k else (engine.k,)
        self.params: SamplingParams = (
            GREEDY if profile.temperature == 0 else SamplingParams(temperature=profile.temperature)
        )
        self.seed = opts.seed
        eos = session.target("main").eos_id
        self.eos = eos if eos is not None else 0
        self.streamed = isinstance(engine, Streams)
        # runs alternate off / on (paired) unless switching sides rebuilds an instance
        self.paired = not one_at_a_time(engine)
        self.concurrent: bool | None = None  # known once a stream is open
        self.counters_source = "none"  # where the engine's stream reads its counts
        self._rungs: dict[Key, EngineRung] = {}
        self._traces: dict[Key, list[EngineTrace]] = {}
        self._warm: set[int] = set()  # the block lengths warmed up
        self.started = dt.datetime.now(dt.timezone.utc)

    # -- workloads ----------------------------------------------------------------------------

    def workload(self, kind: str, concurrency: int) -> list[Request]:
        p, sizes = self.profile, self.sizes
        n = max(p.min_requests, concurrency * p.requests_per_slot)
        sets = self.session.prompt_sets
        if kind == LADDER:
            return make_workload(sets, n, p.max_new, self.seed, "engine", concurrency, kind)
        if kind == LONG_OUTPUT:
            requests = make_workload(sets, n, sizes.long_output, self.seed, "engine", concurrency, kind)
            return [Request(r.prompt, sizes.long_output, r.tier) for r in requests]  # every budget the long one
        if kind == LONG_INPUT:
            requests = make_workload(sets, n, p.max_new, self.seed, "engine", concurrency, kind)
            return [Request(_repeated(r.prompt, sizes.long_input), r.max_new, r.tier) for r in requests]
        raise OptionError(f"no engine workload {kind!r}; the workloads are {list(WORKLOADS)}")

    # -- timed runs ---------------------------------------------------------------------------

    def engine_at(self, k: int) -> BlackBoxEngine:
        """The engine drafting `k` tokens a round (`Resizable.with_k`); every other block length's
        instances are released first (one configuration's memory at a time)."""
        if k not in self.engines:
            if not isinstance(self.engine, Resizable):
                raise OptionError(
                    f"{flag('perf-k')}: engine {self.engine.name!r} cannot change its block length "
                    f"(it has no with_k(k)); time it at its own k = {self.engine.k}"
                )
            self._release(keep=None)
            self.engines[k] = self.engine.with_k(k)
        self._release(keep=k)
        return self.engines[k]

    def _release(self, keep: int | None) -> None:
        for k, engine in self.engines.items():
            instances = instances_of(engine)
            if k != keep and instances is not None:
                instances.close()

    def _stream(self, speculative: bool, k: int) -> Stream:
        stream = open_stream(self.engine_at(k), speculative, self.eos)
        self.concurrent = stream.concurrent
        if speculative:
            self.counters_source = str(getattr(stream, "counters_source", "the engine's counters"))
        return stream

    def _drive(
        self, speculative: bool, k: int, requests: list[Request], arrivals: Arrivals, c: int, *names: object
    ) -> EngineTrace:
        """One timed run; the requests' seeds and arrivals do not depend on `k` or the side, so
        every configuration serves the same rows."""
        rng = np.random.default_rng(derive_seed(self.seed, "engine-arrivals", arrivals.label, c, *names))
        seeds = [derive_seed(self.seed, "engine-request", c, *names, i) for i in range(len(requests))]
        stream = self._stream(speculative, k)
        with peak_memory() as peak:
            trace = drive(stream, requests, arrivals.times(len(requests), rng), c, self.params, seeds)
        trace.peak_memory_mib, trace.memory_source = peak.mib, peak.source
        if peak.source is not None:
            self.memory_source = peak.source
        return trace

    def _warm_up(self, k: int) -> None:
        """One short closed-loop run a side, plain first (see the module's docstring)."""
        if k in self._warm:
            return
        requests = [Request(r.prompt, min(r.max_new, WARMUP_MAX_NEW), r.tier) for r in self.workload(LADDER, 1)[:2]]
        for speculative in (False, True):
            self._drive(speculative, k, requests, CLOSED, 1, "warm-up")
        self._warm.add(k)

    def timeable(self, concurrency: int, k: int | None = None) -> bool:
        """Whether the engine can be timed at `concurrency` (a one-at-a-time stream: only at 1)."""
        self._warm_up(self.engine.k if k is None else k)
        return concurrency == 1 or bool(self.concurrent)

    def traces(self, kind: str, arrivals: Arrivals, concurrency: int, k: int | None = None) -> list[EngineTrace]:
        """The timed runs of a rung, listed [off 0, on 0, off 1, on 1, ...]; taken in that order
        (pairs) or, for an engine that keeps one instance alive at a time, every off run first."""
        k = self.engine.k if k is None else k
        key = (kind, arrivals.label, concurrency, k)
        if key not in self._traces:
            if not self.timeable(concurrency, k):
                raise OptionError(
                    f"engine {self.engine.name!r} runs one request at a time; it is timed at concurrency 1 only"
                )
            requests = self.workload(kind, concurrency)
            repeats = range(self.profile.repeats)
            if self.paired:
                order = [(speculative, i) for i in repeats for speculative in (False, True)]
            else:  # one instance alive at a time: each side's runs together, one build a side
                order = [(speculative, i) for speculative in (False, True) for i in repeats]
            runs = {(s, i): self._drive(s, k, requests, arrivals, concurrency, kind, i) for s, i in order}
            self._traces[key] = [runs[s, i] for i in repeats for s in (False, True)]
        return self._traces[key]

    def rung(self, kind: str, arrivals: Arrivals, concurrency: int, k: int | None = None) -> EngineRung:
        k = self.engine.k if k is None else k
        key = (kind, arrivals.label, concurrency, k)
        if key not in self._rungs:
            runs = self.traces(kind, arrivals, concurrency, k)
            requests = self.workload(kind, concurrency)
            self._rungs[key] = _record(kind, arrivals, concurrency, k, requests, runs, self.paired)
        return self._rungs[key]

    def measured(self) -> list[Key]:
        return list(self._rungs)

    # -- the run file -------------------------------------------------------------------------

    def document(self) -> EnginePerfFile:
        from losscheck.report.engine_perf import statement
        from losscheck.report.manifest import engine_identity, environment, portable, portable_pins

        session = self.session
        target = session.target("main")
        doc = EnginePerfFile(
            schema=SCHEMA,
            created=self.started.isoformat(timespec="seconds"),
            statement="",
            environment=environment(session.device),
            engine=engine_identity(self.engine, portable_pins(session.engine_pins)),
            target=portable({"name": target.name, **target.identity}),
            streamed=self.streamed,
            counters_source=self.counters_source,
            profile=self.profile.name,
            sizes=self.sizes,
            params=self.params.label(),
            seed=self.seed,
            rungs=tuple(self._rungs.values()),
            memory_source=self.memory_source,
        )
        return replace(doc, statement=statement(doc))


def _repeated(prompt: list[int], length: int) -> list[int]:
    """`prompt` repeated and cut to `length` ids (a long context built from the prompt sets)."""
    return (prompt * (length // max(len(prompt), 1) + 1))[:length]


def _record(
    kind: str,
    arrivals: Arrivals,
    concurrency: int,
    k: int,
    requests: list[Request],
    runs: list[EngineTrace],
    paired: bool,
) -> EngineRung:
    off, on = runs[0::2], runs[1::2]
    counters = None
    for trace in on:
        if trace.counters is None:
            counters = None
            break
        counters = trace.counters if counters is None else counters.plus(trace.counters)
    on_tok_s = [throughput(t) for t in on]
    off_tok_s = [throughput(t) for t in off]
    return EngineRung(
        workload=kind,
        arrivals=arrivals.label,
        concurrency=concurrency,
        k=k,
        requests=len(requests),
        distinct_prompts=distinct_prompts(requests),
        prompt_tokens=float(np.mean([len(r.prompt) for r in requests])),
        max_new=max(r.max_new for r in requests),
        repeats=len(on),
        off=_side(off),
        on=_side(on),
        speedup=speedup(on_tok_s, off_tok_s, paired=paired),
        paired=paired,
        counters=counters,
        tau=counters.tau if counters else None,
        cumulative_acceptance=counters.cumulative_acceptance() if counters else (),
        conditional_acceptance=counters.conditional_acceptance() if counters else (),
        wasted_fraction=_wasted(counters),
    )


def _side(traces: list[EngineTrace]) -> Side:
    latencies = Latencies([], [], [], [])
    for trace in traces:
        latencies = latencies + Latencies.of(trace)
    peaks = [t.peak_memory_mib for t in traces]
    return Side(
        output_tokens=tuple(sum(r.output_tokens for r in t.requests) for t in traces),
        throughput_tok_s=tuple(throughput(t) for t in traces),
        latency_s=latencies.summary(),
        peak_memory_mib=None if None in peaks or not peaks else max(p for p in peaks if p is not None),
    )


def _wasted(counters: EngineCounters | None) -> float | None:
    if counters is None or counters.drafted is None or counters.accepted is None or not counters.drafted:
        return None
    return 1 - counters.accepted / counters.drafted
