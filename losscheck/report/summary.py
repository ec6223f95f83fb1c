"""The per-cell table, shared by the terminal summary and the Markdown report."""

from __future__ import annotations

from typing import Any

from losscheck.report import markdown

COLUMNS = ("cell", "kind", "verdict", "tau", "min p", "alpha", "detect TV", "n", "s")


def _row(record: dict[str, Any]) -> tuple[str, ...]:
    verdict = "PASS" if record.get("passed") else ("ERROR" if record.get("outcome") == "error" else "FAIL")
    if record.get("near_ties"):  # reduced-precision greedy divergences within round-off
        verdict += f" ({record['near_ties']} near-ties)"
    groups = (record.get("acceptance") or {}).values()  # prompt group -> loop counters
    tau = "/".join(f"{g['acceptance_length']:.2f}" for g in groups) or "-"
    results = (record.get("verdict") or {}).get("results", [])
    tested = [r for r in results if r.get("alpha")]
    min_p = f"{min(r['p_value'] for r in tested):.3g}" if tested else "-"
    alpha = f"{tested[0]['alpha']:.2g}" if tested else "-"
    # The effect the cell guarantees: its pooled tests' (stratified and conformance tests detect
    # other, narrower effects and would make the column read stronger than the guarantee).
    guarantee = [r for r in tested if r.get("scope", "pooled") == "pooled"]
    tvs = [r["detectable"].get("tv") for r in guarantee if r["detectable"].get("tv") is not None]
    tv = f"{min(tvs):.4f}" if tvs else "-"
    n = str(record.get("sequences", record.get("max_new_tokens", "-")))
    seconds = f"{record['seconds']:.1f}" if record.get("seconds") is not None else "-"
    return (record.get("cell", "?"), record.get("kind", "?"), verdict, tau, min_p, alpha, tv, n, seconds)


def junit_properties(record: dict[str, Any]) -> list[tuple[str, str]]:
    """The compact per-cell properties for JUnit XML: verdict, smallest p, detectable TV, τ."""
    row = dict(zip(COLUMNS, _row(record)))
    return [
        (f"losscheck_{name.lower().replace(' ', '_')}", row[name])
        for name in ("verdict", "min p", "detect TV", "tau", "n")
    ]


def summary_rows(records: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [_row(r) for r in sorted(records, key=lambda r: (r.get("kind", ""), r.get("cell", "")))]


def summary_lines(records: list[dict[str, Any]]) -> list[str]:
    rows = [COLUMNS, *summary_rows(records)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    failed = sum(1 for r in records if not r.get("passed"))
    lines.append(f"{len(records) - failed}/{len(records)} cells passed")
    return lines


def markdown_table(records: list[dict[str, Any]]) -> str:
    """The per-cell table as Markdown, for the certificate."""
    return markdown.markdown_table(COLUMNS, summary_rows(records))
