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
from typing import Any

from losscheck.errors import OptionError, flag
from losscheck.plan.perf_profiles import (  # noqa: F401  (the compare's thresholds, parsed with the options)
    DEFAULT_COMPARE_FAIL,
    METRICS,
    Threshold,
    parse_thresholds,
)

SCHEMA = "losscheck.perf/1"


def save(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=True))


def load(path: str | Path) -> dict[str, Any]:
    """A saved run; a missing file, bad JSON or another schema raises `OptionError`."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise OptionError(
            f"{flag('perf-compare')}={str(path)!r}: no such file; pass a perf.json "
            "written by an earlier `pytest -m perf` or `losscheck perf`"
        ) from None
    except json.JSONDecodeError as exc:
        raise OptionError(f"{flag('perf-compare')}={str(path)!r} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise OptionError(f"{flag('perf-compare')}={str(path)!r} has schema {found!r}; this losscheck reads {SCHEMA}")
    return doc


def metric(rung: dict[str, Any], name: str) -> float:
    return float(rung["speedup"]["ratio"] if name == "speedup" else rung["tau"])


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


def compare(now: dict[str, Any], saved: dict[str, Any], thresholds: tuple[Threshold, ...]) -> list[Comparison]:
    """Every drafter rung of `now` that `saved` also has, against each threshold."""

    def key(r: dict[str, Any]) -> tuple[str, int, str]:
        return r["engine"], r["concurrency"], r["workload"]

    old = {key(r): r for r in saved["rungs"] if "speedup" in r}
    return [
        Comparison(*key(r), t.metric, metric(old[key(r)], t.metric), metric(r, t.metric), t.max_drop)
        for r in now["rungs"]
        if "speedup" in r and key(r) in old
        for t in thresholds
    ]


def environment_changes(now: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """What differs between the runs' machines, devices, libraries and models (shown with a
    comparison: a speedup measured elsewhere is not a regression of the drafter)."""
    keys = ("accelerator", "device", "torch", "transformers", "losscheck", "cpu_count")
    found = [
        f"{k}: {saved['environment'].get(k)} -> {now['environment'].get(k)}"
        for k in keys
        if saved["environment"].get(k) != now["environment"].get(k)
    ]
    for what in ("target",):
        if saved[what].get("sha256") != now[what].get("sha256"):
            found.append(f"{what}: {saved[what].get('name')} -> {now[what].get('name')} (another sha256)")
    return found
