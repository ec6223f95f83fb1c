"""docs/deprecations.md lists every deprecation the package raises, each with its removal, and the
paths it says are removed do not import."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys

import pytest

from tests.support import ROOT

TABLE = ROOT / "docs" / "deprecations.md"


def rows() -> list[list[str]]:
    lines = [line for line in TABLE.read_text(encoding="utf-8").splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]  # the header left out


def test_every_module_that_deprecates_is_in_the_table_with_its_removal():
    raising = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "losscheck").rglob("*.py")
        if re.search(r"^\s*DeprecationWarning,", path.read_text(encoding="utf-8"), re.M)
    }
    listed = {row[2].strip("`") for row in rows() if row[2] != "-"}
    assert raising == listed, (
        f"raised but not listed: {sorted(raising - listed)}; listed but not raised: {sorted(listed - raising)}"
    )
    assert all(row[4] == "0.2.0" or row[4].startswith("removed ") for row in rows())


def test_the_removed_paths_are_gone():
    removed = [row for row in rows() if row[4].startswith("removed ")]
    assert len(removed) == 2
    for module in ("losscheck.sampling", "losscheck.certify"):
        assert importlib.util.find_spec(module) is None, module


MOVED_CELL_MODULES = {  # the engine cell's modules before losscheck.cells.engine: old -> (new, a name)
    "blackbox": ("losscheck.cells.engine", "run_engine_cell"),
    "engine_phases": ("losscheck.cells.engine.phases", "draw_side_by_side"),
    "engine_rounds": ("losscheck.cells.engine.rounds", "RoundsScoring"),
    "engine_logprobs": ("losscheck.cells.engine.logprobs", "engine_logprob_check"),
    "proxy_design": ("losscheck.cells.engine.proxy", "ProxyDesign"),
    "attribution": ("losscheck.cells.engine.attribution", "attribution_tests"),
    "draft_law": ("losscheck.cells.engine.draft_law", "checked"),
    "streams": ("losscheck.cells.engine.streams", "stream_check"),
}


@pytest.mark.parametrize("old", sorted(MOVED_CELL_MODULES))
def test_a_moved_engine_cell_module_warns_and_gives_the_same_objects(old):
    new, name = MOVED_CELL_MODULES[old]
    sys.modules.pop(f"losscheck.cells.{old}", None)  # the warning comes at import
    with pytest.warns(DeprecationWarning, match=rf"losscheck\.cells\.{old} moved to .*{re.escape(new)}"):
        alias = importlib.import_module(f"losscheck.cells.{old}")
    assert getattr(alias, name) is getattr(importlib.import_module(new), name)
