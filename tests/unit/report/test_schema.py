"""The published JSON schema of certificate.json: a valid draft 2020-12 schema that every
certificate losscheck writes follows, and that rejects a broken one."""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from losscheck.report import certificate
from tests.support import ROOT, assert_valid_certificate, certificate_errors
from tests.unit.report.test_certificate import build, manifest, record
from tests.unit.report.test_certificate import record as record_of


def written(cert, tmp_path: Path) -> dict:
    """`cert` as `write_run` writes it, read back as JSON."""
    return json.loads((certificate.write_run(tmp_path, cert) / "certificate.json").read_text())


def test_the_schema_is_a_draft_2020_12_schema_of_this_certificate_version():
    schema = json.loads(files("losscheck.report").joinpath("certificate.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["properties"]["schema"]["const"] == certificate.SCHEMA
    assert set(schema["properties"]["verdict"]["enum"]) == set(certificate.VERDICTS)
    assert set(schema["$defs"]["cell_record"]["required"]) == {"cell", "nodeid", "outcome"}


@pytest.mark.parametrize(
    "manifests, records, status, interrupted",
    [
        ([manifest()], [record("A-k4-greedy"), record("A-k4-T1")], 0, False),  # PASS
        ([manifest()], [record("A-k4-greedy")], 0, False),  # PARTIAL: a selection
        ([], [record("A-k4-greedy")], 0, False),  # PARTIAL: no manifest, the matrix unknown
        ([manifest()], [record("A-k4-T1", passed=False, outcome="error")], 1, False),  # FAIL
        ([manifest()], [record("A-k4-greedy")], 2, True),  # INTERRUPTED
        ([], [], 4, False),  # nothing ran
    ],
)
def test_every_verdict_as_written_follows_the_schema(tmp_path, manifests, records, status, interrupted):
    assert_valid_certificate(written(build(manifests, records, status, interrupted), tmp_path))


@pytest.mark.parametrize("name", ["certificate.schema.json", "perf.schema.json", "engine-perf.schema.json"])
def test_each_published_schema_is_valid_and_the_one_its_records_generate(name):
    from losscheck.report import schema

    Draft202012Validator.check_schema(schema.published(name))
    assert set(schema.PUBLISHED) == {"certificate.schema.json", "perf.schema.json", "engine-perf.schema.json"}
    assert schema.published(name) == schema.generated(name), "run `python -m losscheck.report.schema` and commit"


def test_the_published_schema_is_the_one_generated_from_the_record():
    """The record's definitions in certificate.schema.json are `CellRecord`'s, as
    `python -m losscheck.report.schema` writes them."""
    from losscheck.report import schema

    assert schema.published() == schema.generated(), "run `python -m losscheck.report.schema` and commit the file"


def test_a_record_round_trips_through_its_json_and_a_wrong_value_is_named():
    from losscheck.cells.record import CellRecord
    from losscheck.errors import LosscheckError

    record = record_of("A-k4-T1")
    assert CellRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    bad = {**record.to_json(), "k": "four"}
    with pytest.raises(LosscheckError, match=r"cell_record\.k: expected int, found 'four'"):
        CellRecord.from_json(bad)
    nested = json.loads(json.dumps(record.to_json()))
    nested["acceptance"]["mid"]["proposed"][1] = None
    with pytest.raises(LosscheckError, match=r"cell_record\.acceptance\.mid\.proposed\[1\]: expected int, found None"):
        CellRecord.from_json(nested)


def test_the_committed_certificates_follow_the_schema():
    paths = sorted((ROOT / "reports").glob("**/certificate.json"))
    assert paths, "reports/ holds no certificate"
    for path in paths:
        errors = certificate_errors(json.loads(path.read_text()))
        assert not errors, f"{path.relative_to(ROOT)}:\n" + "\n".join(errors)


def broken(change) -> dict:
    cert = json.loads(json.dumps(build([manifest()], [record("A-k4-greedy"), record("A-k4-T1")]).to_json()))
    change(cert)
    return cert


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda c: c.pop("verdict"), "(top): 'verdict' is a required property"),
        (lambda c: c.update(verdict="LOSSLESS"), "verdict: 'LOSSLESS' is not one of"),
        (lambda c: c.update(schema="losscheck.certificate/1"), "schema: 'losscheck.certificate/2' was expected"),
        (lambda c: c["counts"].update(passed="2"), "counts/passed: '2' is not of type 'integer'"),
        (lambda c: c["counts"].update(skipped=0), "counts: Additional properties are not allowed"),
        (lambda c: c["cells"][0].pop("nodeid"), "cells/0: 'nodeid' is a required property"),
        (lambda c: c["matrix"][1].update(status="flaky"), "matrix/1/status: 'flaky' is not one of"),
        (lambda c: c["targets"]["main"].update(sha256=7), "targets/main/sha256: 7 is not of type"),
        (lambda c: c.update(scope={"declared": "greedy", "out": [{"cell": "A-k4-T1"}]}), "scope/out/0: 'reason'"),
    ],
)
def test_the_schema_rejects_a_broken_certificate(change, where):
    assert_valid_certificate(broken(lambda c: None))
    errors = certificate_errors(broken(change))
    assert any(e.startswith(where) for e in errors), errors
    with pytest.raises(AssertionError, match="breaks certificate.schema.json"):
        assert_valid_certificate(broken(change))


def test_the_certificate_lists_the_registered_tests(tmp_path):
    """The tests a sampled cell's alpha is split over, as certificate.json and summary.md name them,
    come from the registry: per family, the alpha-spending ones are the registry's budget count."""
    from losscheck.report.manifest import registered_tests
    from losscheck.stats import registry

    tests = registered_tests()
    for family in ("pit", "conditional", "conformance"):
        assert sum(t.spends_alpha for t in tests if t.family == family) == registry.budget_count(family)
    assert {t.name for t in tests} == {t.name for t in registry.all_tests()}
    plain = manifest()
    with_tests = dataclasses.replace(plain, alpha=dataclasses.replace(plain.alpha, tests=tests))
    cert = written(build([with_tests], [record("A-k4-greedy"), record("A-k4-T1")]), tmp_path)
    assert_valid_certificate(cert)
    assert cert["alpha"]["tests"] == [dataclasses.asdict(t) for t in tests]
    summary = certificate.markdown(certificate.Certificate.from_json(cert))
    assert "`pit.pooled_chisquare`" in summary and "`pit.token_counts` (anytime)" in summary
