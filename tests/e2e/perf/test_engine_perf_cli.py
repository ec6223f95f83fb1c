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


def test_losscheck_perf_times_hf_assisted_generation(tmp_path):
    command = [sys.executable, "-m", "losscheck.cli", "perf", "--engine", "hf"]
    command += ["--assistant", str(bundled.fixtures_dir() / "drafter_a"), "--perf-concurrency", "1,4"]
    command += ["--perf-k", "2,4"]  # a k sweep: the engine's own 4 and 2
    command += ["--out", str(tmp_path)]
    # tiny models: a second thread only contends (timing not asserted); the run is no xdist worker
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    # assisted generation runs one request at a time: concurrency 4 is skipped, saying so
    assert "runs one request at a time: timed at concurrency 1 only" in done.stdout
    doc = json.loads((tmp_path / "perf-engine" / "perf.json").read_text())
    assert doc["schema"] == "losscheck.engine-perf/1" and doc["engine"]["k"] == 4
    assert doc["engine"]["draft_model"]["path"] == "bundled:drafter_a" and "transformers" in doc["engine"]["package"]
    assert {(r["workload"], r["concurrency"], r["k"]) for r in doc["rungs"]} == {
        ("ladder", 1, 4),
        ("long-input", 1, 4),
        ("long-output", 1, 4),
        ("ladder", 1, 2),
    }
    for rung in doc["rungs"]:
        for side in ("off", "on"):
            assert set(rung[side]["latency_s"]) == {"ttft", "tpot", "itl", "e2e"}
            assert len(rung[side]["throughput_tok_s"]) == rung["repeats"] == 3
        assert rung["speedup"]["ci_low"] <= rung["speedup"]["ratio"] <= rung["speedup"]["ci_high"]
        counted = rung["counters"]
        assert (
            len(counted["accepted_per_position"]) == rung["k"]
            and counted["emitted"] == counted["drafts"] + counted["accepted"]
        )
        assert 1 <= rung["tau"] <= rung["k"] + 1 and len(rung["conditional_acceptance"]) == rung["k"]
    report = (tmp_path / "perf-engine" / "perf.md").read_text()
    assert doc["statement"].startswith("On ") and doc["statement"] in report
    assert "at concurrency 1 the speedup of speculation on over off is" in doc["statement"]
    assert "P(drafts 1..j all accepted)" in report and "P(draft j accepted | drafts 1..j-1 accepted)" in report
