"""`losscheck report`: a saved run's summary.md and plots, re-rendered from its certificate.json."""

from __future__ import annotations

import argparse

from losscheck.cli.command import EXIT_PASS, Command


def add_arguments(rep: argparse.ArgumentParser) -> None:
    rep.add_argument("run", help="run directory (reports/<run>) or its certificate.json")


def run(ns: argparse.Namespace) -> int:
    from losscheck.report import certificate
    from losscheck.report.runs import certificate_file

    path = certificate_file(ns.run)
    cert = certificate.load(path)
    written = certificate.render(cert, path.parent)
    print(certificate.headline(cert))
    print("wrote " + ", ".join(str(p) for p in written))
    return EXIT_PASS


COMMAND = Command(
    "report", "re-render a saved run's summary.md and plots from its certificate.json", add_arguments, run
)
