"""A `losscheck` subcommand as a record of the command table, and the exit statuses they share
(`ExitStatus`, docs/errors.md): one table for every subcommand, pytest's own statuses mapped onto it
by the subcommands that run pytest (`from_pytest`).

`losscheck.cli` adds one parser per `Command` and runs the one named; a new subcommand is one
module exposing its `COMMAND`, added to the table, with no branch anywhere else.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import pytest


class ExitStatus(enum.IntEnum):
    """What every `losscheck` subcommand exits with (docs/errors.md)."""

    PASS = 0  # success; for a certificate, the verdict PASS
    FAIL = 1  # a cell or check failed or errored, or the later run regressed (`compare`)
    USAGE = 2  # a usage or option error, caught before anything ran
    PARTIAL = 3  # nothing failed, but cells in scope did not run (or none did)
    INTERRUPTED = 4  # the run was stopped (Ctrl-C)


EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_PARTIAL, EXIT_INTERRUPTED = ExitStatus

# pytest's exit status -> ours, for the subcommands that run pytest (`certify`, `perf`): pytest's 2 is
# an interruption and its 4 a usage error, where ours are the other way round.
PYTEST_EXIT = {
    pytest.ExitCode.OK: ExitStatus.PASS,
    pytest.ExitCode.TESTS_FAILED: ExitStatus.FAIL,
    pytest.ExitCode.INTERRUPTED: ExitStatus.INTERRUPTED,
    pytest.ExitCode.INTERNAL_ERROR: ExitStatus.FAIL,
    pytest.ExitCode.USAGE_ERROR: ExitStatus.USAGE,
    pytest.ExitCode.NO_TESTS_COLLECTED: ExitStatus.PARTIAL,  # a selection that ran nothing
}


def from_pytest(status: int) -> ExitStatus:
    """Our exit status for pytest's `status` (a status pytest does not define is a failure)."""
    try:
        return PYTEST_EXIT[pytest.ExitCode(status)]
    except ValueError:
        return ExitStatus.FAIL


@dataclass(frozen=True)
class Command:
    """One subcommand: `losscheck NAME ...` parsed by a parser `add_arguments` fills, run by `run`."""

    name: str  # as typed after `losscheck`
    help: str  # its line in the parent command's --help
    add_arguments: Callable[[argparse.ArgumentParser], None]  # its options and positionals, on its own parser
    run: Callable[[argparse.Namespace], int]  # the parsed command line -> the exit status


def add_commands(subparsers: argparse._SubParsersAction, commands: Iterable[Command]) -> None:
    """One parser per command under `subparsers`, in table order (the order --help lists them)."""
    for command in commands:
        command.add_arguments(subparsers.add_parser(command.name, help=command.help))


def parse(
    command: Command, argv: Sequence[str], namespace: argparse.Namespace | None = None, parent: str = "losscheck"
) -> argparse.Namespace:
    """`argv` parsed by `command`'s own parser, outside the table: a command that runs another
    (`bench cells` runs `certify`), or the old form of one rewritten to its new command line."""
    parser = argparse.ArgumentParser(prog=f"{parent} {command.name}")
    command.add_arguments(parser)
    return parser.parse_args(argv, namespace)
