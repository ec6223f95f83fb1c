"""The saved run (`perf.json`, schema `losscheck.perf/1`) and the regression compare of
`--losscheck-perf-compare=RUN`, with failure thresholds as pytest-benchmark's `--benchmark-compare-fail`:
`--losscheck-perf-compare-fail=speedup:10%,tau:5%` fails a rung whose speedup (or τ) fell by
more than that fraction of the saved value. Rungs are matched by (engine, concurrency, workload);
a rung in only one of the runs is not compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from losscheck.errors import LosscheckError, OptionError, flag
from losscheck.jsonrecord import R
from losscheck.plan.perf_profiles import (  # noqa: F401  (the compare's thresholds, parsed with the options)
    DEFAULT_COMPARE_FAIL,
    METRICS,
    Threshold,
    parse_thresholds,
)
from losscheck.report.perf_record import SCHEMA, PerfRunFile, Rung


def save(doc: PerfRunFile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc.to_json(), indent=1, allow_nan=True))


def read_run(path: str | Path, record: type[R], schema: str, said: str, written_by: str, where: str) -> R:
    """The run file at `path` (a run directory: its perf.json) as `record`, of schema `schema`; a
    missing file, bad JSON, another schema or a malformed record raises `OptionError`, opening with
    `said` (the option or command that named the file) and naming what writes such a file; `where`
    names the record's root in a malformed record's message."""
    path = Path(path)
    path = path / "perf.json" if path.is_dir() else path
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise OptionError(f"{said}: no such file; pass a perf.json written by {written_by}") from None
    except json.JSONDecodeError as exc:
        raise OptionError(f"{said} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise OptionError(f"{said} has schema {found!r}; this reads {schema}, written by {written_by}")
    try:
        return record.from_json(doc, where)
    except LosscheckError as exc:
        raise OptionError(f"{said} is no {schema} run file: {exc}") from None


def load(path: str | Path) -> PerfRunFile:
    """A saved run of the loop's perf tier (`--losscheck-perf-compare`), through `read_run`."""
    said = f"{flag('perf-compare')}={str(path)!r}"
    return read_run(path, PerfRunFile, SCHEMA, said, "an earlier `pytest -m perf` or `losscheck perf`", "perf_run")


def metric(rung: Rung, name: str) -> float:
    """A drafter rung's figure that the compare watches: its speedup ratio or its τ."""
    assert rung.speedup is not None, f"{rung.key} is the baseline's rung: it has no speedup"
    return rung.speedup.ratio if name == "speedup" else rung.tau


@dataclass(frozen=True)
class Comparison:
    engine: str
    concurrency: int
    workload: str
    metric: str
    saved: float
    now: float
    max_drop: float

    @property
    def drop(self) -> float:
        return 1 - self.now / self.saved

    @property
    def failed(self) -> bool:
        return self.drop > self.max_drop

    def line(self) -> str:
        verdict = "REGRESSED" if self.failed else "ok"
        return (
            f"{self.engine} c={self.concurrency} {self.workload}: {self.metric} {self.saved:.3f} -> {self.now:.3f} "
            f"({-self.drop:+.1%}, limit -{self.max_drop:.0%}) {verdict}"
        )


def compare(now: PerfRunFile, saved: PerfRunFile, thresholds: tuple[Threshold, ...]) -> list[Comparison]:
    """Every drafter rung of `now` that `saved` also has, against each threshold."""
    old = {r.key: r for r in saved.rungs if r.speedup is not None}
    return [
        Comparison(*r.key, t.metric, metric(old[r.key], t.metric), metric(r, t.metric), t.max_drop)
        for r in now.rungs
        if r.speedup is not None and r.key in old
        for t in thresholds
    ]


def environment_changes(now: PerfRunFile, saved: PerfRunFile) -> list[str]:
    """What differs between the runs' machines, devices, libraries and models (shown with a
    comparison: a speedup measured elsewhere is not a regression of the drafter)."""
    keys = ("accelerator", "device", "torch", "transformers", "losscheck", "cpu_count")
    found = [
        f"{k}: {getattr(saved.environment, k)} -> {getattr(now.environment, k)}"
        for k in keys
        if getattr(saved.environment, k) != getattr(now.environment, k)
    ]
    if saved.target.get("sha256") != now.target.get("sha256"):
        found.append(f"target: {saved.target.get('name')} -> {now.target.get('name')} (another sha256)")
    return found
