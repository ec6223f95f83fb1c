"""The per-cell cost report (`losscheck bench cells`, `losscheck.report.cell_cost`), from a
hand-made certificate (no models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from losscheck import cli
from losscheck.cells.record import CellRecord
from losscheck.errors import LosscheckError
from losscheck.report import cell_cost, certificate
from losscheck.report.document import Certificate
from tests.support import ENVIRONMENT, manifest_record, result_json, verdict_json


def pit(cell: str, seconds: float, phases: dict[str, float], tested: int) -> dict:
    results = [result_json("pit.support", tested), result_json("pit.pooled_ks", tested)]
    return {
        "cell": cell,
        "nodeid": f"t::{cell}",
        "kind": "pit",
        "seconds": seconds,
        "target_passes": 30,
        "target_tokens": 70_000,
        "phases": phases,
        "sequences": tested // 16,
        "horizon": 16,
        "verdict": verdict_json(cell, *results),
        "outcome": "passed",
    }


CELLS = [
    pit("A-k4-T1", 6.0, {"requests": 0.0, "pilot": 1.0, "generate": 3.0, "score": 1.5, "conformance": 0.0}, 10_880),
    pit("E-k4-T1-w1", 4.0, {"requests": 0.0, "pilot": 0.5, "generate": 2.0, "score": 1.0, "conformance": 0.5}, 8_000),
    {
        "cell": "A-k4-greedy",
        "nodeid": "t::A-k4-greedy",
        "kind": "greedy",
        "seconds": 2.0,
        "target_passes": 60,
        "target_tokens": 5_000,
        "prompts": 48,
        "max_new_tokens": 64,
        "verdict": None,
        "outcome": "passed",
    },
    {
        "cell": "A-k1-T1-small",
        "nodeid": "t::A-k1-T1-small",
        "kind": "exact",
        "seconds": 8.0,
        "target_passes": 70,
        "target_tokens": 400_000,
        "sequences": 1_000,
        "horizon": 4,
        "verdict": verdict_json("A-k1-T1-small", result_json("exact.support", 1_000)),
        "outcome": "passed",
    },
    {"cell": "A-k8-T1", "nodeid": "t::A-k8-T1", "kind": "error", "passed": False, "outcome": "error", "error": "x"},
]


def certificate_dict() -> dict:
    """A certificate of two workers over `CELLS`, in its JSON form."""
    from losscheck.run.options import Options

    matrix = [{"cell": c["cell"], "mode": c["kind"], "argument": "sampling_cell"} for c in CELLS]
    manifests = [
        manifest_record(matrix, worker, environment={**ENVIRONMENT, "git_revision": "abc", "worker": worker})
        for worker in ("gw0", "gw1")
    ]
    meta = certificate.run_meta(Options(seed=7), ["-m", "lossless"])
    records = [CellRecord.from_json(c) for c in CELLS]
    cert = certificate.build(meta, manifests, records, 1, False).to_json()
    return {**cert, "created": "2026-12-01T12:00:00+00:00"}


def write_certificate(directory, cert: dict | None = None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "certificate.json").write_text(json.dumps(cert or certificate_dict()))
    return directory


def test_rows_totals_and_shares_of_a_certificate():
    report = cell_cost.report(Certificate.from_json(certificate_dict()), "run/certificate.json", wall_seconds=11.0)
    cost = report.to_json()  # as cost.json has it
    rows = {r["cell"]: r for r in cost["cells"]}
    assert [r["cell"] for r in cost["cells"]] == ["A-k1-T1-small", "A-k4-T1", "E-k4-T1-w1", "A-k4-greedy"]
    assert cost["untimed_cells"] == ["A-k8-T1"]
    assert [rows[c]["tokens_tested"] for c in ("A-k4-T1", "A-k4-greedy", "A-k1-T1-small")] == [10_880, 3_072, 4_000]
    assert rows["A-k4-T1"]["phase_shares"] == pytest.approx(
        {"requests": 0, "pilot": 1 / 6, "generate": 0.5, "score": 0.25, "conformance": 0, "other": 0.5 / 6}
    )
    assert rows["A-k4-greedy"]["phases"] == {} and rows["A-k4-greedy"]["phase_shares"] == {}
    t = cost["totals"]
    assert (t["cells"], t["cell_seconds"], t["target_passes"], t["target_tokens"]) == (4, 20.0, 190, 545_000)
    assert t["tokens_tested"] == 10_880 + 8_000 + 3_072 + 4_000
    assert t["by_kind"]["pit"] == {
        "cells": 2,
        "seconds": 10.0,
        "target_passes": 60,
        "target_tokens": 140_000,
        "tokens_tested": 18_880,
    }
    assert t["phase_shares"]["generate"] == pytest.approx(0.5) and t["phase_seconds"]["other"] == pytest.approx(0.5)
    assert sum(t["shares"].values()) == pytest.approx(1.0)
    assert list(t["shares"])[:3] == ["exact cells", "PIT generate", "PIT score"]
    assert t["shares"]["greedy cells"] == pytest.approx(0.1)
    headline = cell_cost.headline(report)
    assert headline.startswith("4 cells, 20 cell-seconds over 2 workers, 11 s wall; 190 target passes")
    assert "exact cells 40%, PIT generate 25%, PIT score 12%" in headline


def test_the_markdown_has_the_totals_and_a_row_per_cell():
    text = cell_cost.markdown(cell_cost.report(Certificate.from_json(certificate_dict()), "run/certificate.json"))
    assert "| all | 4 | 20.0 | 100% | 190 | 545,000 | 25,952 |" in text
    assert "| A-k4-T1 | pit | 6.00 | 30 | 70,000 | 10,880 | 0% | 17% | 50% | 25% | 0% | 8% |" in text
    assert "| A-k4-greedy | greedy | 2.00 | 60 | 5,000 | 3,072 | - | - | - | - | - | - |" in text
    assert "not timed (errored): `A-k8-T1`" in text and "`run/certificate.json` (git abc, seed 7)" in text


def test_bench_cells_reads_a_written_certificate(tmp_path, capsys):
    run = write_certificate(tmp_path / "run")
    assert cli.main(["bench", "cells", "--from", str(run), "--out", str(tmp_path / "out")]) == 0
    cost = json.loads((tmp_path / "out" / "cost.json").read_text())
    assert cost["schema"] == cell_cost.SCHEMA and cost["wall_seconds"] is None
    assert cost["certificate"]["path"] == (run / "certificate.json").as_posix()
    assert (tmp_path / "out" / "cost.md").read_text().startswith("# Cell cost — FAIL certificate")
    assert capsys.readouterr().out.startswith("4 cells, 20 cell-seconds")


def test_bench_cells_runs_the_main_job_through_certify(monkeypatch, tmp_path):
    """Without --from, `losscheck bench cells` is `losscheck certify` with its defaults, its
    certificate under OUT/certificate/, then the cost of what that run wrote."""
    from losscheck.plugin.hooks import RUN_DIR_KEY, VERDICT_KEY

    seen = []

    def fake_main(args, plugins):
        seen.extend(args)
        out = next(a.split("=", 1)[1] for a in args if a.startswith("--losscheck-out="))
        # relative, as --out was given; a hand-made certificate, so not named as `write_run` names a run
        run = write_certificate(Path(out) / "hand-made-run")
        config = pytest.Config.__new__(pytest.Config)
        config.stash = pytest.Stash()
        config.stash[VERDICT_KEY], config.stash[RUN_DIR_KEY] = "PASS", str(run)
        for plugin in plugins:
            plugin.pytest_unconfigure(config)
        return 0

    monkeypatch.setattr(pytest, "main", fake_main)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "cells", "--out", "cells"]) == 0
    assert "--losscheck-bundled=reference" in seen and "--losscheck-out=cells/certificate" in seen
    cost = json.loads((tmp_path / "cells" / "cost.json").read_text())
    assert cost["certificate"]["path"] == "cells/certificate/hand-made-run/certificate.json"
    assert cost["wall_seconds"] is not None


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no certificate at"),
        ("{not json", "is not valid JSON"),
        (json.dumps({**certificate_dict(), "cells": {"A-k4-T1": {}}}), "certificate.cells: expected an array"),
        (json.dumps({**certificate_dict(), "cells": [{"cell": "A-k4-T1", "kind": "pit"}]}), "'nodeid' is missing"),
        (
            json.dumps({**certificate_dict(), "cells": [{"cell": "A-k4-T1", "nodeid": "t", "outcome": "passed"}]}),
            "has no seconds",
        ),
        (
            json.dumps({**certificate_dict(), "cells": [{"cell": "A-k4-T1", "nodeid": "t", "outcome": "maybe"}]}),
            "cells[0].outcome: 'maybe' is not one of",
        ),
    ],
)
def test_a_missing_or_garbled_certificate_names_the_file_and_the_fix(tmp_path, capsys, content, expected):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "certificate.json").write_text(content)
    with pytest.raises(LosscheckError) as info:
        cell_cost.read(run)
    message = str(info.value)
    assert expected in message and str(run / "certificate.json") in message
    assert message.endswith(cell_cost.FIX)
    assert cli.main(["bench", "cells", "--from", str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"losscheck bench: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_from_without_cells_is_an_error(capsys):
    assert cli.main(["bench", "--from", "somewhere"]) == 2
    assert "--from names the certificate of --cells" in capsys.readouterr().err


def test_a_phase_the_table_does_not_know_is_kept_before_other():
    cert = certificate_dict()
    cert["cells"] = [pit("A-k4-T1", 6.0, {"pilot": 1.0, "looks": 2.0, "score": 1.0}, 10_880)]
    cost = cell_cost.report(Certificate.from_json(cert), "run/certificate.json")
    assert list(cost.totals.phase_seconds) == [*cell_cost.PHASES, "looks", cell_cost.OTHER]
    assert cost.totals.phase_seconds["other"] == pytest.approx(2.0)
    assert "| conformance | looks | other |" in cell_cost.markdown(cost)
