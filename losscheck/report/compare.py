"""`losscheck compare A B`: what changed between two certificates (a release against the previous).

Per cell of either matrix: status in A and in B, and the acceptance length τ (pooled over prompt
groups) in each with the difference. A regression is a cell that passed in A and does not pass in
B, or a verdict that got worse; acceptance changes are reported, never judged (τ moves with the
drafter, and that is the point of a new release).
"""

from __future__ import annotations

from typing import Any

from losscheck.report.markdown import markdown_table

# Worse to the right: a verdict moving right between A and B is a regression.
VERDICT_ORDER = ("PASS", "PARTIAL", "INTERRUPTED", "FAIL")


def pooled_tau(record: dict[str, Any] | None) -> float | None:
    """Tokens per round over every prompt group of a cell (None: no acceptance counters)."""
    groups = list(((record or {}).get("acceptance") or {}).values())
    rounds = sum(g["row_rounds"] for g in groups)
    if not rounds:
        return None
    return sum(g["acceptance_length"] * g["row_rounds"] for g in groups) / rounds


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[list[str]], list[str]]:
    """(table rows, regressions) between certificates `a` (before) and `b` (after)."""
    status_a = {m["cell"]: m["status"] for m in a["matrix"]}
    status_b = {m["cell"]: m["status"] for m in b["matrix"]}
    record_a = {r["cell"]: r for r in a["cells"]}
    record_b = {r["cell"]: r for r in b["cells"]}
    regressions = []
    if VERDICT_ORDER.index(b["verdict"]) > VERDICT_ORDER.index(a["verdict"]):
        regressions.append(f"verdict {a['verdict']} -> {b['verdict']}")
    rows = []
    for cell in list(dict.fromkeys([*status_a, *status_b])):
        sa, sb = status_a.get(cell, "absent"), status_b.get(cell, "absent")
        ta, tb = pooled_tau(record_a.get(cell)), pooled_tau(record_b.get(cell))
        delta = f"{tb - ta:+.3f}" if ta is not None and tb is not None else "-"
        rows.append([cell, sa, sb, _fmt(ta), _fmt(tb), delta])
        if sa == "passed" and sb != "passed":
            regressions.append(f"cell {cell}: passed -> {sb}")
    return rows, regressions


def report(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, bool]:
    """Markdown comparing `a` and `b`, and whether `b` regressed."""
    rows, regressions = compare(a, b)
    lines = [
        f"# losscheck compare: {a['verdict']} ({a['created']}) -> {b['verdict']} ({b['created']})",
        "",
        *(f"- REGRESSION: {r}" for r in regressions),
        *([] if regressions else ["- no regression: every cell that passed before passes now"]),
        "",
        markdown_table(("cell", "before", "after", "tau before", "tau after", "delta tau"), rows),
    ]
    return "\n".join(lines) + "\n", bool(regressions)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
