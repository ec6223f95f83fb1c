"""Progress inside a long cell: written after pytest's marks, erased without a trace."""

from __future__ import annotations

import contextlib
import io

from _pytest._io import TerminalWriter

from losscheck.progress import TerminalProgress


class Config:
    """What TerminalProgress uses of pytest's config: the terminal writer and the capture manager."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.writer = TerminalWriter(self.out)
        self.pluginmanager = self

    def getplugin(self, name: str):
        assert name == "capturemanager"
        return self

    def global_and_fixture_disabled(self):
        return contextlib.nullcontext()

    def get_terminal_writer(self) -> TerminalWriter:
        return self.writer


def rendered(text: str) -> str:
    """The line a terminal shows for `text` (backspace moves left, characters overwrite)."""
    line: list[str] = []
    at = 0
    for ch in text:
        if ch == "\b":
            at = max(0, at - 1)
        else:
            line[at : at + 1] = [ch]
            at += 1
    return "".join(line).rstrip()


def test_progress_shows_the_stage_then_leaves_the_line_as_it_was():
    config = Config()
    config.writer.write("test_sampling.py ..")
    progress = TerminalProgress(config)
    progress.update("A-k4-T1", "sequences drawn", 0, 2555)
    assert rendered(config.out.getvalue()) == "test_sampling.py .. [A-k4-T1: sequences drawn 0/2555]"
    progress.update("A-k4-T1", "sequences scored", 2048, 2555)
    assert rendered(config.out.getvalue()) == "test_sampling.py .. [A-k4-T1: sequences scored 2048/2555]"
    progress.clear()
    config.writer.write(".")
    assert rendered(config.out.getvalue()) == "test_sampling.py ..."
