"""The perf tier of a black-box engine (`pytest -m perf --losscheck-engine=...`, `losscheck perf
--engine ...`): the engine with speculation on against off on the same requests, over a
concurrency ladder for each arrival process, and the input- and output-length tiers at the lowest
concurrency (`losscheck.perf.engine_suite`). Reported in `<--losscheck-out or reports>/perf-engine/`
(perf.json, perf.md); the tests fail on inconsistent accounting (a request past its budget or
stopping short without EOS, emissions that do not add up, engine counters that contradict
themselves or a τ outside [1, k + 1]). Timings are reported, never asserted.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.perf


def _session(config: pytest.Config):
    from losscheck.plugin.hooks import SESSION_KEY

    return config.stash[SESSION_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from losscheck.plan.arrivals import parse_arrivals, parse_block_lengths, parse_concurrency
    from losscheck.plan.perf_profiles import ENGINE_SIZES

    options = _session(metafunc.config).options
    if "engine_concurrency" in metafunc.fixturenames:
        sizes = ENGINE_SIZES.get(options.perf_profile, ENGINE_SIZES["quick"])
        ladder = parse_concurrency(options.perf_concurrency) if options.perf_concurrency else sizes.concurrency
        metafunc.parametrize("engine_concurrency", ladder, ids=[f"c{c}" for c in ladder])
    if "engine_arrivals" in metafunc.fixturenames:
        arrivals = parse_arrivals(options.perf_arrivals)
        metafunc.parametrize("engine_arrivals", arrivals, ids=[a.label for a in arrivals])
    if "length_tier" in metafunc.fixturenames:
        metafunc.parametrize("length_tier", ("long-input", "long-output"))
    if "block_length" in metafunc.fixturenames:
        ks = parse_block_lengths(options.perf_k) if options.perf_k else (None,)
        metafunc.parametrize("block_length", ks, ids=[f"k{k}" if k else "no-sweep" for k in ks])


@pytest.fixture(scope="session")
def engine_perf_run(request: pytest.FixtureRequest, losscheck_session):
    """The engine's measurements; at the end of the session, the report."""
    if losscheck_session.options.engine is None:
        pytest.skip(
            "no engine to time (--losscheck-engine; losscheck perf: --engine); the drafters' perf tier is test_perf.py"
        )
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        pytest.skip(f"the perf tier does not time under pytest-xdist (this is worker {worker}); run -m perf without -n")
    from losscheck.perf.engine_suite import EnginePerfRun
    from losscheck.plan.perf_profiles import get_perf_profile
    from losscheck.report.engine_perf import write_report

    run = EnginePerfRun(losscheck_session, get_perf_profile(losscheck_session.options.perf_profile))
    yield run
    if run.measured():
        out = (losscheck_session.options.out or Path("reports")) / "perf-engine"
        paths = write_report(run.document(), out)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nlosscheck engine perf report: {', '.join(str(p) for p in paths)}")


def _check(run, kind: str, arrivals, concurrency: int, k: int | None = None) -> None:
    from losscheck.perf.engine_serving import engine_trace_problems

    k = run.engine.k if k is None else k
    if not run.timeable(concurrency, k):
        pytest.skip(f"engine {run.engine.name!r} runs one request at a time: timed at concurrency 1 only")
    record = run.rung(kind, arrivals, concurrency, k)
    problems = [
        f"run {i} ({'on' if i % 2 else 'off'}): {p}"
        for i, trace in enumerate(run.traces(kind, arrivals, concurrency, k))
        for p in engine_trace_problems(trace, run.eos, k)
    ]
    assert not problems, f"{run.engine.name} at concurrency {concurrency} ({kind}, {arrivals.label}): " + "; ".join(
        problems
    )
    assert record.speedup.ratio > 0 and math.isfinite(record.speedup.ratio), record.speedup


def test_engine_rung(engine_perf_run, engine_arrivals, engine_concurrency: int) -> None:
    """One rung of the ladder: the engine timed with speculation on and off, its accounting consistent."""
    _check(engine_perf_run, "ladder", engine_arrivals, engine_concurrency)


def test_engine_length_tier(engine_perf_run, length_tier: str) -> None:
    """Long prompts and long outputs at the lowest concurrency, closed loop."""
    from losscheck.plan.arrivals import CLOSED

    _check(engine_perf_run, length_tier, CLOSED, min(engine_perf_run.concurrency))


def test_engine_k_sweep(engine_perf_run, block_length: int | None) -> None:
    """`--losscheck-perf-k`: the engine drafting each block length, at the lowest concurrency, closed loop."""
    from losscheck.plan.arrivals import CLOSED

    if block_length is None:
        pytest.skip("no k sweep asked (--losscheck-perf-k=2,4,...)")
    _check(engine_perf_run, "ladder", CLOSED, min(engine_perf_run.concurrency), block_length)


def test_engine_compare_saved_run(engine_perf_run) -> None:
    """`--losscheck-perf-compare=RUN` with an engine: no rung's speedup or τ below the saved engine
    run's by more than the thresholds of `--losscheck-perf-compare-fail` (after every rung above)."""
    from losscheck.report import engine_perf_run as saved_runs
    from losscheck.report.perf_run import parse_thresholds

    options = engine_perf_run.session.options
    if options.perf_compare is None:
        pytest.skip("no saved engine run to compare with (--losscheck-perf-compare=RUN)")
    saved = saved_runs.load(options.perf_compare)
    found = saved_runs.compare(engine_perf_run.document(), saved, parse_thresholds(options.perf_compare_fail))
    if not found:
        pytest.fail(f"{options.perf_compare} shares no rung with this run; nothing to compare", pytrace=False)
    failed = [c.line() for c in found if c.failed]
    assert not failed, f"regressed against {options.perf_compare}:\n  " + "\n  ".join(failed)
