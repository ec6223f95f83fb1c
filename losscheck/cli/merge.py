"""`losscheck merge`: the run directories of a plan's shards (`certify --shard I/N` on N runners)
joined into one certificate of the whole scope; its exit status is the joined verdict's, as
`certify`'s is, and shards that are not one plan's are refused (exit status 2)."""

from __future__ import annotations

import argparse
import os

from losscheck.cli.command import Command

OUT_HELP = "write the joined certificate's DIR/<run>/certificate.json and summary.md (default: %(default)s)"


def add_arguments(merge: argparse.ArgumentParser) -> None:
    merge.add_argument(
        "runs", nargs="+", metavar="RUN", help="each shard's run directory (reports/<run>) or its certificate.json"
    )
    merge.add_argument("--out", metavar="DIR", default="reports", help=OUT_HELP)


def run(ns: argparse.Namespace) -> int:
    from losscheck.cli.certify import VERDICT_EXIT
    from losscheck.report import certificate
    from losscheck.report.merge import ShardRun, merge
    from losscheck.report.runs import certificate_file

    files = [certificate_file(run) for run in ns.runs]
    cert = merge([ShardRun(name, certificate.load(path), path.parent) for name, path in zip(ns.runs, files)])
    path = certificate.write_run(ns.out, cert)
    print(certificate.scope_line(cert))
    print(certificate.headline(cert))
    print(f"certificate written to {path}")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:  # GitHub Actions shows this file on the job's page
        with open(step_summary, "a", encoding="utf-8") as f:
            f.write(certificate.markdown(cert) + "\n")
    return VERDICT_EXIT[cert.verdict]


COMMAND = Command(
    "merge",
    "join the certificates of a plan's shards (certify --shard I/N) into one certificate of the whole scope",
    add_arguments,
    run,
)
