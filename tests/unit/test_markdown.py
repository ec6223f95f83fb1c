"""The one Markdown-table renderer: layout, escaping, and a ragged row refused by name."""

from __future__ import annotations

import pytest

from losscheck.report.markdown import markdown_table


def test_header_separator_and_one_line_per_row():
    table = markdown_table(("name", "n"), [("A", 1), ("B", 2.5)])
    assert table == "| name | n |\n|---|---|\n| A | 1 |\n| B | 2.5 |\n"


def test_pipes_in_cells_and_headers_are_escaped():
    table = markdown_table(("cell: test", "a|b"), [("c1: exact|pit", "x")])
    assert table.splitlines() == ["| cell: test | a\\|b |", "|---|---|", "| c1: exact\\|pit | x |"]


def test_no_rows_gives_the_header_only():
    assert markdown_table(("a", "b", "c"), []) == "| a | b | c |\n|---|---|---|\n"


def test_a_row_of_the_wrong_width_is_refused_by_name():
    with pytest.raises(ValueError, match=r"row 1 \('B', 2, 'extra'\) has 3 cells; the table has 2 columns"):
        markdown_table(("name", "n"), iter([("A", 1), ("B", 2, "extra")]))
