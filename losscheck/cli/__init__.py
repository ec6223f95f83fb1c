"""`losscheck`: certify a drafter, run the mutant catalogue, compare families, benchmark the loop,
time an engine and export its run in vLLM's terms, merge the certificates of a run's shards, run
the verifier tier, show where the bundled fixtures are.
Every subcommand exits by one table, `ExitStatus` (docs/errors.md).

The options shared with the pytest plugin come from `losscheck.run.options` (same names without the
`--losscheck-` prefix, same help); `certify` passes them on to pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import losscheck
from losscheck.cli import (
    bench,
    certify,
    compare,
    export_perf,
    families,
    fixtures,
    merge,
    mutants,
    perf,
    report,
    selftest,
    verifier_tier,
)
from losscheck.cli.certify import VERDICT_EXIT, certify_args, exit_status
from losscheck.cli.command import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_PARTIAL,
    EXIT_PASS,
    EXIT_USAGE,
    Command,
    ExitStatus,
    add_commands,
    from_pytest,
)
from losscheck.cli.perf import perf_args
from losscheck.errors import FLAG_PREFIX_ENV, LosscheckError

__all__ = [
    "COMMANDS",
    "EXIT_FAIL",
    "EXIT_INTERRUPTED",
    "EXIT_PARTIAL",
    "EXIT_PASS",
    "EXIT_USAGE",
    "VERDICT_EXIT",
    "ExitStatus",
    "certify_args",
    "exit_status",
    "from_pytest",
    "main",
    "parser",
    "perf_args",
    "run_command",
]

# The command table: one module per subcommand, each exposing its `COMMAND`; --help lists them in
# this order.
COMMANDS: tuple[Command, ...] = (
    certify.COMMAND,
    bench.COMMAND,
    families.COMMAND,
    mutants.COMMAND,
    perf.COMMAND,
    export_perf.COMMAND,
    report.COMMAND,
    compare.COMMAND,
    merge.COMMAND,
    verifier_tier.COMMAND,
    selftest.COMMAND,
    fixtures.COMMAND,
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="losscheck", description=__doc__)
    top.add_argument("--version", action="version", version=f"losscheck {losscheck.__version__}")
    add_commands(top.add_subparsers(dest="command", required=True), COMMANDS)
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:  # what follows is pytest's (`losscheck certify ... -- -k EXPR -x`)
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    os.environ[FLAG_PREFIX_ENV] = "--"  # option checks made while parsing name this command's options
    try:
        ns = parser().parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors exit 2; --help and --version 0
        return int(exc.code or 0)
    finally:
        os.environ.pop(FLAG_PREFIX_ENV, None)
    if extra and ns.command != certify.COMMAND.name:
        print(f"losscheck {ns.command}: error: only certify passes arguments after -- to pytest", file=sys.stderr)
        return EXIT_USAGE
    ns.pytest_extra = extra
    try:
        return run_command(ns)
    except LosscheckError as exc:  # a configuration problem: its message, not a traceback
        print(f"losscheck {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C outside pytest (which reports its own): the same status
        print(f"losscheck {ns.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run_command(ns: argparse.Namespace) -> int:
    """Run the subcommand `parser()` parsed into `ns`; its exit status."""
    return {command.name: command for command in COMMANDS}[ns.command].run(ns)
