"""The performance tier (`pytest -m perf`): a drafter's speedup against the baseline on a
concurrency ladder, where it comes from, the HF assisted-generation peer, regressions against a
saved run. Timings, reported in `<--losscheck-out or reports>/perf/` (JSON, Markdown, plots);
the tests fail on inconsistent accounting, engine overhead above the profile's bound, or a
regression beyond `--losscheck-perf-compare-fail`.

Parametrised over engine (the baseline, once per concurrency, and each drafter) × concurrency,
and, at the lowest concurrency, drafter × workload (short outputs, one entropy tier).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.perf

SENSITIVITY_WORKLOADS = ("short", "low", "mid", "high")


def _profile(config: pytest.Config):
    from losscheck.plan.perf_profiles import get_perf_profile
    from losscheck.plugin.hooks import SESSION_KEY

    return get_perf_profile(config.stash[SESSION_KEY].options.perf_profile)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from losscheck.perf.suite import BASELINE, drafter_names
    from losscheck.plugin.hooks import SESSION_KEY

    names = drafter_names(metafunc.config.stash[SESSION_KEY])
    if "perf_engine" in metafunc.fixturenames:
        metafunc.parametrize("perf_engine", [BASELINE, *names])
    if "perf_drafter" in metafunc.fixturenames:
        metafunc.parametrize("perf_drafter", names)
    if "concurrency" in metafunc.fixturenames:
        ladder = _profile(metafunc.config).concurrency
        metafunc.parametrize("concurrency", ladder, ids=[f"c{c}" for c in ladder])
    if "perf_workload" in metafunc.fixturenames:
        metafunc.parametrize("perf_workload", SENSITIVITY_WORKLOADS)


@pytest.fixture(scope="session")
def perf_run(request: pytest.FixtureRequest, losscheck_session):
    """The run's measurements; at the end of the session, the report."""
    if losscheck_session.options.engine is not None:
        pytest.skip("an engine run times the engine, not losscheck's loop (test_engine_perf.py)")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        pytest.skip(
            f"the perf tier does not time under pytest-xdist (this is worker {worker}): parallel workers "
            "share the cores and the device, so each one's clock measures the others; run -m perf without -n"
        )
    from losscheck.perf.suite import PerfRun
    from losscheck.report.perf import write_report

    run = PerfRun(losscheck_session, _profile(request.config))
    yield run
    if run.measured():
        out = (losscheck_session.options.out or Path("reports")) / "perf"
        paths = write_report(run.document(), out, run.comparisons)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nlosscheck perf report: {', '.join(str(p) for p in paths)}")


def _check(run, engine: str, concurrency: int, kind: str = "ladder") -> None:
    from losscheck.perf.serving import trace_problems

    eos = run.session.target("main").eos_id
    problems = [
        f"run {i}: {p}"
        for i, trace in enumerate(run.traces(engine, concurrency, kind))
        for p in trace_problems(trace, run.profile.k, eos)
    ]
    assert not problems, f"{engine} at concurrency {concurrency} ({kind}): " + "; ".join(problems)


def test_rung(perf_run, perf_engine: str, concurrency: int) -> None:
    """One rung of the ladder: timed, and its accounting consistent."""
    perf_run.rung(perf_engine, concurrency)
    _check(perf_run, perf_engine, concurrency)


def test_sensitivity(perf_run, perf_drafter: str, perf_workload: str) -> None:
    """Speedup at the lowest concurrency on short outputs and on each entropy tier."""
    low = min(perf_run.profile.concurrency)
    perf_run.rung(perf_drafter, low, perf_workload)
    _check(perf_run, perf_drafter, low, perf_workload)


def test_engine_overhead(perf_run) -> None:
    """The engine's own time in a round (outside drafter and target forwards) at the lowest
    concurrency, with the reference drafter (the one compared with the HF peer: family A, or the
    user's), stays below the profile's bound. Every drafter's overhead is in the report."""
    low, drafter = min(perf_run.profile.concurrency), perf_run.peer_drafter()
    r = perf_run.rung(drafter, low)
    bound = perf_run.profile.max_overhead
    assert r.overhead_fraction < bound, (
        f"{drafter} at concurrency {low}: engine overhead {r.overhead_fraction:.1%} of a round "
        f"({r.per_round.overhead_s * 1e3:.2f} ms of {r.per_round.round_s * 1e3:.2f} ms), bound {bound:.0%}"
    )


def test_peer_hf_assisted(perf_run) -> None:
    """Hugging Face assisted generation with the same target and family-A drafter, concurrency 1."""
    from losscheck.errors import OptionError

    try:
        peer = perf_run.peer()
    except OptionError as exc:
        pytest.skip(str(exc))
    assert min(peer.hf_assisted_tok_s + peer.hf_plain_tok_s) > 0, peer


def test_compare_saved_run(perf_run) -> None:
    """`--losscheck-perf-compare=RUN`: no speedup or tau below the saved run's by more than the
    thresholds of `--losscheck-perf-compare-fail`."""
    from losscheck.report import perf_run as saved_runs

    options = perf_run.session.options
    if options.perf_compare is None:
        pytest.skip("no saved run to compare with (--losscheck-perf-compare=RUN)")
    saved = saved_runs.load(options.perf_compare)
    found = saved_runs.compare(perf_run.document(), saved, saved_runs.parse_thresholds(options.perf_compare_fail))
    perf_run.comparisons = found
    if not found:
        pytest.fail(f"{options.perf_compare} shares no drafter rung with this run; nothing to compare", pytrace=False)
    failed = [c.line() for c in found if c.failed]
    changes = saved_runs.environment_changes(perf_run.document(), saved)
    assert not failed, (
        "regressed against "
        + options.perf_compare
        + ":\n  "
        + "\n  ".join(failed)
        + ("\nthe runs differ in " + "; ".join(changes) if changes else "")
    )
