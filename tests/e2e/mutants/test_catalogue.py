"""The catalogue's bookkeeping on the bundled fixtures: names, cells, the gate's α, predicted
power, the catch table and the `losscheck mutants` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from losscheck.errors import OptionError
from losscheck.run.options import Options
from losscheck.run.session import Session
from losscheck.selftest import catalogue, get_mutant, names
from tests.support import ROOT


def test_the_catalogue_entries_are_complete():
    assert len(set(names())) == len(names()) >= 14
    for m in catalogue():
        assert m.kind in ("greedy", "sampling")
        assert m.bug_class and "\n" not in m.bug_class
        assert (m.first_token is None) == bool(m.no_law), m.name  # a law, or the reason there is none


def test_an_unknown_mutant_is_an_option_error_listing_the_catalogue():
    with pytest.raises(OptionError, match="rows_mixed_up"):
        get_mutant("residual_not_normalized")
    with pytest.raises(OptionError, match="not a registered planted bug"):
        _ = Session(Options(mutant="nope")).plant
    assert Session(Options(mutant="shared_uniform")).plant is get_mutant("shared_uniform")


@pytest.fixture(scope="module")
def session():
    from losscheck.selftest.catch import gate_session

    return gate_session(Session(Options()), None)


def test_mutant_cells_are_gate_cells_of_the_mutants_kind(session):
    from losscheck.plan.matrix import EXACT_CELL, GREEDY_CELL, PIT_CELL

    greedy = {c.id for c in session.plan[GREEDY_CELL]}
    statistical = {c.id for arg in (PIT_CELL, EXACT_CELL) for c in session.plan[arg]}
    for m in catalogue():
        ids = [c.id for c in m.cells(session.plan, session.options.profile)]
        assert ids, f"{m.name} shows in no gate cell"
        assert set(ids) <= (greedy if m.kind == "greedy" else statistical), m.name
    assert [c.id for c in get_mutant("temperature_q_only").cells(session.plan, session.options.profile)] == [
        "A-k1-T0.3-small",
        "A-k1-T1.5-small",
        "A-k4-T0.3",
        "A-k4-T1.5",
        "A-k4-T0.001",
        "A-k4-T5",
    ]
    assert [c.id for c in get_mutant("retired_row_leak").cells(session.plan, session.options.profile)] == [
        "A-k4-greedy-cb",
        "A-k4-greedy-prefix-warm-cb",
        "A-k4-greedy-cb-gaps3",
    ]


@pytest.mark.e2e
def test_the_mutant_tier_uses_the_alpha_of_the_lossless_gate(session):
    """The count behind the per-test α equals what `pytest -m lossless` collects as statistical."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "lossless and statistical",
            str(ROOT / "losscheck" / "plugin" / "certify"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    # A mode that is off ("[off]", skipped with its reason) spends no alpha.
    collected = sum(1 for line in out.splitlines() if "::" in line and "[off]" not in line)
    assert session.n_statistical == collected
    assert session.per_test_alpha == pytest.approx(0.01 / collected)


def test_predicted_power_is_alpha_for_a_lossless_law_and_high_for_a_lossy_one(session):
    from dataclasses import replace

    from losscheck.core.sampling import SamplingParams
    from losscheck.plan.matrix import Cell
    from losscheck.selftest import laws
    from losscheck.selftest.power import position0_level, predict

    cell = Cell("A", 4, SamplingParams(temperature=0.3), target="small")
    honest = replace(get_mutant("temperature_q_only"), first_token=laws.correct)
    none = predict(session, honest, cell)
    _, alpha = position0_level(session, cell)
    assert none.tv < 1e-6 and none.power == pytest.approx(alpha, rel=1e-3)
    lossy = predict(session, get_mutant("temperature_q_only"), cell)
    assert lossy.tv > 0.1 and lossy.power > 0.999
    greedy = predict(session, get_mutant("rows_mixed_up"), Cell("A", 4, SamplingParams(temperature=0.0)))
    assert greedy.power is None and greedy.note.startswith("n/a")


def test_catch_table_rows_and_files(tmp_path):
    from losscheck.selftest.catch import CatchMeta, CellCatch, CellPrediction, MutantReport, write_table
    from losscheck.selftest.power import Prediction

    caught = MutantReport(
        "m1",
        "Bug class one",
        "sampling",
        ["c1", "c2"],
        [
            CellCatch(
                "c1",
                "exact",
                True,
                ["exact.joint_gtest", "exact.position[0]"],
                "exact.position[0]",
                1e-30,
                "x",
                1.0,
                Prediction(1.0, 0.2, "exact.position[0]"),
            )
        ],
        1.0,
        CellPrediction("c1", 1.0, 0.2, "exact.position[0]"),
    )
    missed = MutantReport(
        "m2",
        "Bug | two",
        "greedy",
        ["g1"],
        [CellCatch("g1", "greedy", False, [], "", None, "", 1.0)],
        1.0,
        CellPrediction("g1", None, None, "n/a: greedy"),
    )
    meta = CatchMeta(seed=1, profile="ci", alpha=0.01, per_test_alpha=0.01 / 18, gate_statistical_tests=18)
    md, js = write_table([caught, missed], [], meta, tmp_path)
    text = md.read_text()
    assert "1/2 planted bugs caught" in text
    assert (
        "| m1 | Bug class one | sampling | yes | c1: exact.position[0] (+1 more) "
        "| p = 1e-30 | 1.0000 | 0.200 | 1/1 (2) |" in text
    )
    assert "Bug \\| two" in text and "| NO |" in text
    assert [m["caught"] for m in json.loads(js.read_text())["mutants"]] == [True, False]


def test_the_mutants_command_writes_the_catch_table(tmp_path, capsys):
    from losscheck.cli import main

    assert main(["mutants", "rows_mixed_up", "--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / "catch_table.json").read_text())
    assert [m["name"] for m in table["mutants"]] == ["rows_mixed_up"] and table["mutants"][0]["caught"]
    assert table["control"] and not any(c["failed"] for c in table["control"])
    assert "rows_mixed_up" in (tmp_path / "catch_table.md").read_text()
    assert "1/1 planted bugs caught" in capsys.readouterr().out
