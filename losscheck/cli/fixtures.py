"""`losscheck fixtures`: where the bundled fixtures are, for `--target "$(losscheck fixtures)/..."`."""

from __future__ import annotations

import argparse

from losscheck.cli.command import EXIT_PASS, Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(ns: argparse.Namespace) -> int:
    from losscheck.bundled import fixtures_dir

    print(fixtures_dir())
    return EXIT_PASS


COMMAND = Command(
    "fixtures",
    'print the bundled fixtures directory (e.g. --target "$(losscheck fixtures)/text_target")',
    add_arguments,
    run,
)
