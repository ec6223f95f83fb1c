"""Progress of a run: one line per finished cell with the elapsed and the remaining time
(`CellProgress`, on the terminal and in CI logs alike, under xdist too), and inside a long cell
its stages (sequences drawn, scored) on an interactive terminal only.

A sampled cell on a large target can take minutes between pytest's own progress marks. The runner
reports its stages to `Session.progress`; in a non-interactive log (CI, a file, an xdist worker,
whose output pytest never shows) that is `QUIET` and nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
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


class CellProgress:
    """Writes a line as each cell finishes: `[done/total] cell verdict seconds — elapsed, ~left`.

    The remaining time is the estimate of the cells not yet finished (`losscheck.plan.cost`, from
    the manifest's matrix), scaled by how the finished cells' time compared with their estimate.
    """

    def __init__(self, write: Any, started: float | None = None) -> None:
        self.write = write  # one line of text -> shown
        self.started = time.monotonic() if started is None else started
        self.selected: set[str] | None = None  # cell ids collected (None: not known yet)
        self.estimates: dict[str, float] = {}
        self.done: dict[str, float] = {}  # cell -> its estimate, once finished

    def collected(self, cells: Iterable[str]) -> None:
        self.selected = set(cells) if self.selected is None else self.selected | set(cells)

    def planned(self, estimates: Mapping[str, float]) -> None:
        """The plan's estimated seconds per cell (the first plan to arrive counts)."""
        if not self.estimates:
            self.estimates = dict(estimates)

    def finished(self, cell: str, verdict: str, seconds: float | None) -> None:
        if cell in self.done:
            return
        self.done[cell] = self.estimates.get(cell, 0.0)
        cells = [c for c in self.estimates if self.selected is None or c in self.selected] or list(self.done)
        elapsed = time.monotonic() - self.started
        left_estimate = sum(self.estimates.get(c, 0.0) for c in cells if c not in self.done)
        done_estimate = sum(self.done.values())
        left = left_estimate * elapsed / done_estimate if done_estimate > 0 else None
        took = f" {seconds:.1f} s" if seconds is not None else ""
        remaining = f", ~{_clock(left)} left" if left is not None and len(self.done) < len(cells) else ""
        self.write(f"[{len(self.done)}/{len(cells)}] {cell} {verdict}{took} — {_clock(elapsed)} elapsed{remaining}")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
