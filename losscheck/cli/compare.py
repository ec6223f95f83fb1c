"""`losscheck compare`: verdict and acceptance differences between two certificates; exit status
1 when the later one regressed."""

from __future__ import annotations

import argparse

from losscheck.cli.command import Command


def add_arguments(cmp: argparse.ArgumentParser) -> None:
    cmp.add_argument("before", help="the earlier run (directory or certificate.json)")
    cmp.add_argument("after", help="the later run; exit status 1 when it regressed")
    cmp.add_argument(
        "--allow-different",
        action="store_true",
        help="compare certificates of different targets, drafters or engines (refused otherwise, exit status 2); "
        "the report opens with what differs",
    )


def run(ns: argparse.Namespace) -> int:
    from losscheck.report import certificate, compare
    from losscheck.report.runs import certificate_file

    before, after = (certificate.load(certificate_file(run)) for run in (ns.before, ns.after))
    text, regressed = compare.report(before, after, ns.allow_different)
    print(text, end="")
    return int(regressed)


COMMAND = Command("compare", "verdict and acceptance differences between two certificates", add_arguments, run)
