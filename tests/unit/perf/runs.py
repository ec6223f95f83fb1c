"""Perf run files for the compare's tests: every field filled, figures chosen by the test."""

from __future__ import annotations

import dataclasses

from losscheck.plan.perf_profiles import PerfProfile
from losscheck.report.manifest import Environment
from losscheck.report.perf_record import BASELINE, SCHEMA, PerfRunFile, PerRound, Rung, Speedup

ENVIRONMENT = Environment(
    losscheck="0.1.0",
    git_revision=None,
    python="3.11",
    platform="Linux",
    machine="x86_64",
    cpu_count=2,
    torch="2",
    transformers="5",
    numpy="2",
    scipy="1",
    device="cpu",
    accelerator="cpu (x86_64)",
    worker="main",
    threads=1,
)


def rung(engine: str, concurrency: int, tau: float, speedup: float | None = None) -> Rung:
    """A ladder rung; a drafter's (with `speedup`, its CI ±10%) or the baseline's."""
    return Rung(
        engine=engine,
        concurrency=concurrency,
        workload="ladder",
        k=0 if speedup is None else 4,
        requests=8,
        distinct_prompts=8,
        repeats=3,
        output_tokens=(96, 96, 96),
        throughput_tok_s=(100.0, 100.0, 100.0),
        latency_s={},
        tau=tau,
        cumulative_acceptance=(),
        wasted_fraction=0.0,
        rounds=24,
        per_round=PerRound(0.001, 0.004, 0.0005, 0.0055),
        draft_time_fraction=0.18,
        verify_time_fraction=0.73,
        overhead_fraction=0.09,
        prefill_fraction=0.1,
        memory={},
        baseline_tok_s=None if speedup is None else (50.0, 50.0, 50.0),
        speedup=None if speedup is None else Speedup(speedup, speedup * 0.9, speedup * 1.1, 0.95),
    )


def run_file(speedup: float, tau: float, engine: str = "A", concurrency: int = 1, **changes: object) -> PerfRunFile:
    """A run with one drafter rung and its baseline rung; `changes` replace the run's fields."""
    run = PerfRunFile(
        schema=SCHEMA,
        created="2026-12-02T00:00:00+00:00",
        environment=ENVIRONMENT,
        target={"name": "t", "sha256": "x"},
        drafters={engine: {"name": engine}},
        profile=PerfProfile("quick"),
        params="T=1",
        seed=0,
        rungs=(rung(engine, concurrency, tau, speedup), rung(BASELINE, concurrency, 1.0)),
    )
    return dataclasses.replace(run, **changes)  # type: ignore[arg-type]
