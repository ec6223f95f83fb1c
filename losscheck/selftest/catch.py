"""Running the gate's own cells against a mutant, and the catch table.

A mutant is *caught* when at least one of its cells fails under exactly the gate's settings:
the same runner functions (`run_greedy`, `run_exact`, `run_pit`), the same profile, seeds and
sample sizes, and the same per-test α as `pytest -m lossless` — α split over the gate's
statistical tests (`gate_statistical_tests`), not over whatever this run collected.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from losscheck.cells.outcome import CellOutcome
from losscheck.cells.sampled import run_cell
from losscheck.errors import LosscheckError
from losscheck.plan.matrix import Cell
from losscheck.report.markdown import markdown_table
from losscheck.run.context import CellContext
from losscheck.run.session import Session
from losscheck.selftest.power import Prediction, predict
from losscheck.selftest.registry import Mutant


def gate_session(base: Session, mutant: str | None) -> Session:
    """`base`'s options and models with `mutant` planted and the per-test α of `pytest -m lossless`
    (split over every statistical cell of the gate's plan)."""
    base.drafters("main")  # load the models once, so every derived session shares them
    return base.derive(mutant=mutant)  # its alpha split is the same full plan's


@dataclass(frozen=True)
class CellPrediction:
    """A mutant's predicted power in one cell (`losscheck.selftest.power.Prediction`), or n/a and why."""

    cell: str | None  # None: the mutant shows in no cell of the run
    power: float | None
    tv: float | None
    note: str

    @classmethod
    def of(cls, cell: str | None, prediction: Prediction) -> CellPrediction:
        return cls(cell, prediction.power, prediction.tv, prediction.note)


@dataclass(frozen=True)
class CatchMeta:
    """The run a catch table comes from."""

    seed: int
    profile: str
    alpha: float
    per_test_alpha: float
    gate_statistical_tests: int  # the statistical tests of the gate's plan the alpha is split over
    all_cells: bool = False  # every cell of each mutant run, not only up to its first catch
    stress: bool = True  # with the stress cells
    seconds: float | None = None


@dataclass
class CellCatch:
    """One gate cell run against a mutant (or the unmodified engine)."""

    cell: str
    mode: str  # "greedy" | "exact" | "pit"
    failed: bool
    failing: list[str]  # names of the failing tests (greedy: "equality", oracle problems)
    test_name: str  # the failing test with the smallest p-value (greedy: "equality")
    p_value: float | None  # its p-value
    evidence: str  # the first divergence, or the failing tests' message
    seconds: float
    prediction: Prediction | None = None  # exact cells only
    error: str = ""  # the cell errored instead of reaching a verdict (not a catch)


def _catch(session: Session, cell: Cell, mutant: Mutant | None) -> CellCatch:
    started = time.perf_counter()
    mode = cell.mode
    try:
        outcome = run_cell(CellContext.of(session, cell))
    except LosscheckError as exc:
        # The gate errors on this cell (e.g. the bug shortened sequences below the sample the test
        # needs): the cell does not pass, but no test caught the bug either.
        return CellCatch(
            cell.id, mode, False, [], "", None, "", time.perf_counter() - started, error=f"{type(exc).__name__}: {exc}"
        )
    seconds = time.perf_counter() - started
    failing, test_name, p_value, evidence = _evidence(outcome)
    prediction = predict(session, mutant, cell) if mutant is not None and mode == "exact" else None
    return CellCatch(cell.id, mode, not outcome.passed, failing, test_name, p_value, evidence, seconds, prediction)


def _evidence(outcome: CellOutcome) -> tuple[list[str], str, float | None, str]:
    """(failing tests, the most significant one, its p-value, what it saw) of a cell outcome."""
    if outcome.divergences:
        d = outcome.divergences[0]
        return (
            ["equality"],
            "equality",
            None,
            (
                f"{len(outcome.divergences)} prompts diverge; first: {d.tier} #{d.prompt_index} at position "
                f"{d.position}, spec {d.spec_token} vs base {d.base_token} (margin {d.margin:.3g})"
            ),
        )
    bad = [r for r in outcome.verdict.results if not r.passed] if outcome.verdict is not None else []
    checks = list(dict.fromkeys(_check(p) for p in outcome.problems))
    failing = [r.name for r in bad] + checks
    if bad:
        worst = min(bad, key=lambda r: r.p_value)
        return failing, worst.name, worst.p_value, f"{worst.name}: {worst.observed}"
    if failing:
        return failing, checks[0], None, outcome.problems[0]
    return [], "", None, ""


def _check(problem: str) -> str:
    """The exact check a cell problem comes from: the end check (`losscheck.cells.ends`), the logprob
    check (`losscheck.cells.logprob_check`), else the self-draft oracle's acceptance."""
    name = problem.split(":", 1)[0]
    return name if name in ("ends", "logprobs") else "oracle"


@dataclass
class MutantReport:
    name: str
    bug_class: str
    kind: str
    cells: list[str]  # the gate cells it manifests in, in run order
    runs: list[CellCatch]  # the cells actually run (up to the first catch, or all)
    seconds: float
    prediction: CellPrediction | None = None  # the best exact-mode prediction

    @property
    def caught(self) -> bool:
        return any(r.failed for r in self.runs)

    @property
    def catch(self) -> CellCatch | None:
        return next((r for r in self.runs if r.failed), None)

    def message(self) -> str:
        failed = sum(r.failed for r in self.runs)
        lines = [
            f"mutant {self.name} ({self.bug_class}): {'CAUGHT' if self.caught else 'NOT CAUGHT'}, "
            f"{failed} of {len(self.runs)} cells run fail ({len(self.cells)} cells show the bug)"
        ]
        for r in self.runs:
            verdict = "FAIL" if r.failed else ("ERROR" if r.error else "pass")
            lines.append(f"  {r.cell} [{r.mode}] {verdict} {', '.join(r.failing)} {r.evidence}{r.error}".rstrip())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "caught": self.caught}


def run_mutant(base: Session, mutant: Mutant, all_cells: bool = False, stress: bool = True) -> MutantReport:
    """Run `mutant`'s cells through the gate, stopping at the first catch unless `all_cells`
    (`stress` False: without the stress cells)."""
    started = time.perf_counter()
    session = gate_session(base, mutant.name)
    cells = mutant.cells(session.plan, session.options.profile, stress)
    runs: list[CellCatch] = []
    for cell in cells:
        runs.append(_catch(session, cell, mutant))
        if runs[-1].failed and not all_cells:
            break
    prediction = _headline_prediction(session, mutant, cells, runs)
    return MutantReport(
        mutant.name,
        mutant.bug_class,
        mutant.kind,
        [c.id for c in cells],
        runs,
        time.perf_counter() - started,
        prediction,
    )


def _headline_prediction(session: Session, mutant: Mutant, cells: list[Cell], runs: list[CellCatch]) -> CellPrediction:
    """The catching cell's prediction when it is an exact cell, else the first exact cell's (or,
    with none, the first cell's n/a and its reason)."""
    catch = next((r for r in runs if r.failed), None)
    if catch is not None and catch.prediction is not None:
        return CellPrediction.of(catch.cell, catch.prediction)
    cell = next((c for c in cells if c.target == "small"), cells[0] if cells else None)
    if cell is None:
        return CellPrediction(None, None, None, "n/a: the mutant shows in no cell of this run")
    return CellPrediction.of(cell.id, predict(session, mutant, cell))


def run_control(base: Session, cells: list[Cell]) -> list[CellCatch]:
    """The unmodified engine on `cells`, under the same settings: none may fail."""
    session = gate_session(base, None)
    return [_catch(session, cell, None) for cell in cells]


# --- the catch table ------------------------------------------------------------------------------
TABLE_COLUMNS = (
    "mutant",
    "bug class",
    "kind",
    "caught",
    "caught by (cell: test)",
    "p-value / divergence",
    "predicted power (exact pos-0)",
    "TV pos-0",
    "cells failed / run (of)",
    "s",
)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table_rows(reports: list[MutantReport]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for r in reports:
        catch = r.catch
        if catch is None:
            by, evidence = "-", "-"
        else:
            more = f" (+{len(catch.failing) - 1} more)" if len(catch.failing) > 1 else ""
            by = f"{catch.cell}: {catch.test_name}{more}"
            evidence = f"p = {catch.p_value:.3g}" if catch.p_value is not None else catch.evidence
        pred = r.prediction or CellPrediction(None, None, None, "n/a")
        power = _fmt(pred.power, ".4f")
        if pred.power is not None and pred.cell != (catch.cell if catch else None):
            power += f" ({pred.cell})"
        rows.append(
            (
                r.name,
                r.bug_class,
                r.kind,
                "yes" if r.caught else "NO",
                by,
                evidence,
                power,
                _fmt(pred.tv, ".3f"),
                _cell_counts(r),
                f"{r.seconds:.0f}",
            )
        )
    return rows


def _cell_counts(report: MutantReport) -> str:
    errors = sum(bool(c.error) for c in report.runs)
    text = f"{sum(c.failed for c in report.runs)}/{len(report.runs)} ({len(report.cells)})"
    return text + (f", {errors} errored" if errors else "")


def markdown(reports: list[MutantReport], control: list[CellCatch], meta: CatchMeta) -> str:
    caught = sum(r.caught for r in reports)
    lines = [
        "# Mutant catch table",
        "",
        f"{caught}/{len(reports)} planted bugs caught by the lossless gate (seed {meta.seed}, profile "
        f"{meta.profile}, family-wise alpha {meta.alpha}, per-test alpha {meta.per_test_alpha:.3g} "
        f"= alpha / {meta.gate_statistical_tests} gate statistical tests).",
        "",
        markdown_table(TABLE_COLUMNS, table_rows(reports)),
        "Predicted power: power of the exact-mode `exact.position[0]` test (same bins, n and level as the "
        "gate) against the mutant's exact first-token law; a lower bound on the cell's catch probability. "
        "n/a rows say why in the JSON (`prediction.note`).",
    ]
    if control:
        failed = [c for c in control if c.failed or c.error]
        lines += [
            "",
            f"Unmodified engine on the same {len(control)} cells: "
            + ("no false alarm." if not failed else "FALSE ALARM in " + ", ".join(c.cell for c in failed)),
        ]
    return "\n".join(lines) + "\n"


def write_table(reports: list[MutantReport], control: list[CellCatch], meta: CatchMeta, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "catch_table.md", out / "catch_table.json"
    md.write_text(markdown(reports, control, meta))
    payload = {
        "schema": 1,
        **asdict(meta),
        "mutants": [r.to_dict() for r in reports],
        "control": [asdict(c) for c in control],
    }
    js.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return md, js
