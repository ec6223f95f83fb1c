"""A `losscheck` subcommand as a record of the command table, and the exit statuses they share.

`losscheck.cli` adds one parser per `Command` and runs the one named; a new subcommand is one
module exposing its `COMMAND`, added to the table, with no branch anywhere else.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# The exit statuses (docs/certificate-and-ci.md): `losscheck certify`'s verdict's, or a usage error.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 4


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
