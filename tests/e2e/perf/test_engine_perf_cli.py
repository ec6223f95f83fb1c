"""`losscheck perf --engine hf --assistant DIR` end to end: Hugging Face assisted generation timed
with speculation on against off, perf.json and perf.md written with the statement they support,
on/off latency percentiles, the speedup's interval, τ and both acceptance curves per position."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from losscheck import bundled

pytestmark = pytest.mark.e2e  # starts a process


def saved_run(path):
    """A saved engine run sharing the ladder's first rung (closed, c1, k4) at a speedup and τ of
    0.01, which no run falls below: the compare runs and passes."""
    import dataclasses

    from losscheck.perf.engine_suite import _record
    from losscheck.plan.arrivals import CLOSED
    from losscheck.report.engine_perf import write_report
    from tests.unit.perf.test_engine_perf import T1, ScriptedStream, _engine_doc, _requests, drive

    requests = _requests(4)
    runs = [drive(ScriptedStream(chunk=c), requests, [0.0] * 4, 1, T1, [0, 1, 2, 3]) for c in (1, 3, 1, 3)]
    rung = _record("ladder", CLOSED, 1, 4, requests, runs, paired=True)
    doc = _engine_doc(dataclasses.replace(rung, speedup=dataclasses.replace(rung.speedup, ratio=0.01), tau=0.01), "hf")
    return write_report(doc, path)[0]


def test_losscheck_perf_times_hf_assisted_generation(tmp_path):
    command = [sys.executable, "-m", "losscheck.cli", "perf", "--engine", "hf"]
    command += ["--assistant", str(bundled.fixtures_dir() / "drafter_a"), "--perf-concurrency", "1,4"]
    command += ["--perf-k", "2,4"]  # a k sweep: the engine's own 4 and 2
    command += ["--perf-compare", str(saved_run(tmp_path / "saved"))]  # compared rung by rung (not skipped)
    command += ["--out", str(tmp_path)]
    # tiny models: a second thread only contends (timing not asserted); the run is no xdist worker
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    # assisted generation runs one request at a time: concurrency 4 is skipped, saying so
    assert "runs one request at a time: timed at concurrency 1 only" in done.stdout
    assert "no saved engine run to compare with" not in done.stdout  # the compare ran, and passed
    doc = json.loads((tmp_path / "perf-engine" / "perf.json").read_text())
    assert doc["schema"] == "losscheck.engine-perf/1" and doc["engine"]["k"] == 4
    assert doc["engine"]["draft_model"]["path"] == "bundled:drafter_a" and "transformers" in doc["engine"]["package"]
    assert {(r["workload"], r["concurrency"], r["k"]) for r in doc["rungs"]} == {
        ("ladder", 1, 4),
        ("long-input", 1, 4),
        ("long-output", 1, 4),
        ("ladder", 1, 2),
    }
    assert doc["memory_source"].startswith("this process's peak resident set")  # the CPU case
    for rung in doc["rungs"]:
        for side in ("off", "on"):
            assert rung[side]["peak_memory_mib"] > 100  # torch and the models, at least
            assert set(rung[side]["latency_s"]) == {"ttft", "tpot", "itl", "e2e"}
            assert len(rung[side]["throughput_tok_s"]) == rung["repeats"] == 3
        assert rung["speedup"]["ci_low"] <= rung["speedup"]["ratio"] <= rung["speedup"]["ci_high"]
        counted = rung["counters"]
        assert (
            len(counted["accepted_per_position"]) == rung["k"]
            and counted["emitted"] == counted["drafts"] + counted["accepted"]
        )
        assert 1 <= rung["tau"] <= rung["k"] + 1 and len(rung["conditional_acceptance"]) == rung["k"]
    assert (tmp_path / "perf-engine" / "speedup.png").is_file() and (
        tmp_path / "perf-engine" / "throughput_latency.png"
    ).is_file()
    report = (tmp_path / "perf-engine" / "perf.md").read_text()
    assert doc["statement"].startswith("On ") and doc["statement"] in report
    assert "at concurrency 1 the speedup of speculation on over off is" in doc["statement"]
    assert "P(drafts 1..j all accepted)" in report and "P(draft j accepted | drafts 1..j-1 accepted)" in report
