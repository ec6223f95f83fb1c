"""`losscheck families`: the bundled drafter families' acceptance on the bundled target, compared."""

from __future__ import annotations

import argparse
from pathlib import Path

from losscheck.cli.command import EXIT_PASS, Command
from losscheck.run.options import add_options, dest


def add_arguments(fam: argparse.ArgumentParser) -> None:
    fam.add_argument("--out", default="reports/families", help="output directory (default: %(default)s)")
    add_options(fam.add_argument, "--", ("seed",))
    fam.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16], help="block lengths (default: 4 8 16)")
    fam.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    fam.add_argument("--repeats", type=int, default=16, help="T=1 draws per prompt (default: %(default)s)")


def run(ns: argparse.Namespace) -> int:
    from losscheck.perf.families import compare_families

    compare_families(Path(ns.out), getattr(ns, dest("seed")), tuple(ns.ks), ns.max_new, ns.repeats)
    print(f"wrote {ns.out}/table.md, table.json, slot_acceptance.png")
    return EXIT_PASS


COMMAND = Command(
    "families", "compare the bundled drafter families' acceptance on the bundled target", add_arguments, run
)
