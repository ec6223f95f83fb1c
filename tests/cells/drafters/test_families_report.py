"""`losscheck families` on a tiny budget: every drafter, group, k and mode gets a row, the files
are written and the self-draft oracle accepts everything; the rendering needs only the document."""

from __future__ import annotations

import json

from losscheck.cli import main
from losscheck.perf.families import prompt_groups
from losscheck.report.families import FamiliesTable, markdown


def test_one_token_prompts_form_their_own_group():
    groups = prompt_groups({"low": [[0], [0, 2, 5]], "mid": [[0], [0, 3]], "high": [[0, 4, 9]]})
    assert groups == {"low": [[0, 2, 5]], "mid": [[0, 3]], "high": [[0, 4, 9]], "bos": [[0]]}


def test_families_command_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "families"
    assert main(["families", "--out", str(out), "--ks", "2", "--max-new", "3", "--repeats", "1"]) == 0
    doc = json.loads((out / "table.json").read_text())
    labels = set(doc["drafters"])
    assert labels == {"A", "B", "C", "D", "E", "eagle3", "peagle", "dflash", "dspark", "self", "C w4", "E w4"}
    assert len(doc["runs"]) == len(labels) * 1 * 2 * 4  # drafters x k x modes x groups
    for run in doc["runs"]:
        assert run["k"] == 2 and len(run["slot_acceptance"]) == 2
        assert 1 <= run["acceptance_length"] <= 3
        if run["drafter"] == "self":
            assert run["accepted"] == run["proposed"]
    table = (out / "table.md").read_text()
    assert "| E w4 | 2 |" in table and "## T1" in table
    assert (out / "slot_acceptance.png").stat().st_size > 10_000
    assert markdown(FamiliesTable.from_json(doc)) == table  # table.md is the document's rendering, nothing else
