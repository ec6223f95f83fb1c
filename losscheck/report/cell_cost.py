"""What each cell of a certificate cost (`losscheck bench cells`): `cost.json` and `cost.md`.

Read off a written certificate (`certificate.json`: every cell record carries `seconds`,
`target_passes`, `target_tokens`, and a PIT cell its `phases`), so a run is timed once and any
saved run can be costed again. Seconds are each cell's own, summed over the xdist workers: the
certificate's cell-seconds exceed its wall time by up to the number of workers.

Terms: a *target pass* is one forward of the target (a scoring round, a prefill, a teacher-forced
pass); *target tokens* the token positions those passes computed; *tokens tested* the generated
tokens the cell's tests judged (`tokens_tested`); a PIT cell's *phases* are its request setup,
pilot sample, tested generation, teacher-forced scoring and conformance checks, and *other* the
rest of its seconds (statistics, the test's own setup).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from losscheck.cells.record import CellRecord
from losscheck.errors import LosscheckError
from losscheck.jsonrecord import JsonRecord
from losscheck.report import certificate
from losscheck.report.document import Certificate
from losscheck.report.markdown import markdown_table

SCHEMA = "losscheck.bench-cells/1"
PHASES = ("requests", "pilot", "generate", "score", "conformance")  # a PIT cell's, in run order
OTHER = "other"
FIX = "run `losscheck certify --out DIR` and pass its run directory, or `losscheck bench cells` without --from"
TIMED = ("seconds", "target_passes", "target_tokens")  # what every ran cell's record carries


def read(run: str | Path) -> tuple[Certificate, Path]:
    """The certificate of `run` (a run directory or its certificate.json) and its path, checked to
    carry what a cost table needs; a missing or garbled file is a `LosscheckError` naming it."""
    path = Path(run)
    path = path / "certificate.json" if path.is_dir() else path
    try:
        cert = certificate.load(path)
    except LosscheckError as exc:
        raise LosscheckError(f"{exc}; {FIX}") from None
    for r in cert.cells:
        missing = [key for key in TIMED if getattr(r.run, key) is None]
        if r.run.outcome != "error" and missing:
            raise LosscheckError(
                f"{str(path)!r}: cell {r.cell!r} has no {', '.join(missing)} (a certificate older than the "
                f"cost fields?); {FIX}"
            )
    return cert, path


def tokens_tested(record: CellRecord) -> int | None:
    """Generated tokens a cell's tests judged: an exact cell's sequences x horizon; a sampled
    cell's tested sample (its `*.support` test's n; the pilot, which only sizes the sample, is not
    counted); a greedy cell's prompts x max_new_tokens (compared token for token; a row that ends
    at EOS compares fewer). None when the record says neither."""
    facts = record.sample
    if record.kind == "exact" and facts.sequences is not None and facts.horizon is not None:
        return facts.sequences * facts.horizon
    results = record.verdict.results if record.verdict is not None else ()
    support = [t.n for t in results if t.name.endswith(".support")]
    if support:
        return max(support)
    if facts.prompts is not None and facts.max_new_tokens is not None:
        return facts.prompts * facts.max_new_tokens
    return None


@dataclass(frozen=True)
class CostRow:
    """One timed cell: kind, seconds, target passes and tokens, tokens tested, and for a PIT cell
    the seconds of each phase (`OTHER`: the rest) with their shares of the cell's seconds."""

    cell: str
    kind: str
    seconds: float
    target_passes: int
    target_tokens: int
    tokens_tested: int | None  # None: the record says nothing of it
    phases: dict[str, float]
    phase_shares: dict[str, float]


@dataclass(frozen=True)
class KindCost:
    cells: int
    seconds: float
    target_passes: int
    target_tokens: int
    tokens_tested: int


@dataclass(frozen=True)
class Totals:
    """The certificate's sums, by kind, and where its cell-seconds went. `shares`: the cells
    without phases by kind ("greedy cells"), the others by phase ("PIT generate") -> share of
    all cell-seconds, largest first; `phase_shares`: phase -> share of the phased cells' seconds."""

    cells: int
    cell_seconds: float
    target_passes: int
    target_tokens: int
    tokens_tested: int
    by_kind: dict[str, KindCost]
    phase_seconds: dict[str, float]
    phase_shares: dict[str, float]
    shares: dict[str, float]


@dataclass(frozen=True)
class Source:
    """The certificate a cost report reads."""

    path: str
    created: str
    verdict: str
    seed: int
    git_revision: str | None
    pytest_args: tuple[str, ...]
    workers: int | None


@dataclass(frozen=True)
class CostReport(JsonRecord):
    """cost.json: what each cell of a certificate cost."""

    schema: str
    certificate: Source
    wall_seconds: float | None  # the run's wall time when `losscheck bench` ran it
    untimed_cells: tuple[str, ...]
    totals: Totals
    cells: tuple[CostRow, ...]  # costliest first


def cell_row(record: CellRecord) -> CostRow:
    """A timed cell's row."""
    seconds = record.run.seconds or 0.0
    phases = dict(record.sample.phases or {})
    if phases:
        phases[OTHER] = max(seconds - sum(phases.values()), 0.0)
    return CostRow(
        cell=record.cell,
        kind=record.kind or "?",
        seconds=seconds,
        target_passes=record.run.target_passes or 0,
        target_tokens=record.run.target_tokens or 0,
        tokens_tested=tokens_tested(record),
        phases=phases,
        phase_shares={p: s / seconds if seconds else 0.0 for p, s in phases.items()},
    )


def totals(rows: Sequence[CostRow]) -> Totals:
    """The sums of `rows`, by kind and by phase."""
    kinds = sorted({r.kind for r in rows})
    by_kind = {
        kind: KindCost(
            cells=len(of),
            seconds=sum(r.seconds for r in of),
            target_passes=sum(r.target_passes for r in of),
            target_tokens=sum(r.target_tokens for r in of),
            tokens_tested=sum(r.tokens_tested or 0 for r in of),
        )
        for kind in kinds
        for of in [[r for r in rows if r.kind == kind]]
    }
    phased = [r for r in rows if r.phases]
    found = {p for r in phased for p in r.phases} - {*PHASES, OTHER}  # a phase newer than this table
    names = (*PHASES, *sorted(found), OTHER) if phased else ()
    phase_seconds = {p: sum(r.phases.get(p, 0.0) for r in phased) for p in names}
    parts = {f"{kind} cells": sum(r.seconds for r in rows if r.kind == kind and not r.phases) for kind in by_kind}
    parts = {name: s for name, s in parts.items() if s} | {f"PIT {p}": s for p, s in phase_seconds.items()}
    seconds, phased_seconds = sum(r.seconds for r in rows), sum(r.seconds for r in phased)
    return Totals(
        cells=len(rows),
        cell_seconds=seconds,
        target_passes=sum(r.target_passes for r in rows),
        target_tokens=sum(r.target_tokens for r in rows),
        tokens_tested=sum(r.tokens_tested or 0 for r in rows),
        by_kind=by_kind,
        phase_seconds=phase_seconds,
        phase_shares={p: s / phased_seconds for p, s in phase_seconds.items()} if phased_seconds else {},
        shares={name: s / seconds for name, s in sorted(parts.items(), key=lambda i: -i[1])} if seconds else {},
    )


def report(cert: Certificate, source: str | Path, wall_seconds: float | None = None) -> CostReport:
    """The cost report of `cert` (read from `source`); `wall_seconds`: the run's wall time when
    `losscheck bench` ran it, else None (a certificate does not record it)."""
    ran = [r for r in cert.cells if r.run.seconds is not None]
    rows = sorted((cell_row(r) for r in ran), key=lambda r: (-r.seconds, r.cell))
    env = cert.environment
    return CostReport(
        schema=SCHEMA,
        certificate=Source(
            path=Path(source).as_posix(),
            created=cert.created,
            verdict=cert.verdict,
            seed=cert.meta.seed,
            git_revision=env.git_revision,
            pytest_args=cert.meta.pytest_args,
            workers=len(env.workers) or None,
        ),
        wall_seconds=wall_seconds,
        untimed_cells=tuple(r.cell for r in cert.cells if r.run.seconds is None),
        totals=totals(rows),
        cells=tuple(rows),
    )


def headline(cost: CostReport) -> str:
    """One line: the run's size and where its cell-seconds went (the three largest shares)."""
    t, c = cost.totals, cost.certificate
    wall = f", {cost.wall_seconds:.0f} s wall" if cost.wall_seconds is not None else ""
    workers = f" over {c.workers} workers" if c.workers else ""
    top = ", ".join(f"{name} {share:.0%}" for name, share in list(t.shares.items())[:3])
    return (
        f"{t.cells} cells, {t.cell_seconds:.0f} cell-seconds{workers}{wall}; {t.target_passes:,} target "
        f"passes over {t.target_tokens:,} token positions; {t.tokens_tested:,} tokens tested; "
        f"largest shares of the cell-seconds: {top}"
    )


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _kind_rows(t: Totals) -> list[tuple[object, ...]]:
    """Per kind, then for all cells: cells, seconds, share of the cell-seconds, target passes and
    tokens, tokens tested."""
    whole = KindCost(t.cells, t.cell_seconds, t.target_passes, t.target_tokens, t.tokens_tested)
    seconds = t.cell_seconds or 1.0  # an all-zero run: shares of 0
    return [
        (name, k.cells, f"{k.seconds:.1f}", _share(k.seconds / seconds))
        + tuple(f"{n:,}" for n in (k.target_passes, k.target_tokens, k.tokens_tested))
        for name, k in [*t.by_kind.items(), ("all", whole)]
    ]


def markdown(cost: CostReport) -> str:
    """The headline, the totals by kind, the PIT phases, then one row per cell (costliest first)."""
    t, c = cost.totals, cost.certificate
    lines = [
        f"# Cell cost — {c.verdict} certificate of {c.created}",
        "",
        headline(cost),
        "",
        f"- certificate: `{c.path}` (git {c.git_revision or '-'}, seed {c.seed})",
        "- seconds are each cell's own, summed over the workers; shares of `other` are the cell's time "
        "outside its phases",
    ]
    if cost.untimed_cells:
        lines.append(f"- not timed (errored): {', '.join(f'`{x}`' for x in cost.untimed_cells)}")
    kind_columns = ("kind", "cells", "seconds", "share", "target passes", "target tokens", "tokens tested")
    lines += ["", markdown_table(kind_columns, _kind_rows(t))]
    if t.phase_shares:
        phases = [(p, f"{t.phase_seconds[p]:.1f}", _share(s)) for p, s in t.phase_shares.items()]
        lines += ["PIT cells by phase:", "", markdown_table(("phase", "seconds", "share of PIT seconds"), phases)]
    names = tuple(t.phase_seconds)
    columns = ("cell", "kind", "s", "target passes", "target tokens", "tokens tested", *names)
    rows = [
        (
            r.cell,
            r.kind,
            f"{r.seconds:.2f}",
            r.target_passes,
            f"{r.target_tokens:,}",
            "-" if r.tokens_tested is None else f"{r.tokens_tested:,}",
            *(_share(r.phase_shares.get(p)) for p in names),
        )
        for r in cost.cells
    ]
    lines += ["Per cell (phase columns: share of the cell's seconds):", "", markdown_table(columns, rows)]
    return "\n".join(lines)


def write(cost: CostReport, out: Path) -> list[Path]:
    """Write `cost.json` and `cost.md` under `out`; return them."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "cost.json", out / "cost.md"]
    paths[0].write_text(json.dumps(cost.to_json(), indent=2))
    paths[1].write_text(markdown(cost))
    return paths
