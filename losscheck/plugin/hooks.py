"""The pytest plugin: options, the session object, cell parametrisation, result channels.

Hooks only; the run's state lives in `losscheck.run.session.Session`, built once per process from
the options, and the plugin's own (the terminal's progress line, whether this process's manifest
went out) in `config.stash`; a certification test's cell reads the run through a
`losscheck.run.context.CellContext` (the `losscheck_context` fixture).
Nothing heavy (torch, transformers) is imported until a hook needs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from losscheck.cells.record import CellRecord, RunFacts
from losscheck.errors import LosscheckError
from losscheck.plugin.collect import matrix_args
from losscheck.progress import QUIET, Progress
from losscheck.report.manifest import Manifest
from losscheck.run.context import CellContext
from losscheck.run.loading import check_options
from losscheck.run.options import add_options, from_parsed
from losscheck.run.session import Session

if TYPE_CHECKING:
    from losscheck.plan.cell import Cell
    from losscheck.report.document import Certificate

SESSION_KEY = pytest.StashKey[Session]()
PROGRESS_KEY = pytest.StashKey[Progress]()  # stages of a long cell, on a terminal's live line
MANIFEST_SENT_KEY = pytest.StashKey[bool]()  # this process's manifest went out on a report
VERDICT_KEY = pytest.StashKey[str]()  # the certificate's verdict, once the terminal summary wrote it
RUN_DIR_KEY = pytest.StashKey[str]()  # the run directory the certificate went to (with --losscheck-out)
PLAN_ERROR_KEY = pytest.StashKey[str]()  # what made the plan fail (`pytest_generate_tests`)
_PLAN_ERROR_SENT = pytest.StashKey[bool]()  # an xdist worker has sent it to the controller
PLAN_ERROR_PREFIX = "losscheck cannot plan the run: "  # how the controller tells a worker's plan error
RECORD_PROPERTY = "losscheck"
SCHEDULING = "losscheck_scheduling"  # pytest-xdist's (--dist, --maxschedchunk), in each worker's workerinput
MANIFEST_PROPERTY = "losscheck-manifest"

MARKERS = {
    "lossless": "the losslessness gate (greedy equality and calibrated sampling tests)",
    "slow": "long-running material: calibration over many seeds, the slow tier of the certification matrix",
    "mutants": "planted losslessness bugs that the gate must catch",
    "perf": "the performance tier: throughput and latency against concurrency (refuses to time under xdist)",
    "statistical": "a test that spends a Bonferroni share of the run's family-wise alpha",
    "e2e": "starts processes (pytest in a subprocess, tensor-parallel ranks, a wheel in a venv)",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("losscheck", "speculative-decoding losslessness certification")
    add_options(group.addoption, "--losscheck-")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    try:
        options = from_parsed(config.getoption)
        if not hasattr(config, "workerinput"):  # xdist workers start after the controller checked
            check_options(options)
            if options.verifier is not None:  # imports the user's module and calls its factory (torch)
                from losscheck.run.factory import load_verifier

                load_verifier(options.verifier)
    except LosscheckError as exc:
        # pytest prints a UsageError raised here as one "ERROR: ..." line and exits with 4.
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = Session(options)
    # naming a target, drafter or engine brings the matrix along (`pytest -m lossless`, no --pyargs)
    config.args += matrix_args(config, options)
    config.stash[PROGRESS_KEY] = QUIET
    if _interactive(config):
        from losscheck.progress import TerminalProgress

        config.stash[PROGRESS_KEY] = TerminalProgress(config)
    config.pluginmanager.register(RecordCollector(config), "losscheck-records")


def _interactive(config: pytest.Config) -> bool:
    """A person watching a terminal: not CI, not an xdist worker (pytest never shows their output)."""
    import sys

    return sys.stdout.isatty() and not os.environ.get("CI") and not hasattr(config, "workerinput")


def pytest_report_header(config: pytest.Config) -> list[str]:
    o = config.stash[SESSION_KEY].options
    return [
        f"losscheck: seed={o.seed} alpha={o.alpha} profile={o.profile.name} detect_tv={o.profile.detect_tv} "
        f"target={o.target or 'bundled'} drafter={o.drafter or 'bundled'}" + (f" mutant={o.mutant}" if o.mutant else "")
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from losscheck.plan.matrix import CELL_ARGS, off_reason

    args = [arg for arg in CELL_ARGS if arg in metafunc.fixturenames]
    if not args:
        return
    # What check_options cannot see before the models load (a factory's product, weights that do
    # not load) is a usage error like a bad option's, one "ERROR: ..." line naming the option,
    # never a collection error of whichever test module came first: every module that needs the
    # plan is skipped, and `pytest_collection_finish` raises the error. An xdist worker cannot end
    # the run, so its first such module fails with the message, which the controller raises
    # (`pytest_collectreport`).
    stash = metafunc.config.stash
    if PLAN_ERROR_KEY not in stash:
        try:
            plan = stash[SESSION_KEY].plan
        except LosscheckError as exc:
            stash[PLAN_ERROR_KEY] = str(exc)
    if PLAN_ERROR_KEY in stash:  # outside `except`: without the exception chain
        if hasattr(metafunc.config, "workerinput") and not stash.get(_PLAN_ERROR_SENT, False):
            stash[_PLAN_ERROR_SENT] = True
            pytest.fail(PLAN_ERROR_PREFIX + stash[PLAN_ERROR_KEY], pytrace=False)
        pytest.skip(f"not collected: {stash[PLAN_ERROR_KEY]}")
    for arg in args:
        if plan[arg]:
            cells = [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in plan[arg]]
            metafunc.parametrize(arg, cells)
        else:
            off = pytest.param(None, marks=pytest.mark.skip(reason=off_reason(arg)))
            metafunc.parametrize(arg, [off], ids=["off"])


def pytest_collection_finish(session: pytest.Session) -> None:
    if PLAN_ERROR_KEY in session.config.stash and not hasattr(session.config, "workerinput"):
        raise pytest.UsageError(session.config.stash[PLAN_ERROR_KEY])
    if SESSION_KEY in session.config.stash and not hasattr(session.config, "workerinput"):
        # the engine cells this process runs, in order: drawn side by side (`losscheck.cells.engine.phases`)
        from losscheck.plan.cell import ENGINE, Cell

        params = (getattr(getattr(item, "callspec", None), "params", {}) for item in session.items)
        cells = (next((v for v in p.values() if isinstance(v, Cell)), None) for p in params)
        engine_cells = tuple(c for c in cells if c is not None and c.drafter == ENGINE)
        session.config.stash[SESSION_KEY].engine_cells = engine_cells


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    # in each process that runs tests: not the xdist controller, which runs none and loads no model
    controller = session.config.pluginmanager.has_plugin("dsession")
    if not session.config.option.collectonly and not controller:
        from losscheck.engines.pool import freeze_long_lived

        freeze_long_lived()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # in process, or the xdist controller
        session.config.pluginmanager.register(PlanErrorRelay(), "losscheck-plan-error")


class PlanErrorRelay:
    """On the xdist controller: a worker's plan error (`pytest_generate_tests`) ends the run as the
    usage error it is."""

    @pytest.hookimpl(tryfirst=True)  # before the terminal records it as a collection error
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        text = str(report.longrepr) if report.failed else ""
        if text.startswith(PLAN_ERROR_PREFIX):
            raise pytest.UsageError(text.removeprefix(PLAN_ERROR_PREFIX))


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselect: xdist's chunks count the items that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Certification tests run in `losscheck.plan.cost.run_order` (costliest on the run's target
    first, dealt over xdist's first chunks, each black-box engine variant's cells together, split
    cells together); other tests keep their order after them. With `--losscheck-shard`, the cells
    of the other shards are deselected (`losscheck.plan.shard`)."""
    from losscheck.plan.cell import Cell
    from losscheck.plan.cost import estimated_seconds, run_order, seconds_on

    def cell_of(item: pytest.Item) -> Cell | None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return next((v for v in params.values() if isinstance(v, Cell)), None)

    costs = [(item, cell_of(item)) for item in items]
    others = _other_shards(config) if any(c is not None for _, c in costs) else frozenset()
    if others:
        config.hook.pytest_deselected(items=[i for i, c in costs if c is not None and c.id in others])
        costs = [(i, c) for i, c in costs if c is None or c.id not in others]
    cells = [(i, c) for i, c in costs if c is not None]
    seconds = seconds_on(config.stash[SESSION_KEY].options.target) if cells else estimated_seconds
    order = run_order([c for _, c in cells], seconds, *_first_chunks(config, len(costs)))
    items[:] = [cells[j][0] for j in order] + [i for i, c in costs if c is None]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, on its controller, once per worker
def pytest_configure_node(node: Any) -> None:
    """Tell each worker how the controller schedules (a worker's own options say "no"):
    `_first_chunks` deals the run order for it."""
    option = node.config.option
    node.workerinput[SCHEDULING] = (option.dist, getattr(option, "maxschedchunk", None))


def _first_chunks(config: pytest.Config, count: int) -> tuple[int, int]:
    """(workers, items in each worker's first chunk) of pytest-xdist's `load` scheduling over
    `count` items, as xdist 3 computes them: each worker gets a chunk of a quarter of its share
    (at least 2, at most `--maxschedchunk`), or one item in turn when there are fewer than two a
    worker; (1, 1) in process or under another scheduling."""
    workerinput = getattr(config, "workerinput", None)
    dist, most = (workerinput or {}).get(SCHEDULING, ("no", None))
    if workerinput is None or dist != "load":
        return 1, 1
    workers = int(workerinput["workercount"])
    if count < 2 * workers:
        return workers, 1
    return workers, max(min(count // workers // 4, most or count), 2)


def _other_shards(config: pytest.Config) -> frozenset[str]:
    """The planned cells that `--losscheck-shard` leaves to the other shards (none without it)."""
    session = config.stash[SESSION_KEY]
    shard = session.options.shard
    if shard is None or PLAN_ERROR_KEY in config.stash:
        return frozenset()
    from losscheck.plan.matrix import entries
    from losscheck.plan.shard import share

    planned = entries(session.plan)
    return frozenset(e.cell for e in planned) - frozenset(share(planned, shard))


@pytest.fixture(scope="session")
def losscheck_session(request: pytest.FixtureRequest) -> Session:
    """The run's `Session`: options, lazily loaded models, the per-test alpha."""
    return request.config.stash[SESSION_KEY]


@pytest.fixture
def losscheck_context(request: pytest.FixtureRequest, losscheck_session: Session) -> Callable[[Cell], CellContext]:
    """`cell -> CellContext`: what a certification test's cell reads of the run (its progress shown
    on the terminal's live line)."""
    progress = request.config.stash.get(PROGRESS_KEY, QUIET)
    return lambda cell: CellContext.of(losscheck_session, cell, progress)


@dataclass
class RecordSlot:
    """Where a certification test leaves its cell's record (`certify`); the record travels on
    the test's report into the certificate."""

    nodeid: str
    record: CellRecord | None = None


_RECORD_KEY = pytest.StashKey[RecordSlot]()


@pytest.fixture
def losscheck_record(request: pytest.FixtureRequest) -> RecordSlot:
    """The slot a certification test leaves its cell's record in."""
    slot = RecordSlot(request.node.nodeid)
    request.node.stash[_RECORD_KEY] = slot
    return slot


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    report = yield
    slot = item.stash.get(_RECORD_KEY, None)
    record = None if slot is None else slot.record
    if report.when != "call" or "lossless" not in item.keywords:
        return report
    session, stash = item.config.stash[SESSION_KEY], item.config.stash
    stash[PROGRESS_KEY].clear()  # before the terminal writes the test's outcome mark
    if not stash.get(MANIFEST_SENT_KEY, False):  # once per process, on its first certification test
        from losscheck.report.manifest import build

        stash[MANIFEST_SENT_KEY] = True
        report.user_properties.append((MANIFEST_PROPERTY, json.dumps(build(session).to_json(), default=str)))
    if record is not None:
        # JSON text survives xdist's report serialisation unchanged.
        report.user_properties.append((RECORD_PROPERTY, json.dumps(record.to_json(), default=str)))
        # JUnit XML writes the properties of the teardown report, which copies the item's.
        from losscheck.report.summary import junit_properties

        item.user_properties.extend(junit_properties(record))
    return report


def _cell_id(nodeid: str) -> str:
    return nodeid.rpartition("[")[2].rstrip("]")


class RecordCollector:
    """Gathers the manifests and cell records of certification tests (on the xdist controller
    too) and writes the terminal section, the certificate and the CI job summary at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.records: list[CellRecord] = []
        self.manifests: list[Manifest] = []
        self.interrupted = False
        self.cert: Certificate | None = None
        from losscheck.progress import CellProgress

        self.progress = CellProgress(self._write_line)

    def _write_line(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and not hasattr(self.config, "workerinput"):
            reporter.write_line(line)
            reporter.flush()  # a CI log (a pipe, block-buffered) shows each line as it comes

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        cells = [_cell_id(item.nodeid) for item in session.items if "lossless" in item.keywords and "[" in item.nodeid]
        self.progress.collected(cells)
        if cells and not hasattr(self.config, "workerinput") and not getattr(self.config.option, "numprocesses", 0):
            # in process the plan is known now (under xdist `losscheck certify` prints it first)
            from losscheck.report.plan import plan_lines

            for line in plan_lines(self.config.stash[SESSION_KEY], full=False):
                self._write_line(line)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.progress.collected(_cell_id(nodeid) for nodeid in ids if "[" in nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        manifests = [
            Manifest.from_json(json.loads(str(v)), f"{report.nodeid}: manifest")
            for n, v in report.user_properties
            if n == MANIFEST_PROPERTY
        ]
        for manifest in manifests:
            self.progress.planned({e.cell: e.estimated_s or 0.0 for e in manifest.matrix})
        self.manifests += manifests
        found = [
            CellRecord.from_json(json.loads(str(v)), report.nodeid)
            for n, v in report.user_properties
            if n == RECORD_PROPERTY
        ]
        for record in found:
            self.records.append(record.with_run(nodeid=report.nodeid, outcome=report.outcome))
            self.progress.finished(record.cell, "PASS" if report.passed else "FAIL", record.run.seconds)
        cell = _cell_id(report.nodeid)
        lossless = "lossless" in report.keywords and "[" in report.nodeid
        if report.skipped and report.when in ("setup", "call") and lossless and cell != "off":
            # a cell this platform cannot run: not run, with the reason (and the scope that declares it out)
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            run = RunFacts(report.nodeid, "skipped", skip_reason=reason.removeprefix("Skipped: "))
            self.records.append(CellRecord(cell, run))
            self.progress.finished(cell, "NOT RUN", None)
        if report.failed and not found and "lossless" in report.keywords:
            # A cell that errored (underpowered, malformed drafter output) is a failed cell.
            run = RunFacts(report.nodeid, "error", error=report.longreprtext[-2000:])
            self.records.append(CellRecord(cell, run, kind="error"))
            self.progress.finished(cell, "ERROR", None)

    def pytest_keyboard_interrupt(self) -> None:
        self.interrupted = True

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """The certificate, before the terminal summary prints it; with --losscheck-require-pass
        a verdict other than PASS makes the run's exit status non-zero."""
        if hasattr(self.config, "workerinput") or not (self.records or self.manifests):
            return
        from losscheck.report import certificate

        options = self.config.stash[SESSION_KEY].options
        meta = certificate.run_meta(options, list(self.config.invocation_params.args))
        self.cert = certificate.build(
            meta,
            self.manifests,
            self.records,
            int(exitstatus),
            self.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED,
            options.shard,
        )
        self.config.stash[VERDICT_KEY] = self.cert.verdict
        if options.require_pass and self.cert.verdict != "PASS" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int) -> None:
        cert = self.cert
        if cert is None:
            return
        from losscheck.report import certificate
        from losscheck.report.summary import summary_lines

        options = self.config.stash[SESSION_KEY].options
        terminalreporter.section("losscheck certificate")
        lines = (
            summary_lines(self.records) + certificate.serving_lines(self.records) + certificate.cost_lines(self.records)
        )
        for line in [s for s in lines if s]:
            terminalreporter.write_line(line)
        terminalreporter.write_line(certificate.scope_line(cert))
        terminalreporter.write_line(
            certificate.headline(cert), bold=True, red=cert.verdict != "PASS", green=cert.verdict == "PASS"
        )
        if options.out is not None:
            path = certificate.write_run(options.out, cert)
            self.config.stash[RUN_DIR_KEY] = str(path)
            terminalreporter.write_line(f"certificate written to {path}")
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if step_summary:  # GitHub Actions shows this file on the job's page
            with open(step_summary, "a", encoding="utf-8") as f:
                f.write(certificate.markdown(cert) + "\n")
