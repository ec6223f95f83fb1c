"""The certificate: `reports/<run>/certificate.json` (versioned schema), `summary.md` and plots.

A certificate never claims more than ran. It accounts for every cell of the full matrix (from the
processes' manifests, `losscheck.report.manifest`) as passed, failed, errored or not run, and its
verdict is

- PASS: every cell of the matrix ran and passed (and pytest exited 0);
- FAIL: a cell failed or errored, or pytest failed otherwise, or the run was configured with a mode
  lossy by design (`losscheck.engines.lossy`; the reason names it as such, not as a bug found);
- PARTIAL: nothing failed, but cells did not run (a `-k` selection, a shard) or the matrix is
  unknown (no certification test ran);
- INTERRUPTED: the run was stopped (Ctrl-C) before it finished, whatever had passed.

`account` reaches the verdict from the plan and the cell records; `build` and `losscheck merge`
(`losscheck.report.merge`, the shards of one plan joined) both use it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck import acceptance
from losscheck.cells.record import CellRecord
from losscheck.errors import flag
from losscheck.plan.entry import MatrixEntry
from losscheck.plan.scope import WHOLE
from losscheck.report import claims
from losscheck.report import shard as shards
from losscheck.report.document import (
    SCHEMA,
    BugClassClaim,
    Certificate,
    Conformance,
    Cost,
    Counts,
    MatrixRow,
    RunEnvironment,
    RunMeta,
    Scope,
    ShardRecord,
    Slowest,
    Status,
    Tested,
    Verdict,
    Worker,
)
from losscheck.report.manifest import Identity, Manifest, RegisteredTest
from losscheck.run.loading import lossy_configuration

if TYPE_CHECKING:
    from losscheck.plan.shard import Shard
    from losscheck.run.options import Options

VERDICTS = ("PASS", "FAIL", "PARTIAL", "INTERRUPTED")
STATUSES = ("passed", "failed", "errored", "not run")
__all__ = ["SCHEMA", "Certificate", "build", "load", "run_meta", "write_run"]


def run_meta(options: Options, pytest_args: list[str]) -> RunMeta:
    """What the controller knows about a run before any model loads."""
    return RunMeta(
        seed=options.seed,
        pytest_args=tuple(pytest_args),
        alpha_option=options.alpha,
        profile=options.profile,
        target_option=options.target,
        drafter_option=options.drafter,
        bundled_option=options.bundled,
        engine_option=options.engine,
        scope_option=None if options.scope.whole else options.scope.text,
        verifier_option=options.verifier,
        mutant=options.mutant,
        device_option=options.device,
        precisions=tuple(p.label() for p in options.precisions),
        strict=options.strict,
        lossy_modes=tuple(found.describe() for found in lossy_configuration(options, flag(""))),
    )


def build(
    meta: RunMeta,
    manifests: Sequence[Manifest],
    records: Sequence[CellRecord],
    exit_status: int,
    interrupted: bool,
    shard: Shard | None = None,
) -> Certificate:
    """The certificate of a run.

    meta: what the controller knows without models: seed, options, the pytest command line.
    manifests: one per process that ran certification tests (they must agree on the matrix).
    records: one per certification test that ran, skipped or errored.
    shard: the run's --shard, recorded with its share of the plan (when the matrix is known).
    """
    first = manifests[0] if manifests else None
    share = shards.record(shard, meta, first) if shard is not None and first is not None else None
    found = account(meta, [m.matrix for m in manifests], records, exit_status, interrupted, share=share)
    scope = Scope(
        meta.scope_option or WHOLE, not meta.scope_option, first.scope.out if first else (), len(found.matrix)
    )
    return Certificate(
        schema=SCHEMA,
        created=now(),
        scope=scope,
        shard=share,
        meta=meta,
        alpha=first.alpha if first else None,
        environment=_environment(manifests),
        targets=first.targets if first else {},
        drafters=first.drafters if first else {},
        engine=first.engine if first else None,
        pytest_exit_status=exit_status,
        **found.fields(),
    )


def now() -> str:
    """The time a certificate is built: UTC, ISO 8601, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Findings:
    """What a certificate says of its cells (its fields of the same names): every planned cell's
    status, the tally, the verdict with its reason and problems, what was tested and claimed, and
    what it cost."""

    verdict: Verdict
    reason: str
    problems: tuple[str, ...]
    counts: Counts
    tested: Tested
    conformance: Conformance
    bug_classes: dict[str, BugClassClaim]
    cost: Cost
    matrix: tuple[MatrixRow, ...]
    cells: tuple[CellRecord, ...]

    def fields(self) -> dict[str, Any]:
        """Field name -> value, as `Certificate` takes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def account(
    meta: RunMeta,
    planned: Sequence[Sequence[MatrixEntry]],
    records: Sequence[CellRecord],
    exit_status: int,
    interrupted: bool,
    problems: Sequence[str] = (),
    share: ShardRecord | None = None,
) -> Findings:
    """The verdict on the cells `planned` and what `records` found of them.

    planned: the matrix as each process planned it (they must agree); none: the matrix is unknown.
    records: one per certification test that ran, skipped or errored.
    exit_status, interrupted: how pytest ended (the worst of the shards' when they merge).
    problems: accounting problems found before (the shards'); this accounting's are added.
    share: the shard of the plan the run certified, whose other cells run elsewhere.
    """
    matrix, found = _matrix(planned, records)
    issues = [*problems, *found]
    counts = Counts(*(sum(1 for m in matrix if m.status == s) for s in STATUSES))
    if exit_status not in (0, 1, 5) and not interrupted:
        issues.append(f"pytest exited with status {exit_status} (an internal or usage error)")
    verdict, reason = _verdict(matrix, counts, issues, exit_status, interrupted, bool(planned), share)
    if meta.lossy_modes and verdict != "INTERRUPTED":
        verdict, reason = "FAIL", lossy_reason(meta.lossy_modes, counts.failed + counts.errored, reason)
    return Findings(
        verdict=verdict,
        reason=reason,
        problems=tuple(issues),
        counts=counts,
        tested=claims.tested(records),
        conformance=claims.conformance(records),
        bug_classes=claims.coverage(records, meta.profile.power),
        cost=cost(records),
        matrix=tuple(matrix),
        cells=tuple(records),
    )


def lossy_reason(modes: Sequence[str], failed: int, reason: str) -> str:
    """Why a run configured with a mode lossy by design FAILs whatever its cells found: the mode is
    named as the cause, its failed cells as that design, never as a bug found."""
    cells = (
        f"its {failed} failed or errored cells show that design, not a bug found"
        if failed
        else "its cells detecting no deviation at their power does not make it lossless"
    )
    return f"lossy by design: {'; '.join(modes)}, a mode not meant to keep the target's law; {cells} ({reason})"


def cost(records: Sequence[CellRecord]) -> Cost:
    """Seconds the cells took, in all, by kind and by phase of the PIT cells (summed over
    processes: under xdist more than the run's wall time), and the slowest cells."""
    timed = [(r, r.run.seconds) for r in records if r.run.seconds is not None]
    by_kind: dict[str, float] = {}
    for r, seconds in timed:
        by_kind[r.kind or "?"] = by_kind.get(r.kind or "?", 0.0) + seconds
    phases: dict[str, float] = {}
    for r in records:
        for phase, s in (r.sample.phases or {}).items():
            phases[phase] = phases.get(phase, 0.0) + s
    return Cost(
        cell_seconds=round(sum(seconds for _, seconds in timed), 1),
        target_passes=sum(r.run.target_passes or 0 for r in records),
        target_tokens=sum(r.run.target_tokens or 0 for r in records),
        by_kind={kind: round(s, 1) for kind, s in sorted(by_kind.items())},
        pit_phases={phase: round(s, 1) for phase, s in phases.items()},
        slowest=tuple(Slowest(r.cell, seconds) for r, seconds in sorted(timed, key=lambda rs: -rs[1])[:10]),
    )


def cost_lines(records: Sequence[CellRecord]) -> list[str]:
    """One line of what the cells cost (`cost`), for the terminal and the summary."""
    c = cost(records)
    if not c.cell_seconds:
        return []
    kinds = ", ".join(f"{kind} {s:.0f}" for kind, s in c.by_kind.items())
    phases = ", ".join(f"{phase} {s:.0f}" for phase, s in c.pit_phases.items())
    return [
        "",
        f"Cell time: {c.cell_seconds:.0f} s summed over workers ({kinds}); "
        f"{c.target_passes} target passes over {c.target_tokens:,} token positions"
        + (f"; PIT cells by phase: {phases}" if phases else ""),
    ]


def _matrix(
    matrices: Sequence[Sequence[MatrixEntry]], records: Sequence[CellRecord]
) -> tuple[list[MatrixRow], list[str]]:
    """Every planned cell with its status; records of cells outside the matrix are problems."""
    problems: list[str] = []
    planned = matrices[0] if matrices else ()
    if any(list(m) != list(planned) for m in matrices[1:]):
        problems.append(
            "the pytest processes planned different matrices (a drafter that declares "
            "different block lengths from run to run?); no cell can be accounted for"
        )
    status = {r.cell: r.status for r in records}
    why = {r.cell: r.run.skip_reason for r in records if r.run.skip_reason}
    matrix = [_row(entry, status.pop(entry.cell, "not run"), why.get(entry.cell)) for entry in planned]
    if matrices:
        problems += [f"cell {cell} ran but is not in the planned matrix" for cell in sorted(status)]
    else:  # nothing to account against: list what ran
        matrix = [MatrixRow(cell, s) for cell, s in sorted(status.items())]
    return matrix, problems


def _row(entry: MatrixEntry, status: Status, reason: str | None) -> MatrixRow:
    return MatrixRow(entry.cell, status, entry.mode, entry.argument, entry.slow, entry.estimated_s, reason)


def _verdict(
    matrix: list[MatrixRow],
    counts: Counts,
    problems: list[str],
    exit_status: int,
    interrupted: bool,
    known: bool,
    share: ShardRecord | None,
) -> tuple[Verdict, str]:
    ran = counts.passed + counts.failed + counts.errored
    tally = (
        f"{counts.passed} passed, {counts.failed} failed, {counts.errored} errored, "
        f"{counts.not_run} not run of {len(matrix)} cells"
    )
    if interrupted:
        return "INTERRUPTED", f"the run was interrupted: {tally}"
    if counts.failed or counts.errored or problems:
        return "FAIL", tally + ("; " + "; ".join(problems) if problems else "")
    if exit_status not in (0, 5):
        return "FAIL", f"{tally}; a test outside the matrix failed (pytest exit status {exit_status})"
    if not known:
        return "PARTIAL", f"no certification test ran, so the matrix is unknown ({ran} cells recorded)"
    if counts.not_run:
        missing = [m for m in matrix if m.status == "not run"]
        if share is not None and not {m.cell for m in missing} & set(share.cells):
            return "PARTIAL", (
                f"{tally}: shard {share.index}/{share.count} certifies {len(share.cells)} of them, the other "
                f"shards the {len(missing)} not run; `losscheck merge` joins the shards' run directories into "
                "one verdict of the whole scope"
            )
        if all(m.slow for m in missing):
            return "PARTIAL", (
                f"{tally}: the quick gate is complete; the {len(missing)} cells not run are the "
                "slow tier's (`pytest -m lossless` or `losscheck certify` runs every cell)"
            )
        unavailable = [m for m in missing if m.reason]
        if unavailable:
            return "PARTIAL", (
                f"{tally}: {len(unavailable)} could not run here ({unavailable[0].cell}: {unavailable[0].reason})"
            )
        return "PARTIAL", tally
    return (
        "PASS",
        f"{tally}: no deviation from the target detected above the effects listed (bug classes, pooled bound)",
    )


def _environment(manifests: Sequence[Manifest]) -> RunEnvironment:
    """The first process's environment, with each process's worker id and threads."""
    if not manifests:
        return RunEnvironment()
    per_process = ("worker", "threads")
    shared = {k: v for k, v in dataclasses.asdict(manifests[0].environment).items() if k not in per_process}
    return RunEnvironment(**shared, workers={m.environment.worker: Worker(m.environment.threads) for m in manifests})


def write_run(out: str | Path, cert: Certificate) -> Path:
    """Write the certificate, its Markdown summary and plots under `out`; return the run dir."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    run = Path(out) / f"{stamp}-seed{cert.meta.seed}"
    run.mkdir(parents=True, exist_ok=True)
    cert = relative_to_run(cert, run)
    (run / "certificate.json").write_text(json.dumps(finite(cert.to_json()), indent=2, allow_nan=False, default=str))
    render(cert, run)
    return run


def relative_to_run(cert: Certificate, run: Path, start: Path | None = None) -> Certificate:
    """`cert` with each model path that is not a bundled fixture made relative to the run
    directory `run` from the directory `start` they are relative to now (default: the current
    one, where the manifests give them from; a saved certificate's: its own run directory): a
    certificate moved with its models keeps pointing at them, and no absolute path of the machine
    that made it is written."""

    def moved(identity: Identity) -> Identity:
        path = identity.get("path")
        if not isinstance(path, str) or not path or path.startswith("bundled:"):
            return identity
        found = ((start or Path.cwd()) / path).resolve()
        return {**identity, "path": Path(os.path.relpath(found, run.resolve())).as_posix()}

    targets = {name: moved(t) for name, t in cert.targets.items()}
    drafters = {name: {k: moved(d) for k, d in ds.items()} for name, ds in cert.drafters.items()}
    return dataclasses.replace(cert, targets=targets, drafters=drafters)


def render(cert: Certificate, run: Path) -> list[Path]:
    """(Re)draw the plots and write summary.md of `cert` in `run`; return the files written."""
    from losscheck.report.plots import plot_certificate

    plots = plot_certificate(cert, run)
    (run / "summary.md").write_text(markdown(cert, [p.name for p in plots]))
    return [run / "summary.md", *plots]


def load(run: str | Path) -> Certificate:
    """A saved certificate: a run directory or its certificate.json."""
    from losscheck.errors import LosscheckError

    path = Path(run)
    path = path / "certificate.json" if path.is_dir() else path
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise LosscheckError(
            f"no certificate at {str(path)!r}; pass a run directory written by --losscheck-out"
        ) from None
    except json.JSONDecodeError as exc:
        raise LosscheckError(f"{str(path)!r} is not valid JSON ({exc})") from None
    found = doc.get("schema") if isinstance(doc, dict) else None
    if found != SCHEMA:
        raise LosscheckError(f"{str(path)!r} has schema {found!r}; this losscheck reads {SCHEMA!r}")
    try:
        return Certificate.from_json(doc, "certificate")
    except LosscheckError as exc:
        raise LosscheckError(f"{str(path)!r}: {exc}") from None


def finite(value: Any) -> Any:
    """NaN / inf (e.g. the acceptance of a never-proposed slot) become null: strict JSON."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def scope_line(cert: Certificate) -> str:
    """What the verdict covers: the declared scope and how many cells it leaves out, by reason."""
    scope = cert.scope
    if scope is None or scope.whole:
        cells = scope.cells if scope is not None and scope.cells is not None else len(cert.matrix)
        return f"scope: the whole matrix ({cells} cells)"
    reasons: dict[str, int] = {}
    for entry in scope.out:
        reasons[entry.reason] = reasons.get(entry.reason, 0) + 1
    out = "; ".join(f"{n} cells: {why}" for why, n in reasons.items()) or "no cell left out"
    return f"scope: {scope.declared} ({scope.cells or 0} cells in scope; out of scope: {out})"


def headline(cert: Certificate) -> str:
    scope = cert.scope
    of = "" if scope is None or scope.whole else f" of --scope={scope.declared}"
    return f"losscheck verdict: {cert.verdict}{of} — {cert.reason}"


def serving_lines(records: Sequence[CellRecord]) -> list[str]:
    """What the serving cells measured, as each serving axis summarises it (e.g. the split run's
    wall time, the prefix cache's hit rate)."""
    lines = []
    for r in sorted(records, key=lambda r: r.cell):
        facts = [str(f["summary"]) for f in r.serving_facts.values() if f.get("summary")]
        if facts:
            lines.append(f"- `{r.cell}`: " + "; ".join(facts))
    return ["", "Serving cells:", "", *lines] if lines else []


def engine_counter_lines(records: Sequence[CellRecord]) -> list[str]:
    """A black-box engine's own counters per cell: τ and both per-position acceptance curves."""
    lines = []
    for r in sorted(records, key=lambda r: r.cell):
        c = r.sample.engine_counters
        if c is None or not c.drafts:
            continue
        parts = [f"{c.drafts} drafts"] + [
            f"{n} {name}" for name, n in (("drafted", c.drafted), ("accepted", c.accepted)) if n is not None
        ]
        if c.tau is not None:
            parts.append(f"tau {c.tau:.2f}")
        if c.accepted_per_position is not None:
            parts.append(f"cumulative {acceptance.CUMULATIVE} {acceptance.shown(c.cumulative_acceptance())}")
            parts.append(f"conditional {acceptance.CONDITIONAL} {acceptance.shown(c.conditional_acceptance())}")
        lines.append(f"- `{r.cell}`: " + "; ".join(parts))
    return ["", "Engine counters (the engine's own, over the cell's speculative calls):", "", *lines] if lines else []


def markdown(cert: Certificate, plots: Sequence[str] = ()) -> str:
    from losscheck.report.summary import markdown_table

    meta = cert.meta
    lines = [f"# losscheck certificate — {cert.verdict}", "", scope_line(cert), "", cert.reason, ""]
    lines += [f"- {p}" for p in cert.problems]
    lines.append(f"- created: {cert.created}, seed {meta.seed} (replay with `--losscheck-seed={meta.seed}`)")
    lines += shard_lines(cert) or [f"- command: `pytest {shlex.join(meta.pytest_args)}`"]
    for name, target in cert.targets.items():
        lines.append(
            f"- target {name}: `{target.get('path')}` sha256 `{str(target.get('sha256'))[:16]}…` "
            f"({target.get('precision')})"
        )
    for name, drafters in cert.drafters.items():
        hashes = ", ".join(
            f"{key} `{str(d.get('sha256') or d.get('weights_sha256'))[:12]}`" for key, d in drafters.items()
        )
        lines.append(f"- drafters on {name}: {hashes}")
    engine = cert.engine
    if engine:
        lines.append(f"- engine: `{engine.get('name')}` (k = {engine.get('k')}, precision {engine.get('precision')})")
    alpha = cert.alpha
    if alpha:
        per_test = "-" if alpha.per_test is None else f"{alpha.per_test:.3g}"
        lines.append(
            f"- family-wise alpha {alpha.family} over the {alpha.statistical_tests} statistical "
            f"cells of the full matrix (per cell {per_test}, Bonferroni, fixed before any "
            "selection, then split evenly over each cell's tests)"
        )
        if alpha.tests:
            lines.append(f"- the statistical tests a sampled cell runs, by family: {_test_families(alpha.tests)}")
    lines += claims.lines(cert)
    env = cert.environment
    if env.workers:
        workers = ", ".join(f"{w}: {v.threads} threads" for w, v in env.workers.items())
        # "-": unknown, or (merged) the shards' runners differ in it: each shard's line names its own
        lines.append(
            f"- losscheck {env.losscheck or '-'} (git {env.git_revision or '-'}), python {env.python or '-'}, "
            f"torch {env.torch or '-'}, transformers {env.transformers or '-'}; {env.accelerator or '-'}; {workers}"
        )
    lines += ["", markdown_table(cert.cells)]
    lines += serving_lines(cert.cells) + engine_counter_lines(cert.cells) + cost_lines(cert.cells)
    missing = [m.cell for m in cert.matrix if m.status == "not run"]
    if missing:
        lines += ["", f"Not run ({len(missing)}): " + ", ".join(f"`{c}`" for c in missing)]
    out = cert.scope.out if cert.scope is not None else ()
    if out:
        lines += [
            "",
            f"Out of the declared scope ({len(out)}): " + ", ".join(f"`{e.cell}` ({e.reason})" for e in out),
        ]
    lines += ["", *[f"![{p}]({p})" for p in plots]]
    return "\n".join(lines).rstrip() + "\n"


def shard_lines(cert: Certificate) -> list[str]:
    """The shard a run certified, or the shards a merged certificate joined, each with its command."""
    if cert.shard is not None:
        s = cert.shard
        return [
            f"- command: `pytest {shlex.join(cert.meta.pytest_args)}`",
            f"- shard {s.index}/{s.count} of plan `{s.plan[:16]}…`: {len(s.cells)} of the "
            f"{len(cert.matrix)} cells in scope; `losscheck merge` joins the shards' run directories",
        ]
    if not cert.merged:
        return []
    lines = [
        f"- merged by `losscheck merge` from {len(cert.merged)} shards of plan `{cert.merged[0].shard.plan[:16]}…`:"
    ]
    for m in cert.merged:
        env = m.environment
        lines.append(
            f"  - shard {m.shard.index}/{m.shard.count} (`{m.run}`, {m.verdict}, {len(m.shard.cells)} cells, "
            f"created {m.created}; losscheck {env.losscheck or '-'} (git {env.git_revision or '-'}) "
            f"on {env.accelerator or '-'}): `pytest {shlex.join(m.pytest_args)}`"
        )
    return lines


def _test_families(tests: Sequence[RegisteredTest]) -> str:
    """`pit`: `pit.pooled_chisquare`, ... per family; a test that spends no alpha (it fails only on
    an event of probability 0) marked "at alpha 0", an e-value test "anytime"."""
    families: dict[str, list[str]] = {}
    for t in tests:
        marks = [m for m, on in (("anytime", t.anytime), ("at alpha 0", not t.spends_alpha)) if on]
        families.setdefault(t.family, []).append(f"`{t.name}`" + (f" ({', '.join(marks)})" if marks else ""))
    return "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())
