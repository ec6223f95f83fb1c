"""The certificate's accounting, from hand-made manifests and records (no models)."""

from __future__ import annotations

import json

import pytest
import torch

from losscheck.cells.record import CellRecord
from losscheck.errors import LosscheckError
from losscheck.report import certificate, compare
from losscheck.report.manifest import Manifest, drafter_identity, weights_sha256
from losscheck.run.options import Options
from tests.support import acceptance_json, assert_valid_certificate, cell_record, manifest_record

MATRIX = [
    {"cell": "A-k4-greedy", "mode": "greedy", "argument": "greedy_cell"},
    {"cell": "A-k4-T1", "mode": "pit", "argument": "sampling_cell"},
]


def manifest(worker: str = "gw0", matrix: list | None = None) -> Manifest:
    return manifest_record(MATRIX if matrix is None else matrix, worker)


def record(cell: str, passed: bool = True, outcome: str | None = None, tau: float = 3.0) -> CellRecord:
    return cell_record(
        cell,
        outcome or ("passed" if passed else "failed"),
        kind="greedy",
        passed=passed,
        acceptance={"mid": acceptance_json(tau)},
    )


def build(manifests: list, records: list, exit_status: int = 0, interrupted: bool = False) -> dict:
    return certificate.build(
        certificate.run_meta(Options(), ["-m", "lossless"]), manifests, records, exit_status, interrupted
    )


def test_pass_needs_every_cell_of_the_matrix_run_and_passed():
    cert = build([manifest("gw0"), manifest("gw1")], [record("A-k4-greedy"), record("A-k4-T1")])
    assert cert.verdict == "PASS" and cert.counts.passed == 2
    assert set(cert.environment.workers) == {"gw0", "gw1"}


def test_a_selection_is_partial_and_names_what_did_not_run():
    cert = build([manifest()], [record("A-k4-greedy")])
    assert cert.verdict == "PARTIAL"
    assert [m.cell for m in cert.matrix if m.status == "not run"] == ["A-k4-T1"]
    assert "Not run (1): `A-k4-T1`" in certificate.markdown(cert)


@pytest.mark.parametrize(
    "bad, status",
    [(record("A-k4-T1", passed=False), "failed"), (record("A-k4-T1", passed=False, outcome="error"), "errored")],
)
def test_a_failed_or_errored_cell_fails_even_a_partial_run(bad, status):
    cert = build([manifest()], [bad], exit_status=1)
    assert cert.verdict == "FAIL" and cert.to_json()["counts"][status] == 1


def test_an_interrupted_run_is_interrupted_whatever_passed():
    cert = build([manifest()], [record("A-k4-greedy")], exit_status=2, interrupted=True)
    assert cert.verdict == "INTERRUPTED" and "1 not run" in cert.reason


def test_a_failure_outside_the_matrix_fails_the_certificate():
    cert = build([manifest()], [record("A-k4-greedy"), record("A-k4-T1")], exit_status=1)
    assert cert.verdict == "FAIL" and "outside the matrix" in cert.reason


def test_workers_that_planned_different_matrices_fail_it():
    cert = build([manifest(), manifest("gw1", MATRIX[:1])], [record("A-k4-greedy"), record("A-k4-T1")])
    assert cert.verdict == "FAIL" and "different matrices" in cert.reason


def test_a_cell_outside_the_planned_matrix_is_a_problem():
    cert = build([manifest()], [record("A-k4-greedy"), record("A-k4-T1"), record("Z-k1-greedy")])
    assert cert.verdict == "FAIL" and "Z-k1-greedy ran but is not in the planned matrix" in cert.reason


def test_without_a_manifest_the_matrix_is_unknown_so_at_most_partial():
    cert = build([], [record("A-k4-greedy")])
    assert cert.verdict == "PARTIAL" and "matrix is unknown" in cert.reason


def test_write_load_report_and_compare_round_trip(tmp_path):
    before = build([manifest()], [record("A-k4-greedy", tau=3.0), record("A-k4-T1")])
    after = build([manifest()], [record("A-k4-greedy", tau=3.5), record("A-k4-T1", passed=False)], exit_status=1)
    runs = [certificate.write_run(tmp_path / name, cert) for name, cert in (("a", before), ("b", after))]
    for run in runs:
        assert_valid_certificate(json.loads((run / "certificate.json").read_text()))
    loaded = [certificate.load(run) for run in runs]
    assert loaded[0].verdict == "PASS" and (runs[0] / "summary.md").exists()
    rows, regressions = compare.compare(*loaded)
    assert ["A-k4-greedy", "passed", "passed", "3.000", "3.500", "+0.500"] in rows
    assert regressions == ["verdict PASS -> FAIL", "cell A-k4-T1: passed -> failed"]
    assert compare.compare(loaded[0], loaded[0])[1] == []


def test_load_names_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(LosscheckError, match="no certificate at"):
        certificate.load(tmp_path)
    (tmp_path / "certificate.json").write_text(json.dumps({"schema": "other/1"}))
    with pytest.raises(LosscheckError, match="this losscheck reads 'losscheck.certificate/2'"):
        certificate.load(tmp_path)


class Holder:
    def __init__(self, module: torch.nn.Module | None) -> None:
        self.name, self.block_lengths, self.widths = "h", (1,), ()
        if module is not None:
            self.model = module


def test_weights_hash_follows_every_tensor_and_says_when_there_is_none():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    before = weights_sha256(Holder(layer))
    assert before == weights_sha256(Holder(layer)) and len(before) == 64
    with torch.no_grad():
        layer.weight[0, 0] += 1e-6
    assert weights_sha256(Holder(layer)) != before
    assert weights_sha256(Holder(layer.to(torch.bfloat16))) not in (before, None)
    identity = drafter_identity(Holder(None))
    assert identity["weights_sha256"] is None and "identity" in identity["hash_note"]


def test_a_run_without_the_slow_tier_says_the_quick_gate_is_complete():
    matrix = [MATRIX[0], {**MATRIX[1], "slow": True}]
    cert = build([manifest(matrix=matrix)], [record("A-k4-greedy")])
    assert cert.verdict == "PARTIAL" and "quick gate is complete" in cert.reason


def test_model_paths_in_a_certificate_are_portable(tmp_path, monkeypatch):
    """A certificate attached to a release names a bundled model by its fixture name and any
    other by a path relative to where the run started, never by the machine's absolute path."""
    from losscheck import bundled
    from losscheck.report.manifest import portable

    target = bundled.target_path()
    assert portable({"path": str(target), "sha256": "x"}) == {"path": "bundled:target", "sha256": "x"}
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert portable({"path": str(tmp_path / "models" / "mine")})["path"] == "models/mine"
    assert portable({"name": "no path"}) == {"name": "no path"}


def test_the_cost_adds_the_cells_seconds_by_kind_and_phase():
    from losscheck.report.certificate import cost, cost_lines

    records = [
        cell_record(
            "a",
            kind="pit",
            seconds=10.0,
            phases={"generate": 6.0, "score": 3.0},
            target_passes=3,
            target_tokens=1200,
        ),
        cell_record("b", kind="pit", seconds=5.0, phases={"generate": 4.0, "score": 0.5}),
        cell_record("c", kind="greedy", seconds=1.0),
        cell_record("d", "error", kind="error"),  # errored before a time was taken
    ]
    found = cost(records)
    assert found.cell_seconds == 16.0 and found.by_kind == {"greedy": 1.0, "pit": 15.0}
    assert found.pit_phases == {"generate": 10.0, "score": 3.5}
    assert [s.cell for s in found.slowest] == ["a", "b", "c"]
    assert cost_lines(records)[-1] == (
        "Cell time: 16 s summed over workers (greedy 1, pit 15); 3 target passes over 1,200 token positions; "
        "PIT cells by phase: generate 10, score 4"
    )
    assert cost_lines([cell_record("x", kind="pit")]) == []


def test_a_cell_that_could_not_run_reads_not_run_in_the_table_never_fail():
    from losscheck.cells.record import RunFacts
    from losscheck.report.summary import summary_rows

    skipped = CellRecord("engine-k4-T1", RunFacts("n", "skipped", skip_reason="no seed"))
    assert summary_rows([skipped])[0][:3] == ("engine-k4-T1", "?", "NOT RUN")


def test_an_engines_counters_give_its_tau_column_and_both_acceptance_curves():
    from losscheck.report.summary import summary_rows

    counted = {"drafts": 10, "drafted": 40, "accepted": 20, "accepted_per_position": [8, 6, 4, 2]}
    engine_cell = cell_record("engine-k4-T1", engine_counters=counted)
    assert CellRecord.from_json(json.loads(json.dumps(engine_cell.to_json()))) == engine_cell
    assert summary_rows([engine_cell])[0][3] == "3.00"  # tau = 1 + accepted / drafts
    lines = certificate.engine_counter_lines([engine_cell, cell_record("A-k4-T1")])
    assert lines[-1] == (
        "- `engine-k4-T1`: 10 drafts; 40 drafted; 20 accepted; tau 3.00; "
        "cumulative P(drafts 1..j all accepted) 0.800 / 0.600 / 0.400 / 0.200; "
        "conditional P(draft j accepted | drafts 1..j-1 accepted) 0.800 / 0.750 / 0.667 / 0.500"
    )
    assert certificate.engine_counter_lines([cell_record("A-k4-T1")]) == []
