"""Figures of one timed run (`ServeTrace`) and of repeated runs: throughput, latency
percentiles, acceptance, where a round's time went; the speedup with its confidence interval.

Latency terms, per request (vLLM's benchmark uses the same): TTFT = first token − admission;
end-to-end = last token − admission; TPOT = (end-to-end − TTFT) / (output tokens − 1), for
requests with more than one token; ITL = gaps between consecutive emission events (a
speculative round emits several tokens in one event, so ITL is per chunk, not per token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy import stats as sstats

from losscheck.perf.serving import RequestTrace, ServeTrace
from losscheck.report.perf_record import Speedup

PERCENTILES = (50, 95, 99)


class Served(Protocol):
    """A timed run, of losscheck's loop (`ServeTrace`) or of an engine (`EngineTrace`)."""

    requests: list[RequestTrace]
    wall_s: float  # first admission to last completion


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """{"p50", "p95", "p99"} of `values` (numpy's linear interpolation); NaN when empty."""
    if not len(values):
        return {f"p{q}": math.nan for q in PERCENTILES}
    found = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, found)}


@dataclass(frozen=True)
class Latencies:
    """Per-request latency samples of a run, in seconds."""

    ttft: list[float]
    tpot: list[float]
    itl: list[float]
    e2e: list[float]

    @classmethod
    def of(cls, trace: Served) -> Latencies:
        ttft, tpot, itl, e2e = [], [], [], []
        for r in trace.requests:
            if not r.events:
                raise ValueError(
                    f"a request of the run emitted no token (budget {r.request.max_new}); the trace is incomplete"
                )
            times = [t for t, _ in r.events]
            ttft.append(times[0] - r.admitted)
            e2e.append(times[-1] - r.admitted)
            if r.output_tokens > 1:
                tpot.append((times[-1] - times[0]) / (r.output_tokens - 1))
            itl += np.diff(times).tolist()
        return cls(ttft, tpot, itl, e2e)

    def __add__(self, other: Latencies) -> Latencies:
        return Latencies(self.ttft + other.ttft, self.tpot + other.tpot, self.itl + other.itl, self.e2e + other.e2e)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per latency, its percentiles (`percentiles`) and its mean and standard deviation (numpy's,
        ddof 0, as `vllm bench serve` reports them); NaN when there are no samples."""
        return {name: _summary(getattr(self, name)) for name in ("ttft", "tpot", "itl", "e2e")}


def _summary(values: Sequence[float]) -> dict[str, float]:
    found = np.asarray(values, dtype=float)
    spread = (
        {"mean": float(found.mean()), "std": float(found.std())} if found.size else {"mean": math.nan, "std": math.nan}
    )
    return percentiles(values) | spread


def throughput(trace: Served) -> float:
    """Output tokens per second of wall time, first admission to last completion."""
    return sum(r.output_tokens for r in trace.requests) / trace.wall_s


def round_breakdown(trace: ServeTrace) -> dict[str, float]:
    """Seconds per decode round: drafting, target forwards (verify), engine overhead, whole
    round; and their fractions of a round, and prefill's fraction of the wall time."""
    n = max(trace.rounds, 1)
    per = {
        "draft_s": trace.draft_s / n,
        "verify_s": trace.verify_s / n,
        "overhead_s": trace.overhead_s / n,
        "round_s": trace.round_s / n,
    }
    whole = max(trace.round_s, 1e-12)
    per |= {
        "draft_fraction": trace.draft_s / whole,
        "verify_fraction": trace.verify_s / whole,
        "overhead_fraction": trace.overhead_s / whole,
        "prefill_fraction": trace.prefill_s / trace.wall_s,
    }
    return per


def speedup(spec: Sequence[float], base: Sequence[float], level: float = 0.95, paired: bool = False) -> Speedup:
    """Speedup of throughputs `spec` over `base` (tokens/s); `paired`: run i of each side was
    taken together (alternating), so the interval is on the per-pair log ratios."""
    if not spec or not base or min(*spec, *base) <= 0:
        raise ValueError(f"throughputs must be positive and non-empty, got spec={list(spec)} base={list(base)}")
    if paired and len(spec) != len(base):
        raise ValueError(f"paired runs need as many spec as baseline runs, got {len(spec)} and {len(base)}")
    a, b = np.log(spec), np.log(base)
    ratio = float(np.exp(a.mean() - b.mean()))
    if len(a) < 2 or len(b) < 2:
        return Speedup(ratio, math.nan, math.nan, level)
    test = sstats.ttest_1samp(a - b, 0.0) if paired else sstats.ttest_ind(a, b, equal_var=False)
    ci = test.confidence_interval(level)
    return Speedup(ratio, float(np.exp(ci.low)), float(np.exp(ci.high)), level)
