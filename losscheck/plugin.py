"""The pytest plugin: options, the session object, cell parametrisation, result channels.

Hooks only; state lives in `losscheck.session.Session`, built once per process from the options.
Nothing heavy (torch, transformers) is imported until a hook needs it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from losscheck.errors import LosscheckError
from losscheck.loading import check_options
from losscheck.options import add_options, from_parsed
from losscheck.session import Session

SESSION_KEY = pytest.StashKey[Session]()
PLAN_ERROR_KEY = pytest.StashKey[str]()
RECORD_PROPERTY = "losscheck"

MARKERS = {
    "lossless": "the losslessness gate (greedy equality and calibrated sampling tests)",
    "slow": "long-running material (calibration over many seeds)",
    "mutants": "planted losslessness bugs that the gate must catch",
    "perf": "the performance tier: throughput and latency against concurrency (refuses to time under xdist)",
    "statistical": "a test that spends a Bonferroni share of the run's family-wise alpha",
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
    except LosscheckError as exc:
        # pytest prints a UsageError raised here as one "ERROR: ..." line and exits with 4.
        raise pytest.UsageError(str(exc)) from None
    config.stash[SESSION_KEY] = Session(options)
    config.pluginmanager.register(RecordCollector(config), "losscheck-records")


def pytest_report_header(config: pytest.Config) -> list[str]:
    o = config.stash[SESSION_KEY].options
    return [
        f"losscheck: seed={o.seed} alpha={o.alpha} profile={o.profile.name} detect_tv={o.profile.detect_tv} "
        f"target={o.target or 'bundled'} drafter={o.drafter or 'bundled'}"
        + (f" mutant={o.mutant}" if o.mutant else "")
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from losscheck.matrix import CELL_ARGS, OFF_REASONS

    args = [arg for arg in CELL_ARGS if arg in metafunc.fixturenames]
    if not args:
        return
    # What check_options cannot see before the models load (a factory's product, weights that do
    # not load) is the collection error of the first module that needs the plan, the message
    # alone; later modules are skipped rather than repeat it.
    stash = metafunc.config.stash
    if PLAN_ERROR_KEY in stash:
        pytest.skip(f"not collected: {stash[PLAN_ERROR_KEY]}")
    try:
        plan, error = stash[SESSION_KEY].plan, None
    except LosscheckError as exc:
        error = stash[PLAN_ERROR_KEY] = str(exc)
    if error is not None:
        pytest.fail(error, pytrace=False)  # outside `except`: without the exception chain
    for arg in args:
        if plan[arg]:
            metafunc.parametrize(arg, plan[arg], ids=[c.id for c in plan[arg]])
        else:
            off = pytest.param(None, marks=pytest.mark.skip(reason=OFF_REASONS[arg]))
            metafunc.parametrize(arg, [off], ids=["off"])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # After -m/-k deselection: the alpha is split over the statistical tests that will run.
    config.stash[SESSION_KEY].n_statistical = sum(
        1 for i in items if i.get_closest_marker("statistical") and not i.get_closest_marker("skip")
    )


@pytest.fixture(scope="session")
def losscheck_session(request: pytest.FixtureRequest) -> Session:
    """The run's `Session`: options, lazily loaded models, the per-test alpha."""
    return request.config.stash[SESSION_KEY]


_RECORD_KEY = pytest.StashKey[dict]()


@pytest.fixture
def losscheck_record(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A dict a certification test fills; it travels on the test report into the certificate."""
    record: dict[str, Any] = {}
    request.node.stash[_RECORD_KEY] = record
    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    report = yield
    record = item.stash.get(_RECORD_KEY, None)
    if report.when == "call" and record:
        # JSON text survives xdist's report serialisation unchanged.
        report.user_properties.append((RECORD_PROPERTY, json.dumps(record)))
    return report


class RecordCollector:
    """Gathers the records of certification tests (on the xdist controller too) and writes the
    terminal section and the certificate at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.records: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = [json.loads(v) for n, v in report.user_properties if n == RECORD_PROPERTY]
        for record in found:
            record.update(nodeid=report.nodeid, outcome=report.outcome)
            self.records.append(record)
        if report.failed and not found and "lossless" in report.keywords:
            # A cell that errored (underpowered, malformed drafter output) is a failed cell.
            self.records.append(
                {"nodeid": report.nodeid, "outcome": "error", "passed": False, "kind": "error",
                 "cell": report.nodeid.rpartition("[")[2].rstrip("]"), "error": report.longreprtext[-2000:]}
            )

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int) -> None:
        if not self.records or hasattr(self.config, "workerinput"):
            return
        from losscheck.report.summary import summary_lines

        terminalreporter.section("losscheck certificate")
        for line in summary_lines(self.records):
            terminalreporter.write_line(line)
        session = self.config.stash[SESSION_KEY]
        if session.options.out is not None:
            from losscheck.report.certificate import write_run

            path = write_run(session, self.records, int(exitstatus))
            terminalreporter.write_line(f"certificate written to {path}")
