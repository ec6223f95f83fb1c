"""A saved engine perf run (`perf.json`, schema `losscheck.engine-perf/1`) and the regression
compare of `--losscheck-perf-compare=RUN` for an engine, as `losscheck.report.perf_run` does for
losscheck's own loop: rungs matched by (workload, arrival process, concurrency, k), each failing
when its speedup (or τ, where the engine counts rounds) fell by more than the threshold of
`--losscheck-perf-compare-fail`; a rung in only one of the runs is not compared.
"""

from __future__ import annotations

from pathlib import Path

from losscheck.errors import flag
from losscheck.plan.perf_profiles import Threshold
from losscheck.report.engine_perf_record import SCHEMA, EnginePerfFile, EngineRung
from losscheck.report.perf_run import Comparison, read_run


def load(path: str | Path, said: str | None = None) -> EnginePerfFile:
    """A saved engine run (a run directory or its perf.json), through `perf_run.read_run`; `said`
    names what pointed at it (default: `--losscheck-perf-compare`)."""
    said = said or f"{flag('perf-compare')}={str(path)!r}"
    return read_run(path, EnginePerfFile, SCHEMA, said, "`losscheck perf --engine`", "engine_perf_run")


def _key(rung: EngineRung) -> tuple[str, str, int, int]:
    return rung.workload, rung.arrivals, rung.concurrency, rung.k


def _metric(rung: EngineRung, name: str) -> float | None:
    return rung.speedup.ratio if name == "speedup" else rung.tau


def compare(now: EnginePerfFile, saved: EnginePerfFile, thresholds: tuple[Threshold, ...]) -> list[Comparison]:
    """Every rung of `now` that `saved` also has, against each threshold whose figure both runs
    have (τ only where the engine counts its rounds)."""
    old = {_key(r): r for r in saved.rungs}
    found = []
    for rung in now.rungs:
        before = old.get(_key(rung))
        if before is None:
            continue
        for t in thresholds:
            was, is_now = _metric(before, t.metric), _metric(rung, t.metric)
            if was is None or is_now is None:
                continue
            where = f"{rung.workload} {rung.arrivals} k{rung.k}"
            found.append(
                Comparison(str(now.engine.get("name")), rung.concurrency, where, t.metric, was, is_now, t.max_drop)
            )
    return found
