"""docs/deprecations.md lists every deprecation the package raises, each with its removal, and the
paths it says are removed do not import."""

from __future__ import annotations

import importlib.util
import re

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
