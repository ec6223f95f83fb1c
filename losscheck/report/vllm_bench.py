"""An engine perf run (`perf.json`, `losscheck.report.engine_perf_record`) in the terms of
`vllm bench serve --save-result`: one flat result per rung and side (speculation off, on), with
its keys — `request_rate`, `burstiness`, `max_concurrency`, `completed`, `duration`,
`request_throughput`, `output_throughput`, `total_token_throughput` and, for ttft, tpot, itl and
e2el, `mean_*_ms`, `median_*_ms`, `std_*_ms`, `p95_*_ms`, `p99_*_ms` — so that the tools that read
vLLM's results read losscheck's.

What differs, said in each result: a rung's figures are over its `repeats` timed runs — the
latency percentiles of every run's requests pooled, the counts and durations the mean of one run —
where a vLLM result is one run; a record written before the mean and standard deviation were kept
has no `mean_*_ms` or `std_*_ms`, and they are left out rather than guessed; a burst arrival
process (`burst:SIZE@SEC`) has no `burstiness` in vLLM's gamma sense (null), its `request_rate`
the mean, SIZE / SEC; `gamma:RATE@B` and `poisson:RATE` are vLLM's `--request-rate RATE
--burstiness B` (B = 1 for Poisson).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from losscheck.plan.arrivals import parse_arrivals
from losscheck.report.engine_perf_record import EnginePerfFile, EngineRung, Side

# losscheck's latency names -> vLLM's
METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}
# losscheck's statistic names -> vLLM's key prefixes
STATISTICS = {"mean": "mean", "p50": "median", "std": "std", "p95": "p95", "p99": "p99"}


def rung_result(doc: EnginePerfFile, rung: EngineRung, speculative: bool) -> dict[str, object]:
    """One rung's side (`speculative`: on, else off) as a `vllm bench serve` result."""
    side = rung.on if speculative else rung.off
    arrivals = parse_arrivals(rung.arrivals)[0]
    rate = {"closed": math.inf, "poisson": arrivals.rate, "gamma": arrivals.rate}.get(
        arrivals.kind, arrivals.size / arrivals.period if arrivals.period > 0 else math.inf
    )
    duration = _mean([tokens / tps for tokens, tps in zip(side.output_tokens, side.throughput_tok_s) if tps > 0])
    output_tokens = _mean(side.output_tokens)
    input_tokens = rung.requests * rung.prompt_tokens
    result: dict[str, object] = {
        "date": doc.created,
        "backend": str(doc.engine.get("name")),
        "label": f"losscheck {rung.workload} {rung.arrivals} c{rung.concurrency} k{rung.k} speculation "
        + ("on" if speculative else "off"),
        "model_id": str(doc.target.get("name")),
        "num_prompts": rung.requests,
        "request_rate": rate,
        "burstiness": None if arrivals.kind == "burst" else arrivals.burstiness,
        "max_concurrency": rung.concurrency,
        "completed": rung.requests,
        "duration": duration,
        "total_input_tokens": round(input_tokens),
        "total_output_tokens": round(output_tokens),
        "request_throughput": rung.requests / duration if duration > 0 else math.nan,
        "output_throughput": _mean(side.throughput_tok_s),
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
    }
    result.update(_latencies(side))
    result["losscheck"] = {
        "runs": rung.repeats,
        "pooled": "latency percentiles pool every timed run's requests; counts and durations are one run's mean",
        "speculative": speculative,
        "tau": rung.tau if speculative else None,
        "speedup": rung.speedup.to_json(),
        "params": doc.params,
        "seed": doc.seed,
        "streamed": doc.streamed,
    }
    return result


def _latencies(side: Side) -> dict[str, float]:
    found = {}
    for ours, theirs in METRICS.items():
        stats = side.latency_s.get(ours, {})
        for stat, prefix in STATISTICS.items():
            if stat in stats:
                found[f"{prefix}_{theirs}_ms"] = stats[stat] * 1e3
    return found


def _mean(values: tuple[float, ...] | list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def export(doc: EnginePerfFile, out: Path) -> list[Path]:
    """Write every rung's two sides under `out` as `vllm bench serve` result files; return them."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for rung in doc.rungs:
        for speculative in (False, True):
            name = f"{rung.workload}-{rung.arrivals.replace(':', '').replace('@', 'at')}-c{rung.concurrency}-k{rung.k}"
            path = out / f"{name}-{'on' if speculative else 'off'}.json"
            path.write_text(json.dumps(rung_result(doc, rung, speculative), indent=1, allow_nan=True))
            written.append(path)
    return written
