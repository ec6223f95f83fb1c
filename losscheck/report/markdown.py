"""The one Markdown-table renderer behind every report (summary, catch table, families, bench)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured table: header, `|---|` separator, one line per row, ending in a newline.

    Cells are rendered with `str`, a `|` in one escaped as `\\|`. A row whose length differs from
    `columns` raises `ValueError` naming the row, rather than shifting cells under wrong headers.
    """

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |\n"

    lines = [line(columns), "|" + "---|" * len(columns) + "\n"]
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(
                f"row {i} {tuple(row)!r} has {len(row)} cells; the table has {len(columns)} columns {tuple(columns)!r}"
            )
        lines.append(line(row))
    return "".join(lines)
