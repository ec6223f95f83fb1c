"""The run file and the regression compare."""

from __future__ import annotations

import dataclasses
import json

import pytest

from losscheck.errors import OptionError
from losscheck.report import perf_run
from tests.unit.perf.runs import ENVIRONMENT, run_file


def test_thresholds_parse_and_bad_ones_name_the_entry():
    assert perf_run.parse_thresholds("speedup:10%, tau:2.5%") == (
        perf_run.Threshold("speedup", 0.10),
        perf_run.Threshold("tau", 0.025),
    )
    for bad, says in (
        ("speed:10%", "'speed:10%'"),
        ("tau:5", "'tau:5'"),
        ("tau:x%", "not a percentage"),
        ("tau:100%", "drop must be"),
        ("", "at least one"),
    ):
        with pytest.raises(OptionError, match=says):
            perf_run.parse_thresholds(bad)


def test_a_drop_beyond_the_threshold_fails_and_within_it_passes():
    saved = run_file(2.0, 4.0)
    thresholds = perf_run.parse_thresholds("speedup:10%,tau:5%")
    ok = perf_run.compare(run_file(1.85, 3.9), saved, thresholds)  # -7.5%, -2.5%
    assert [c.failed for c in ok] == [False, False]
    bad = perf_run.compare(run_file(1.7, 3.7), saved, thresholds)  # -15%, -7.5%
    assert [c.failed for c in bad] == [True, True]
    assert "REGRESSED" in bad[0].line() and "-15.0%" in bad[0].line()
    assert perf_run.compare(run_file(3.0, 5.0), saved, thresholds)[0].failed is False  # faster is no regression


def test_only_rungs_in_both_runs_are_compared():
    thresholds = perf_run.parse_thresholds("tau:1%")
    assert perf_run.compare(run_file(1.0, 1.0, concurrency=8), run_file(2.0, 4.0), thresholds) == []


def test_load_round_trips_and_refuses_what_it_cannot_read(tmp_path):
    path = tmp_path / "run" / "perf.json"
    perf_run.save(run_file(2.0, 4.0), path)
    assert perf_run.load(path) == run_file(2.0, 4.0)
    from jsonschema import Draft202012Validator

    from losscheck.report import schema

    Draft202012Validator(schema.published("perf.schema.json")).validate(json.loads(path.read_text()))
    with pytest.raises(OptionError, match="no such file"):
        perf_run.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(OptionError, match="not JSON"):
        perf_run.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"schema": "losscheck.perf/0"}))
    with pytest.raises(OptionError, match="losscheck.perf/0"):
        perf_run.load(tmp_path / "old.json")
    broken = run_file(2.0, 4.0).to_json()
    del broken["rungs"][0]["tau"]  # type: ignore[index]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(OptionError, match=r"broken.json.*perf_run.rungs\[0\]: 'tau' is missing"):
        perf_run.load(tmp_path / "broken.json")


def test_environment_changes_are_listed():
    elsewhere = dataclasses.replace(ENVIRONMENT, device="cuda:0")
    now = run_file(2.0, 4.0, environment=elsewhere, target={"name": "t", "sha256": "y"})
    found = perf_run.environment_changes(now, run_file(2.0, 4.0))
    assert "device: cpu -> cuda:0" in found and any("another sha256" in f for f in found)
