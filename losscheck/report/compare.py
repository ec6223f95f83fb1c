"""`losscheck compare A B`: what changed between two certificates (a release against the previous).

Per cell of either matrix: status in A and in B, and the acceptance length τ (pooled over prompt
groups) in each with the difference. A regression is a cell that passed in A and does not pass in
B, or a verdict that got worse; acceptance changes are reported, never judged (τ moves with the
drafter, and that is the point of a new release).

Both certificates must be of the same things, by their identities: the same target (content
hash) wherever both name one, the same drafters (names and kinds: class, algorithm) and the same
black-box engine, pinned alike (its package versions, its draft model's hash, its options), run
on the same torch, CUDA, driver and device count (`losscheck.engines.pins`; a pin only one of the
two records is not compared). A drafter whose weights changed is compared as a new release of it, and the
report says so first; anything else different is refused (`DifferentRunsError`) unless the
caller allows it, and then the report opens with what differs.
"""

from __future__ import annotations

from losscheck.cells.record import CellRecord
from losscheck.errors import LosscheckError
from losscheck.plan.cell import ORACLE
from losscheck.report.document import Certificate
from losscheck.report.manifest import Identity
from losscheck.report.markdown import markdown_table

KIND_FIELDS = ("class", "algorithm")  # what kind of drafter an identity names, beyond its weights


class DifferentRunsError(LosscheckError):
    """Two certificates of different targets, drafters or engines: their differences are not a change."""


def _hash(identity: Identity | None) -> str | None:
    identity = identity or {}
    digest = identity.get("sha256") or identity.get("weights_sha256")
    return digest if isinstance(digest, str) else None


def _short(digest: str | None) -> str:
    return "unhashed" if not digest else f"{digest[:12]}…"


def identity_differences(a: Certificate, b: Certificate) -> tuple[list[str], list[str]]:
    """(what makes `a` and `b` certificates of different things, the drafters whose weights changed)."""
    different, changed = [], []
    targets_a, targets_b = a.targets, b.targets
    for name in sorted(set(targets_a) & set(targets_b)):
        if _hash(targets_a[name]) != _hash(targets_b[name]):
            different.append(
                f"target {name}: sha256 {_short(_hash(targets_a[name]))} before, {_short(_hash(targets_b[name]))} after"
            )
    drafters_a, drafters_b = a.drafters, b.drafters
    for target in sorted(set(drafters_a) & set(drafters_b)):
        da = {k: v for k, v in drafters_a[target].items() if k != ORACLE}
        db = {k: v for k, v in drafters_b[target].items() if k != ORACLE}
        if set(da) != set(db):
            before, after = ", ".join(sorted(da)) or "none", ", ".join(sorted(db)) or "none"
            different.append(f"drafters on {target}: {before} before, {after} after")
            continue
        for key in sorted(da):
            kinds = [(f, da[key].get(f), db[key].get(f)) for f in KIND_FIELDS if da[key].get(f) != db[key].get(f)]
            if kinds:
                different += [f"drafter {key} on {target}: {f} {x!r} before, {y!r} after" for f, x, y in kinds]
            elif _hash(da[key]) != _hash(db[key]):
                changed.append(
                    f"drafter {key} on {target}: weights {_short(_hash(da[key]))} before, {_short(_hash(db[key]))} "
                    f"after ({da[key].get('name')} -> {db[key].get('name')}), compared as a new release of it"
                )
    engine_a, engine_b = a.engine, b.engine
    if (engine_a or {}).get("name") != (engine_b or {}).get("name"):
        name_a, name_b = (engine_a or {}).get("name", "none"), (engine_b or {}).get("name", "none")
        different.append(f"black-box engine: {name_a} before, {name_b} after")
    elif engine_a is not None and engine_b is not None:
        different += pin_differences(engine_a, engine_b)
    return different + runtime_differences(a, b), changed


RUNTIME_PINS = ("torch", "cuda", "driver", "device_count")  # of the run's environment


def pin_differences(a: Identity, b: Identity) -> list[str]:
    """What two identities of the same engine pin differently: package versions, the draft
    model's content hash, the options."""
    found = []
    draft_a, draft_b = a.get("draft_model"), b.get("draft_model")
    if isinstance(draft_a, dict) and isinstance(draft_b, dict) and _hash(draft_a) != _hash(draft_b):
        found.append(f"engine draft model: sha256 {_short(_hash(draft_a))} before, {_short(_hash(draft_b))} after")
    for key in ("package", "options"):
        if key in a and key in b and a[key] != b[key]:
            found.append(f"engine {key}: {a[key]!r} before, {b[key]!r} after")
    return found


def runtime_differences(a: Certificate, b: Certificate) -> list[str]:
    """Torch, CUDA, driver and device count, where both certificates record them."""
    found = []
    for key in RUNTIME_PINS:
        x, y = getattr(a.environment, key), getattr(b.environment, key)
        if x is not None and y is not None and x != y:
            found.append(f"{key}: {x} before, {y} after")
    return found


# Worse to the right: a verdict moving right between A and B is a regression.
VERDICT_ORDER = ("PASS", "PARTIAL", "INTERRUPTED", "FAIL")


def pooled_tau(record: CellRecord | None) -> float | None:
    """Tokens per round over every prompt group of a cell (None: no acceptance counters)."""
    groups = [g for g in (record.acceptance.values() if record is not None else ()) if g.acceptance_length is not None]
    rounds = sum(g.row_rounds for g in groups)
    if not rounds:
        return None
    return sum((g.acceptance_length or 0.0) * g.row_rounds for g in groups) / rounds


def compare(a: Certificate, b: Certificate) -> tuple[list[list[str]], list[str]]:
    """(table rows, regressions) between certificates `a` (before) and `b` (after)."""
    status_a: dict[str, str] = {m.cell: m.status for m in a.matrix}
    status_b: dict[str, str] = {m.cell: m.status for m in b.matrix}
    record_a = {r.cell: r for r in a.cells}
    record_b = {r.cell: r for r in b.cells}
    regressions = []
    if VERDICT_ORDER.index(b.verdict) > VERDICT_ORDER.index(a.verdict):
        regressions.append(f"verdict {a.verdict} -> {b.verdict}")
    rows = []
    for cell in list(dict.fromkeys([*status_a, *status_b])):
        sa, sb = status_a.get(cell, "absent"), status_b.get(cell, "absent")
        ta, tb = pooled_tau(record_a.get(cell)), pooled_tau(record_b.get(cell))
        delta = f"{tb - ta:+.3f}" if ta is not None and tb is not None else "-"
        rows.append([cell, sa, sb, _fmt(ta), _fmt(tb), delta])
        if sa == "passed" and sb != "passed":
            regressions.append(f"cell {cell}: passed -> {sb}")
    return rows, regressions


def report(a: Certificate, b: Certificate, allow_different: bool = False) -> tuple[str, bool]:
    """Markdown comparing `a` and `b`, and whether `b` regressed. Certificates of different things
    (`identity_differences`) raise `DifferentRunsError` unless `allow_different`."""
    different, changed = identity_differences(a, b)
    if different and not allow_different:
        raise DifferentRunsError(
            "the certificates are of different things, so their differences are not a change: "
            + "; ".join(different)
            + ". Compare runs of the same target and drafters, or pass --allow-different to compare them anyway"
        )
    rows, regressions = compare(a, b)
    lines = [
        f"# losscheck compare: {a.verdict} ({a.created}) -> {b.verdict} ({b.created})",
        "",
        *(f"- WARNING: not the same run's things: {d}" for d in different),
        *(f"- CHANGED: {c}" for c in changed),
        *(f"- REGRESSION: {r}" for r in regressions),
        *([] if regressions else ["- no regression: every cell that passed before passes now"]),
        "",
        markdown_table(("cell", "before", "after", "tau before", "tau after", "delta tau"), rows),
    ]
    return "\n".join(lines) + "\n", bool(regressions)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
