"""The records of an engine perf run file (`perf.json`, schema `losscheck.engine-perf/1`): each
rung's speculation-on and -off figures, the speedup with its interval, and acceptance from the
engine's own counters. Written by `losscheck.perf.engine_suite`, rendered by
`losscheck.report.engine_perf`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from losscheck import acceptance
from losscheck.engines.counters import EngineCounters
from losscheck.jsonrecord import JsonRecord, json_field
from losscheck.plan.perf_profiles import EngineSizes
from losscheck.report.manifest import Environment
from losscheck.report.perf_record import Speedup

SCHEMA = "losscheck.engine-perf/1"
LADDER, LONG_INPUT, LONG_OUTPUT = "ladder", "long-input", "long-output"


@dataclass(frozen=True)
class Side(JsonRecord):
    """One side (speculation on or off) of a rung, over its timed runs."""

    OMIT_NONE = True

    output_tokens: tuple[int, ...]  # per timed run
    throughput_tok_s: tuple[float, ...]  # per timed run
    # {"ttft", "tpot", "itl", "e2e"} → {"p50", "p95", "p99", "mean", "std"}, runs pooled (older files: percentiles)
    latency_s: dict[str, dict[str, float]]
    peak_memory_mib: float | None = field(
        default=None, metadata=json_field(doc="the largest of its timed runs' peaks (the file's memory_source)")
    )


@dataclass(frozen=True)
class EngineRung(JsonRecord):
    """The engine at one concurrency on one workload with one arrival process: its runs with
    speculation off and on of the same requests and seeds, taken in pairs (off, then on) or, for
    an engine that keeps one instance alive at a time, every off run first (`paired` False)."""

    OMIT_NONE = True

    workload: str  # LADDER, LONG_INPUT or LONG_OUTPUT
    arrivals: str  # `losscheck.plan.arrivals.Arrivals.label`
    concurrency: int
    k: int  # the block length drafted (an engine's own, or a `--losscheck-perf-k` value)
    requests: int
    distinct_prompts: int
    prompt_tokens: float  # mean prompt length
    max_new: int  # the largest output budget
    repeats: int
    off: Side
    on: Side
    speedup: Speedup  # output throughput, on over off: Student's t on paired log ratios, else Welch's t
    paired: bool
    counters: EngineCounters | None = None  # the engine's own, summed over the timed runs with speculation on
    tau: float | None = field(default=None, metadata=json_field(doc="tokens per speculative round"))
    cumulative_acceptance: tuple[float | None, ...] = field(
        default=(), metadata=json_field(doc=f"cumulative, per position: {acceptance.CUMULATIVE}")
    )
    conditional_acceptance: tuple[float | None, ...] = field(
        default=(), metadata=json_field(doc=f"conditional, per position: {acceptance.CONDITIONAL}")
    )
    wasted_fraction: float | None = field(
        default=None, metadata=json_field(doc="drafted tokens that verification rejected, of all drafted")
    )


@dataclass(frozen=True)
class EnginePerfFile(JsonRecord):
    """An engine perf run: the sentence it supports, its environment, the engine's identity and
    pins, the target, the sizes, and every rung measured."""

    OMIT_NONE = True

    schema: str
    created: str  # ISO 8601, UTC
    statement: str  # the conditional statement the run supports (`losscheck.perf.engine_suite.statement`)
    environment: Environment
    engine: dict[str, object]  # name, k, precision, package and version, draft model hash, options
    target: dict[str, object]
    streamed: bool  # True: emissions timed as the engine gave them; False: whole calls (TTFT = e2e)
    counters_source: str  # where τ and acceptance come from
    profile: str
    sizes: EngineSizes
    params: str  # the sampling parameters' label
    seed: int
    rungs: tuple[EngineRung, ...]
    memory_source: str | None = None  # what the sides' peak_memory_mib measured (`losscheck.perf.memory`)
