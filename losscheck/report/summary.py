"""The per-cell table, shared by the terminal summary and the Markdown report."""

from __future__ import annotations

from collections.abc import Sequence

from losscheck.cells.record import CellRecord
from losscheck.report import markdown

COLUMNS = ("cell", "kind", "verdict", "tau", "min p", "alpha", "detect TV", "n", "s")


def _row(record: CellRecord) -> tuple[str, ...]:
    outcome = record.run.outcome
    verdict = "PASS" if record.passed else {"error": "ERROR", "skipped": "NOT RUN"}.get(outcome, "FAIL")
    if record.near_ties:  # reduced-precision greedy divergences within round-off
        verdict += f" ({record.near_ties} near-ties)"
    groups = record.acceptance.values()  # prompt group -> loop counters
    tau = "/".join(f"{g.acceptance_length:.2f}" for g in groups if g.acceptance_length is not None) or "-"
    counted = record.sample.engine_counters  # a black-box engine's own counts
    if tau == "-" and counted is not None and counted.tau is not None:
        tau = f"{counted.tau:.2f}"
    results = record.verdict.results if record.verdict is not None else ()
    tested = [r for r in results if r.alpha]
    min_p = f"{min(r.p_value for r in tested):.3g}" if tested else "-"
    alpha = f"{tested[0].alpha:.2g}" if tested else "-"
    # The effect the cell guarantees: its pooled tests' (stratified and conformance tests detect
    # other, narrower effects and would make the column read stronger than the guarantee).
    tvs = [tv for r in tested if r.scope == "pooled" and (tv := r.detectable.get("tv")) is not None]
    detect_tv = f"{min(tvs):.4f}" if tvs else "-"
    facts = record.sample
    n = str(next((v for v in (facts.sequences, facts.max_new_tokens) if v is not None), "-"))
    seconds = f"{record.run.seconds:.1f}" if record.run.seconds is not None else "-"
    return (record.cell, record.kind or "?", verdict, tau, min_p, alpha, detect_tv, n, seconds)


def junit_properties(record: CellRecord) -> list[tuple[str, str]]:
    """The compact per-cell properties for JUnit XML: verdict, smallest p, detectable TV, τ."""
    row = dict(zip(COLUMNS, _row(record)))
    return [
        (f"losscheck_{name.lower().replace(' ', '_')}", row[name])
        for name in ("verdict", "min p", "detect TV", "tau", "n")
    ]


def summary_rows(records: Sequence[CellRecord]) -> list[tuple[str, ...]]:
    return [_row(r) for r in sorted(records, key=lambda r: (r.kind or "", r.cell))]


def summary_lines(records: Sequence[CellRecord]) -> list[str]:
    rows = [COLUMNS, *summary_rows(records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    failed = sum(1 for r in records if not r.passed)
    lines.append(f"{len(records) - failed}/{len(records)} cells passed")
    return lines


def markdown_table(records: Sequence[CellRecord]) -> str:
    """The per-cell table as Markdown, for the certificate."""
    return markdown.markdown_table(COLUMNS, summary_rows(records))
