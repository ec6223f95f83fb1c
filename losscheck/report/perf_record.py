"""The records of a perf run file (`perf.json`, schema `losscheck.perf/1`): a rung's figures, the
speedup and where it comes from, the HF peer, and the run around them.

Written by `losscheck.perf.suite`, read by the report (`losscheck.report.perf`) and by the
regression compare (`losscheck.report.perf_run`); the JSON keys are those of the files written
before these records existed, so saved runs stay comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from losscheck import acceptance
from losscheck.jsonrecord import JsonRecord, json_field
from losscheck.plan.perf_profiles import PerfProfile
from losscheck.report.manifest import Environment

SCHEMA = "losscheck.perf/1"
BASELINE = "baseline"  # the engine name of plain target decoding


@dataclass(frozen=True)
class Speedup(JsonRecord):
    """Spec over baseline throughput: the ratio of geometric means over repeated runs and its
    confidence interval on log throughputs (Student's t on the log ratios of paired runs, Welch's t
    otherwise); NaN bounds with fewer than two runs a side."""

    ratio: float
    low: float = field(metadata=json_field(name="ci_low"))
    high: float = field(metadata=json_field(name="ci_high"))
    level: float

    def label(self) -> str:
        return f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"


@dataclass(frozen=True)
class Sources(JsonRecord):
    """Where a speedup comes from (`losscheck.perf.model.Decomposition`): τ, the round's costs in
    baseline target steps, and the predicted speedup τ / (draft cost + verify cost)."""

    tau: float
    step_s: float
    draft_s: float
    verify_s: float
    draft_cost: float
    verify_cost: float
    predicted: float


@dataclass(frozen=True)
class PerRound(JsonRecord):
    """Seconds per decode round: drafting, target forwards, the engine's own time, the whole round."""

    draft_s: float
    verify_s: float
    overhead_s: float
    round_s: float


@dataclass(frozen=True)
class Rung(JsonRecord):
    """One engine (the baseline or a drafter) at one concurrency on one workload, its timed runs
    pooled. A drafter's rung also has its paired baseline's throughputs, its speedup over them and
    the speedup's sources; the baseline's rung has none of the three."""

    OMIT_NONE = True

    engine: str
    concurrency: int
    workload: str  # "ladder", "short" or an entropy tier
    k: int  # 0 for the baseline
    requests: int
    distinct_prompts: int
    repeats: int
    output_tokens: tuple[int, ...]  # per timed run
    throughput_tok_s: tuple[float, ...]  # per timed run
    latency_s: dict[str, dict[str, float]]  # {"ttft", "tpot", "itl", "e2e"} → {"p50", "p95", "p99"}
    tau: float
    # [k] per slot, () for the baseline; terms as `losscheck.acceptance` defines them
    cumulative_acceptance: tuple[float, ...] = field(
        metadata=json_field(name="slot_acceptance", doc=f"cumulative, per slot: {acceptance.CUMULATIVE}")
    )
    wasted_fraction: float
    rounds: int
    per_round: PerRound
    draft_time_fraction: float
    verify_time_fraction: float
    overhead_fraction: float
    prefill_fraction: float
    memory: dict[str, int | None]  # bytes of weights and KV caches; device peak on CUDA only
    baseline_tok_s: tuple[float, ...] | None = None
    speedup: Speedup | None = None
    decomposition: Sources | None = None
    conditional_acceptance: tuple[float | None, ...] = field(
        default=(), metadata=json_field(doc=f"conditional, per slot: {acceptance.CONDITIONAL}")
    )

    @property
    def key(self) -> tuple[str, int, str]:
        return self.engine, self.concurrency, self.workload

    def conditional(self) -> tuple[float | None, ...]:
        """[k] `acceptance.CONDITIONAL`: as recorded, or (perf.json written before 2026-12-03) the
        ratios of successive cumulative rates, exact when every round proposed k drafts."""
        if self.conditional_acceptance or not self.cumulative_acceptance:
            return self.conditional_acceptance
        cumulative = self.cumulative_acceptance
        return tuple(c / r if r else None for c, r in zip(cumulative, (1.0, *cumulative[:-1])))


@dataclass(frozen=True)
class Peer(JsonRecord):
    """Hugging Face assisted generation against its own plain `generate`, with losscheck's loop
    beside it, at concurrency 1 on the same requests."""

    drafter: str
    k: int
    concurrency: int
    requests: int
    hf_plain_tok_s: tuple[float, ...]
    hf_assisted_tok_s: tuple[float, ...]
    hf_speedup: Speedup
    ours_speedup: Speedup
    ours_spec_tok_s: tuple[float, ...]
    ours_baseline_tok_s: tuple[float, ...]


@dataclass(frozen=True)
class PerfRunFile(JsonRecord):
    """A perf run: its environment, the models' identities, the profile and every rung measured."""

    schema: str
    created: str  # ISO 8601, UTC
    environment: Environment
    target: dict[str, object]  # name and the model's own identity (path, sha256, precision)
    drafters: dict[str, dict[str, object]]  # by the name the run gives it
    profile: PerfProfile
    params: str  # the sampling parameters' label
    seed: int
    rungs: tuple[Rung, ...]
    peer: Peer | None = None

    def ladder(self, spec: bool = True) -> list[Rung]:
        """The drafters' (`spec`) or the baseline's rungs on the ladder workload, by engine and concurrency."""
        rows = [r for r in self.rungs if r.workload == "ladder" and (r.engine != BASELINE) == spec]
        return sorted(rows, key=lambda r: (r.engine, r.concurrency))
