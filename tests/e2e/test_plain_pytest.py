"""`pytest -m lossless --losscheck-drafter=...` in an empty directory, without `--pyargs`, collects
the matrix (which paths it joins, in process: tests/unit/test_plugin_collect.py)."""

from __future__ import annotations

import re

import pytest

from losscheck import bundled
from losscheck.run.options import Options
from losscheck.run.session import Session

pytest_plugins = ["pytester"]


DRAFTER = str(bundled.fixtures_dir() / "drafter_a")


@pytest.fixture(scope="module")
def planned() -> set[str]:
    """The plan's cells, built before `pytester` (which drops the modules a test imports)."""
    return {c.id for cells in Session(Options(drafter=DRAFTER), skeleton=True).plan.values() for c in cells}


def test_plain_pytest_in_an_empty_directory_collects_the_planned_cells_once(planned, pytester):
    args = ("-p", "no:cacheprovider", "-m", "lossless", f"--losscheck-drafter={DRAFTER}", "--collect-only", "-q")
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0, result.stdout.str()[-3000:]
    # a test whose cell argument the plan leaves empty collects one skipped "off" item
    ids = (m.group(1) for line in result.stdout.lines if (m := re.search(r"\.py::\w+\[(.+)\]$", line)))
    collected = [i for i in ids if i != "off"]
    assert planned and set(collected) == planned, sorted(set(collected) ^ planned)[:5]
    assert len(collected) == len(set(collected))
