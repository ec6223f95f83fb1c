"""Progress inside a long cell (sequences drawn, scored), on an interactive terminal only.

A sampled cell on a large target can take minutes between pytest's own progress marks. The runner
reports its stages to `Session.progress`; in a non-interactive log (CI, a file, an xdist worker,
whose output pytest never shows) that is `QUIET` and nothing is written.
"""

from __future__ import annotations

from typing import Any, Protocol


class Progress(Protocol):
    def update(self, cell: str, stage: str, done: int, total: int) -> None:
        """`done` of `total` units of `stage` ("sequences drawn", "sequences scored"…) of `cell`."""

    def clear(self) -> None:
        """Erase what was shown (the cell ended)."""


class Quiet:
    def update(self, cell: str, stage: str, done: int, total: int) -> None:
        pass

    def clear(self) -> None:
        pass


QUIET = Quiet()


class TerminalProgress:
    """Writes after pytest's own marks on the current line and erases itself with backspaces, so
    the line reads as if it had never been there."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.shown = 0

    def update(self, cell: str, stage: str, done: int, total: int) -> None:
        self._write(f" [{cell}: {stage} {done}/{total}]")

    def clear(self) -> None:
        self._write("")

    def _write(self, text: str) -> None:
        capture = self.config.pluginmanager.getplugin("capturemanager")
        writer = self.config.get_terminal_writer()
        erase = "\b" * self.shown + " " * self.shown + "\b" * self.shown
        with capture.global_and_fixture_disabled():
            writer.write(erase + text, flush=True)
        self.shown = len(text)
