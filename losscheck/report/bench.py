"""Rendering of the benchmark results (`losscheck.perf.bench`): `bench.json` and `bench.md`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from losscheck.jsonrecord import JsonRecord
from losscheck.report.markdown import markdown_table

COLUMNS = ("batch", "params", "new tokens", "k", "baseline tok/s", "spec tok/s", "speedup", "tau", "draft time")


@dataclass(frozen=True)
class LoopRow(JsonRecord):
    """Generated tokens per second of the speculative loop and of the baseline, same prompts."""

    batch: int
    new_tokens: int
    k: int
    baseline_tokens_per_s: float
    spec_tokens_per_s: float
    acceptance_length: float
    draft_time_fraction: float
    speedup: float
    params: str  # the sampling parameters' label


@dataclass(frozen=True)
class SamplesPerSecond(JsonRecord):
    """Sampled sequences per second: losscheck's loop at batch 1024 against HF assisted generation
    (batch 1, its only batch)."""

    losscheck_batch1024: float
    hf_assisted_batch1: float
    ratio: float
    horizon: int
    k: int


@dataclass(frozen=True)
class BenchResults(JsonRecord):
    threads: int  # torch's threads
    torch: str
    rows: tuple[LoopRow, ...]
    samples_per_s: SamplesPerSecond


def write_report(results: BenchResults, out: Path) -> None:
    """Write `bench.json` and `bench.md` under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results.to_json(), indent=2))
    (out / "bench.md").write_text(markdown(results))


def markdown(results: BenchResults) -> str:
    """The loop-throughput table, then samples per second against Hugging Face assisted generation."""
    rows = [
        (
            r.batch,
            r.params,
            r.new_tokens,
            r.k,
            f"{r.baseline_tokens_per_s:.0f}",
            f"{r.spec_tokens_per_s:.0f}",
            f"{r.speedup:.2f}x",
            f"{r.acceptance_length:.2f}",
            f"{r.draft_time_fraction:.0%}",
        )
        for r in results.rows
    ]
    s = results.samples_per_s
    return (
        f"torch {results.torch}, {results.threads} threads; best of repeats after a warm-up.\n\n"
        + markdown_table(COLUMNS, rows)
        + f"\nSampled sequences per second ({s.horizon} tokens, T=1, k={s.k}): losscheck loop at batch 1024 "
        f"{s.losscheck_batch1024:.0f}/s; "
        f"Hugging Face assisted generation (batch 1) {s.hf_assisted_batch1:.1f}/s; "
        f"ratio {s.ratio:.0f}x.\n"
    )
