"""`losscheck mutants`: the gate run against the planted-bug catalogue (`losscheck.selftest`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from losscheck.cli.command import Command
from losscheck.run.options import add_options, from_parsed

# The options of `losscheck certify` that `losscheck mutants` takes.
EXPERIMENT_OPTIONS = ("seed", "alpha", "profile", "detect-tv", "exact", "target", "drafter")


def add_arguments(mut: argparse.ArgumentParser) -> None:
    mut.add_argument(
        "names",
        nargs="*",
        help="mutants to run (default: the target's whole catalogue; a hybrid target's is the recurrent-state one)",
    )
    mut.add_argument("--out", default="reports/mutants", help="output directory (default: %(default)s)")
    add_options(mut.add_argument, "--", EXPERIMENT_OPTIONS)
    mut.add_argument(
        "--all-cells", action="store_true", help="run every cell a mutant shows in, not only up to the first catch"
    )
    mut.add_argument(
        "--stress",
        choices=("on", "off"),
        default="on",
        help="stress cells (default: on); off leaves the catching to the drafter's own cells",
    )


def run(ns: argparse.Namespace) -> int:
    from losscheck.selftest.command import run as run_catalogue

    options = from_parsed(lambda d: getattr(ns, d))
    return run_catalogue(Path(ns.out), options, ns.names, ns.all_cells, ns.stress == "on")


COMMAND = Command(
    "mutants", "run the gate against the planted-bug catalogue; write the catch table", add_arguments, run
)
