"""`losscheck certify`: run the lossless gate and write a certificate (exit 0 only if all pass)."""

from __future__ import annotations

import argparse
import sys

import pytest


def certify_args(ns: argparse.Namespace) -> list[str]:
    """The pytest command line that `losscheck certify` runs."""
    args = ["--pyargs", "losscheck.certify", "-m", "lossless", "-p", "no:cacheprovider",
            f"--losscheck-out={ns.out}", f"--losscheck-seed={ns.seed}", f"--losscheck-profile={ns.profile}",
            f"--losscheck-alpha={ns.alpha}", "-q", "-rfE"]
    if ns.target:
        args.append(f"--losscheck-target={ns.target}")
    if ns.drafter:
        args.append(f"--losscheck-drafter={ns.drafter}")
    if ns.workers:
        args += ["-n", str(ns.workers)]
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="losscheck", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    cert = sub.add_parser("certify", help="certify a drafter (default: the bundled one on the bundled target)")
    cert.add_argument("--target", help="local Hugging Face model directory of the target")
    cert.add_argument("--drafter", help="import path pkg.mod:factory; factory(target) returns a Drafter")
    cert.add_argument("--out", default="reports", help="reports directory (default: %(default)s)")
    cert.add_argument("--seed", type=int, default=20261129)
    cert.add_argument("--profile", default="ci", choices=("ci", "thorough"))
    cert.add_argument("--alpha", type=float, default=0.01)
    cert.add_argument("-n", "--workers", type=int, default=0, help="pytest-xdist workers (0 = in process)")
    bench = sub.add_parser("bench", help="time the loop against plain decoding and HF assisted generation")
    bench.add_argument("--out", default="reports/bench", help="output directory (default: %(default)s)")
    fam = sub.add_parser("families", help="compare the bundled drafter families' acceptance on the bundled target")
    fam.add_argument("--out", default="reports/families", help="output directory (default: %(default)s)")
    fam.add_argument("--seed", type=int, default=20261129)
    fam.add_argument("--ks", type=int, nargs="+", default=[4, 8, 16], help="block lengths (default: 4 8 16)")
    fam.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (default: %(default)s)")
    fam.add_argument("--repeats", type=int, default=16, help="T=1 draws per prompt (default: %(default)s)")
    mut = sub.add_parser("mutants", help="run the gate against the planted-bug catalogue; write the catch table")
    mut.add_argument("names", nargs="*", help="mutants to run (default: the whole catalogue)")
    mut.add_argument("--out", default="reports/mutants", help="output directory (default: %(default)s)")
    mut.add_argument("--seed", type=int, default=20261129)
    mut.add_argument("--profile", default="ci", choices=("ci", "thorough"))
    mut.add_argument("--alpha", type=float, default=0.01)
    mut.add_argument("--all-cells", action="store_true", help="run every cell a mutant shows in, not only up to the first catch")
    ns = parser.parse_args(argv)
    if ns.command == "certify":
        return int(pytest.main(certify_args(ns)))
    if ns.command == "mutants":
        from pathlib import Path

        from losscheck.mutants.command import run

        return run(Path(ns.out), ns.seed, ns.profile, ns.alpha, ns.names, ns.all_cells)
    if ns.command == "families":
        from pathlib import Path

        from losscheck.report.families import compare_families

        compare_families(Path(ns.out), ns.seed, tuple(ns.ks), ns.max_new, ns.repeats)
        print(f"wrote {ns.out}/table.md, table.json, slot_acceptance.png")
        return 0
    if ns.command == "bench":
        from pathlib import Path

        from losscheck.bench import run_benchmarks

        run_benchmarks(Path(ns.out))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
